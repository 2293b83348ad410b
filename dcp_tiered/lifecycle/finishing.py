"""Ending saves collectively: the shims' way (the manager's is per rank,
:mod:`~dcp_tiered.lifecycle.reaping`).

At each save (and at the end) every rank finishes the saves in flight at the same call: the
framework's ``finalize`` on every rank, its tracker (``on_commit``) on rank 0, and, if the save
failed on any rank, ``on_failure`` (clean-up) on every rank and SaveFailedError on every rank.
"""

from __future__ import annotations

import logging

from torch.distributed.checkpoint.api import CheckpointException

from ..agreement import Agreement
from .failures import Conventions, raise_save_failed
from .retention import Keepers
from .saves import InFlight, Save

logger = logging.getLogger("dcp_tiered.lifecycle")  # the name its records always had


class Finishing:
    """The collective half of :class:`~dcp_tiered.lifecycle.Lifecycle` (a base class of it)."""

    saves: InFlight
    keepers: Keepers
    agree: Agreement
    conventions: Conventions
    rank: int

    @property
    def in_flight(self) -> str | None:
        """The step of the newest save in flight, or None."""
        newest = self.saves.newest
        return newest.step if newest is not None else None

    def written(self) -> bool:
        """Collective: whether every rank's part of every save in flight is written."""
        return self.agree.all(all(s.future.done() for s in self.saves.saves))

    def finish(self) -> str | None:
        """Collective: finishes the saves in flight, oldest first; returns the newest one's
        step, or None if there was none. Raises SaveFailedError on every rank if one failed on
        any (the first that did, once all are finished)."""
        saves = self.saves.take_all()
        if not self.agree.any(bool(saves)):
            return None
        failed: tuple[Save, BaseException | None] | None = None
        for save in saves:  # every rank has the same saves in flight
            error = self._finish_one(save)
            if self.agree.any(error is not None):
                if save.on_failure is not None:
                    try:
                        save.on_failure()
                    except Exception as e:  # noqa: BLE001 - the save's own error matters more
                        logger.warning("cleaning up after the failed save of %s: %s", save.step, e)
                failed = failed or (save, error)
            if failed is None:  # retention runs after a commit, never after a failure
                self.keepers.prune(save.root)
        if failed is not None:
            self._fail(*failed)
        return saves[-1].step

    def _finish_one(self, save: Save) -> BaseException | None:
        try:
            save.future.result()
            if save.finalize is not None:
                save.finalize()
            if self.rank == 0 and save.on_commit is not None:
                (save.published.result() if save.published is not None else save.on_commit())
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
            return e
        return None

    def _fail(self, save: Save, error: BaseException | None) -> None:
        raise_save_failed(self.agree, self.conventions, self.rank, save.root, save.step, error)
