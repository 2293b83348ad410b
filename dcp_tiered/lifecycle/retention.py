"""Retention of the roots an entry point saves to: one process a root applies it (whoever
holds the root's retention lock, which the kernel drops with the process, whatever the node
layout), and rank 0 applies the remote policy."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from ..backends.local import LocalBackend
from ..policy import layout
from ..policy.retention import RetentionPolicy
from ..tiers.housekeeping import prune_local, prune_remote
from .writers import Writers

logger = logging.getLogger("dcp_tiered.lifecycle")  # the name its records always had


class Keepers:
    """Applies ``local`` to each root (None: keep everything) and ``remote`` to the remote
    tier (None: it keeps everything; deletes there cannot be undone)."""

    def __init__(
        self,
        writers: Writers,
        local: RetentionPolicy | None,
        remote: RetentionPolicy | None,
        *,
        rank: int,
        label: str,
    ) -> None:
        self.writers, self.local, self.remote = writers, local, remote
        writers.remote_retention = lambda: self.remote  # its uploads skip what it would drop
        self.rank, self.label = rank, label
        # root -> (its backend, the retention lock if this process holds it)
        self._locks: dict[str, tuple[LocalBackend, int | None]] = {}
        self._background: ThreadPoolExecutor | None = None
        self._pass: Future[list[str]] | None = None

    def hold(self, root: str) -> bool:
        """Takes ``root``'s retention lock now if no process holds it; whether this one does."""
        if root not in self._locks:
            backend = self.writers.tiers(root).local.backend
            self._locks[root] = (backend, backend.try_lock_exclusive(layout.RETENTION_LOCK_NAME))
        return self._locks[root][1] is not None

    def prune(self, root: str) -> list[str]:
        """One pass over ``root`` (if this process holds its lock) and, on rank 0, the remote
        tier; failures are logged, not raised (the pass after the next save retries)."""
        deleted: list[str] = []
        if self.local is None:
            return deleted
        tiers, writer = self.writers.tiers(root), self.writers.get(root)
        try:
            if self.hold(root):
                deleted = prune_local(
                    tiers.local,
                    self.local,
                    tiers.remote,
                    label=self.label,
                    remote_policy=self.remote,
                )
            if self.rank == 0 and self.remote is not None and tiers.remote:
                deleted += prune_remote(tiers.remote, self.remote, writer.run_id)
        except Exception as e:  # noqa: BLE001 - retried after the next save
            logger.warning("retention pass of %s failed (retried after the next save): %s", root, e)
        return deleted

    def prune_in_background(self, root: str) -> None:
        """A pass on a thread of its own, unless one is running (the next save's follows)."""
        if self._pass is not None and not self._pass.done():
            return
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="dcp-tiered-retention")
        self._pass = self._background.submit(self.prune, root)

    def settle(self, root: str) -> None:
        """Waits for the background pass, then runs one more (the last saves' steps)."""
        if self._pass is not None:
            self._pass.result()
        self.prune(root)

    def release(self) -> None:
        if self._background is not None:
            self._background.shutdown()
            self._background, self._pass = None, None
        locks, self._locks = list(self._locks.values()), {}
        for backend, lock in locks:
            if lock is not None:
                backend.unlock(lock)
