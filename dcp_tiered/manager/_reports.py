"""What each of the manager's saves achieved, per tier (:class:`Outcomes`), and the events that
tell it: the hooks the lifecycle runs on this rank as a save is written and uploaded."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

from ..errors import InsufficientSpaceError, causes, describe
from ..events import EventLog
from ..lifecycle import Lifecycle
from ..policy.admission import Admission
from ..policy.cadence import Decision
from ..policy.outcomes import COMMITTED, FAILED, SKIPPED, Outcomes, SaveOutcome
from ._events import SaveFacts, saved

logger = logging.getLogger("dcp_tiered.manager")  # the name its records always had


class Reports:
    """Outcomes and events of one manager's saves. ``where`` names each tier's location in a
    failure ("memory", "local", "remote"); ``has_remote``: a remote tier is configured."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        events: EventLog,
        admission: Admission,
        *,
        rank: int,
        where: dict[str, str],
        has_remote: bool,
    ) -> None:
        self.lifecycle, self.events, self.admission = lifecycle, events, admission
        self.rank, self.where, self.has_remote = rank, where, has_remote
        self.outcomes = Outcomes()  # what each save achieved, per tier (see wait())
        self.unreported: list[int] = []  # steps wait() has not reported final yet
        self.skipped = 0  # saves skipped: no room, or at the in-flight cap

    def planned(self, step: int, decision: Decision, state: str, why: str | None = None) -> None:
        """The outcome of the tiers ``decision`` saves ``step`` to: the disk (and remote) or
        host memory."""
        tiers = ["local"] if decision.local else ["memory"]
        if decision.local and decision.remote and self.has_remote:
            tiers.append("remote")
        self.outcomes.record(step, tiers, state, why)
        if step not in self.unreported:
            self.unreported.append(step)

    def skip(self, step: int, decision: Decision, tier: str, reason: str, warning: str) -> None:
        """A save not started: no room, or at the in-flight cap."""
        self.planned(step, decision, SKIPPED, reason)
        self.skipped += 1
        logger.warning("%s", warning)
        self.events.emit("skipped", step=step, tier=tier, rank=self.rank, reason=reason)

    def final(self) -> dict[int, dict[str, SaveOutcome]]:
        """The outcomes not reported final yet; those that are now are not reported again."""
        report = self.outcomes.steps(self.unreported)
        self.unreported = [
            step for step, tiers in report.items() if not all(o.done for o in tiers.values())
        ]
        return report

    def written(self, facts: SaveFacts, written: Future[Any]) -> bool:
        """This rank's part of a save ended: its outcome recorded; True when this process
        uploads its node's copy (the lifecycle then follows the upload)."""
        error = written.exception()
        if error is not None and self._did_not_fit(error):
            self._skip_unfit(facts, error)
            return False
        if error is not None:
            self.fail(facts, facts.tier, error)
            return False
        report = facts.save.report if facts.save is not None else None
        if facts.tier == "memory":
            facts.timings = written.result()
        elif report is not None:  # None: the save ran in DCP's checkpoint process
            facts.timings = {"write_s": report.write_s}
            if report.commit_s is not None:
                facts.timings["commit_s"] = report.commit_s
        self.outcomes.record(facts.step, [facts.tier], COMMITTED)
        if report is not None and report.uploads:  # this process promotes its node's copy
            return True
        if facts.remote:  # another process uploads: its outcome is not known here
            self.outcomes.forget(facts.step, "remote")
        self._emit(facts)
        return False

    def durable(self, facts: SaveFacts, error: BaseException | None) -> None:
        """This process's upload of the save ended."""
        if error is not None:
            self.fail(facts, "remote", error)
        else:
            self.outcomes.record(facts.step, ["remote"], COMMITTED)
            self._emit(facts)

    def fail(self, facts: SaveFacts, tier: str, error: BaseException) -> None:
        """Recorded in the lifecycle, raised on every rank at the next save's vote."""
        where = self.where[tier]
        self.lifecycle.record_failure(facts.name, tier, where, error)
        tiers = [tier] + (["remote"] if facts.remote and tier != "remote" else [])
        self.outcomes.record(facts.step, tiers, FAILED, describe(error))
        self.events.emit(
            "failed", step=facts.step, rank=self.rank, tier=tier, where=where, error=describe(error)
        )

    def _did_not_fit(self, error: BaseException) -> bool:
        """A save the tier had no room for after all (the state grew past the estimate, or
        something else filled the disk): under ``when_full='skip'`` it is skipped, not failed."""
        return self.admission.when_full == "skip" and any(
            isinstance(c, InsufficientSpaceError) for c in causes(error)
        )

    def _skip_unfit(self, facts: SaveFacts, error: BaseException) -> None:
        self.skipped += 1
        tiers = [facts.tier] + (["remote"] if facts.remote else [])
        self.outcomes.record(facts.step, tiers, SKIPPED, describe(error))
        logger.warning(
            "step %d was not saved to the %s tier, which had no room for it after "
            "all (Admission.when_full='skip'; nothing of it was kept, earlier steps "
            "are intact): %s",
            facts.step,
            facts.tier,
            describe(error),
        )
        self.events.emit(
            "skipped", step=facts.step, tier=facts.tier, rank=self.rank, reason=describe(error)
        )

    def _emit(self, facts: SaveFacts) -> None:
        upload = self.lifecycle.upload_times(facts.save) if facts.save is not None else None
        self.events.emit("saved", **saved(facts, self.rank, upload))
