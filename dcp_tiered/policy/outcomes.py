"""What each save achieved, per tier: the answer ``CheckpointManager.save`` cannot give when it
returns (it returns once the state is staged; the write, the commit and the upload come
later, and a disk that filled meanwhile skips the save). Pure: no I/O."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

PENDING = "pending"  # started; not committed on that tier yet
COMMITTED = "committed"  # on that tier (remote: durable there)
SKIPPED = "skipped"  # not saved there, on purpose: no room, saves in flight at the cap
FAILED = "failed"  # the save there failed; raised (SaveFailedError) at the next save or close
STATES = (PENDING, COMMITTED, SKIPPED, FAILED)


@dataclass(frozen=True)
class SaveOutcome:
    """One step's save on one tier, as this process saw it.

    ``tier`` is ``"memory"``, ``"local"`` or ``"remote"``; ``state`` one of ``"pending"``,
    ``"committed"``, ``"skipped"``, ``"failed"``; ``reason`` says why a save was skipped or
    failed (None otherwise)."""

    step: int
    tier: str
    state: str
    reason: str | None = None

    @property
    def done(self) -> bool:
        """Whether the outcome is final (not pending)."""
        return self.state != PENDING


class Outcomes:
    """Step -> tier -> :class:`SaveOutcome`, for the newest ``keep`` steps saved."""

    def __init__(self, keep: int = 1024) -> None:
        self.keep = keep
        self._by_step: OrderedDict[int, dict[str, SaveOutcome]] = OrderedDict()

    def record(self, step: int, tiers: list[str], state: str, reason: str | None = None) -> None:
        assert state in STATES, state
        entry = self._by_step.setdefault(step, {})  # kept in the order steps were first saved
        for tier in tiers:
            entry[tier] = SaveOutcome(step, tier, state, reason)
        while len(self._by_step) > self.keep:
            self._by_step.popitem(last=False)

    def forget(self, step: int, tier: str) -> None:
        self._by_step.get(step, {}).pop(tier, None)

    def of(self, step: int) -> dict[str, SaveOutcome]:
        return dict(self._by_step.get(step, {}))

    def steps(self, steps: list[int] | None = None) -> dict[int, dict[str, SaveOutcome]]:
        """The outcomes of ``steps`` (default: every step kept, in the order first saved)."""
        wanted = list(self._by_step) if steps is None else steps
        return {s: dict(self._by_step[s]) for s in wanted if s in self._by_step}
