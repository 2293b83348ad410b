"""One committed step as a listing finds it, on whichever tiers hold it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..policy.identity import Owner, RunRecord


@dataclass(frozen=True)
class CommittedStep:
    """A committed step: where it is, when it was committed, and which save of which run it
    is by the record that committed it (its local manifest's head, else its remote marker).
    A listing reads no more than that: the step's index is read by whatever loads it."""

    name: str
    committed_at_ns: int  # -1: its manifest cannot be read
    verified_format: bool = True  # False: a vanilla DCP directory without our manifest
    run_id: str | None = None  # the run that saved it (None: before run ids, or unread)
    save_id: str = ""
    as_saved: bool = True  # stored under the step name its manifest gives (not a copy)
    local: bool = True  # a committed directory on the local tier
    remote: bool = False  # a commit marker on the remote tier
    # that marker names another save of this step name than the local one (saved again
    # locally, never uploaded): the local save is not durable there
    remote_other: bool = False

    def owner(self, record: RunRecord | None) -> Owner:
        """Whose this step is for the run ``record`` (a root's): ours only when its record is
        readable, names this step and the run (or the run adopted it)."""
        if not self.verified_format or not self.as_saved or self.committed_at_ns < 0:
            return Owner.FOREIGN
        if record is None:
            return Owner.UNOWNED if self.run_id is None else Owner.FOREIGN
        return record.owner(self.run_id, self.name, self.save_id)

    def whose(self, owner: Owner) -> str:
        """``owner`` (this step's :meth:`owner`) in words, for an error message."""
        if not self.verified_format or self.committed_at_ns < 0:
            return "not a step of ours (no readable dcp_tiered manifest)"
        if not self.as_saved:
            return "a copy of another step (its manifest names another step)"
        if owner == Owner.UNOWNED:
            return "saved before run identities (no run id)"
        return f"run {self.run_id!r}'s"

    def also_remote(self, committed_at_ns: int, save_id: str | None = None) -> CommittedStep:
        """This local step, found committed on the remote too (at ``committed_at_ns``, as
        save ``save_id``): the same save, or (``remote_other``) another one."""
        return replace(
            self,
            committed_at_ns=max(committed_at_ns, self.committed_at_ns),
            remote=True,
            remote_other=bool(save_id and self.save_id and save_id != self.save_id),
        )


def remote_only(name: str, committed_at_ns: int, run_id: str | None = None) -> CommittedStep:
    """A step committed on the remote tier (its marker's fields) that the local tier lacks."""
    return CommittedStep(name, committed_at_ns, run_id=run_id, local=False, remote=True)
