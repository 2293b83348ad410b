"""Which committed steps a tier may delete. Pure policy, no I/O.

Invariants, whatever the policy says:

- a step still waiting to become durable on a lower tier (its promotion pending, running or
  failed) is never evicted: it may be the only copy (:func:`decide` holds it back, asking the
  caller, which can look at the lower tier);
- the newest committed step of a tier is never evicted, so a tier that holds anything keeps
  its newest durable step;
- pinned steps and milestones (step number a multiple of ``keep_every``) are kept;
- only committed steps are candidates. A save in flight is not a committed step, so it
  neither counts toward ``keep_latest`` nor makes an older step evictable (the
  Megatron-Bridge async-overlap bug).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError
from . import step_names


@dataclass(frozen=True)
class RetentionPolicy:
    """What one tier keeps: the newest ``keep_latest`` steps, every ``keep_every``-th step
    (milestones, by step number), and the ``pinned`` step names."""

    keep_latest: int = 2
    keep_every: int | None = None
    pinned: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.keep_latest < 1:
            raise ConfigError(
                f"keep_latest must be >= 1 (the newest step is always kept), got {self.keep_latest}"
            )
        if self.keep_every is not None and self.keep_every < 1:
            raise ConfigError(f"keep_every must be >= 1, got {self.keep_every}")
        object.__setattr__(self, "pinned", frozenset(self.pinned))


@dataclass(frozen=True)
class StepState:
    """A committed step of one tier as retention sees it: a name and a commit time, whichever
    tier or framework listed it (a local directory, a remote marker, a shim's numbering)."""

    name: str
    committed_at_ns: int


def evictions(steps: Iterable[StepState], policy: RetentionPolicy) -> list[str]:
    """Names of the steps the policy would delete from this tier, oldest first (before the
    steps still awaiting a lower tier are held back: :func:`decide`)."""
    ordered: Sequence[StepState] = sorted(
        steps, key=lambda s: step_names.order_key(s.name, s.committed_at_ns)
    )
    latest = {s.name for s in ordered[-policy.keep_latest :]}
    doomed = []
    for s in ordered:
        num = step_names.order_number(s.name)
        milestone = (
            policy.keep_every is not None and num is not None and num % policy.keep_every == 0
        )
        if s.name in latest or s.name in policy.pinned or milestone:
            continue
        doomed.append(s.name)
    return doomed


def superseded(step: StepState, kept: Iterable[StepState], policy: RetentionPolicy) -> bool:
    """Whether ``policy`` would delete ``step`` from a tier holding ``kept`` as soon as it got
    there (newer steps fill ``keep_latest``; it is no milestone, not pinned): a step the
    remote's retention already pruned, or would prune on arrival, need not be uploaded."""
    others = [s for s in kept if s.name != step.name]
    return step.name in evictions([*others, step], policy)


def decide(
    steps: Iterable[StepState], policy: RetentionPolicy, awaiting: Callable[[str], bool]
) -> tuple[list[str], list[str]]:
    """``(deleted, held)``, oldest first: the :func:`evictions` of ``steps``, split by
    ``awaiting(name)``. A step it says is not durable on the lower tier yet (or that it cannot
    be told) is held, never deleted. ``awaiting`` is asked only about the steps the policy
    would delete (for a remote tier each answer costs a listing)."""
    deleted: list[str] = []
    held: list[str] = []
    for name in evictions(steps, policy):
        (held if awaiting(name) else deleted).append(name)
    return deleted, held


@dataclass(frozen=True)
class Retention:
    """Retention of the disk and remote tiers (the memory tier always holds the newest two
    snapshots, in its two slots). The remote tier keeps everything unless told otherwise,
    because deletes there cannot be undone."""

    local: RetentionPolicy = field(default_factory=lambda: RetentionPolicy(keep_latest=2))
    remote: RetentionPolicy | None = None
