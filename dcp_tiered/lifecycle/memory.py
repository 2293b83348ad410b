"""Host-memory snapshots for an entry point with a memory cadence: each rank's own
:class:`~dcp_tiered.tiers.memory.MemoryTier`, with partner replication when asked, and the
restore side (which steps every rank can load, loading one, the warning about steps lost with
their node). One wiring of the memory tier and its Replicator, for the adapters."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..events import EventLog
from ..policy.replication import Replication
from ..policy.step_names import order_number
from ..tiers import snapshots
from ..tiers.memory import MemoryTier
from ..tiers.replica import Replicator
from .save_thread import SaveThread
from .saves import settled


class MemorySnapshots:
    """This rank's snapshots under ``root``; with ``replication``, each one is also copied to
    partner nodes' host memory in the background. Replication's events (replicated,
    restored_from_partner, lost) go to ``emit`` (default: the ``dcp_tiered.events`` logger).
    Collective with replication: build it on every rank, in the same order."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        rank: int,
        *,
        world_size: int,
        run_id: str | None,
        allow_pickle: bool,
        replication: Replication | None,
        timeout_secs: float,
        emit: Callable[..., Any] | None = None,
    ) -> None:
        self.rank = rank
        self._save_thread = SaveThread()
        self.tier = MemoryTier(
            root, rank, allow_pickle=allow_pickle, run_id=run_id, world_size=world_size
        )
        self.emit = emit if emit is not None else EventLog(None).emit
        self.replica = (
            Replicator(self.tier, replication, timeout_secs=timeout_secs, emit=self.emit)
            if replication is not None
            else None
        )

    @property
    def root(self) -> str:
        return str(self.tier.root)

    @property
    def replicating(self) -> bool:
        """Whether loads are collective (with replication, a rank may take a partner's copy)."""
        return self.replica is not None

    def save(self, step: str, state: dict[str, Any]) -> Future[Any]:
        """Writes this rank's snapshot of ``step`` (the future: until it is in memory), on the
        save thread (:mod:`~dcp_tiered.lifecycle.save_thread`; inline when called on one, as
        by the manager's save)."""
        return self._save_thread.run(self.tier.save, step, state)

    def replicate(self, number: int, step: str) -> None:
        """After every rank saved ``step``: to the partners in the background, if replicating."""
        if self.replica is not None:
            self.replica.offer(number, step, settled())

    # ------------------------------------------------------------ restoring

    def survey(self) -> None:
        """Collective with replication: what every rank holds, for :meth:`numbers` and loads."""
        if self.replica is not None:
            self.replica.survey()

    def numbers(self) -> list[int]:
        """The step numbers to try from memory (with replication: those every rank can get
        whole, as of the last survey; else this rank's own)."""
        names = snapshots.candidates(self.tier, self.replica)
        return [n for n in map(order_number, names) if n is not None]

    def load(self, step: str, state: dict[str, Any]) -> str | None:
        """Loads this rank's snapshot of ``step`` into ``state``; None, or why it failed
        (collective with replication: a rank without a valid copy takes a partner's)."""
        return snapshots.load(self.tier, self.replica, step, state)

    def report_lost(self, restored: int, what: str | None) -> None:
        """Warns (rank 0) about steps newer than ``restored`` lost with their node."""
        snapshots.report_lost(self.replica, restored, what, rank=self.rank, emit=self.emit)

    # ------------------------------------------------------------ ending

    def drain(self, timeout_secs: float | None = None) -> None:
        """Until the newest snapshot is on the partners (collective with replication)."""
        if self.replica is not None:
            self.replica.drain(timeout_secs)

    def close(self) -> None:
        self._save_thread.close()
        if self.replica is not None:
            self.replica.close(0)
        self.tier.close()
