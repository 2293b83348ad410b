"""Ending saves per rank, without a collective: the manager's way (a shim's is the collective
:meth:`~dcp_tiered.lifecycle.finishing.Finishing.finish`).

The training thread never waits for a save: at each save, each rank reaps what ended (the
save's ``on_written`` hook, then ``on_durable`` once the upload this process runs ended) and
records failures, which the ranks agree on at the next save's vote and raise together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..agreement import Agreement
from .failures import failure, raise_failures
from .retention import Keepers
from .saves import DISK, InFlight, Save
from .writers import Writers

logger = logging.getLogger(__name__)


class Reaping:
    """The per-rank half of :class:`~dcp_tiered.lifecycle.Lifecycle` (a base class of it)."""

    saves: InFlight
    writers: Writers
    keepers: Keepers
    agree: Agreement
    rank: int
    home: str | None
    failures: list[dict[str, Any]]

    def reap(self) -> bool:
        """Per rank, no collective: runs ``on_written`` of the saves whose future ended and
        ``on_durable`` of those whose upload (by this process) ended, taking them out of
        flight; then a retention pass of the start root in the background. Whether any save
        ended. Failures are the hooks' to record (:meth:`record_failure`)."""
        finished = False
        for save in self.saves.take_written():
            finished = True
            if save.tier == DISK:
                save.report = self.writers.tiers(save.root).take_report(save.step)
            follow = save.on_written(save.future) if save.on_written is not None else False
            if follow:
                self.saves.uploading.append(save)
        for save in list(self.saves.uploading):
            # A follower node publishes (and enqueues its upload) just after the save returns.
            save.upload = save.upload or (save.report.upload if save.report else None)
            if save.upload is None and time.time() - save.started > self._publish_timeout(save):
                self.saves.uploading.remove(save)
                self._durable(save, TimeoutError("this node never published the step"))
                continue
            if save.upload is None or not save.upload.done():
                continue
            self.saves.uploading.remove(save)
            finished = True
            self._durable(save, save.upload.exception())
        if finished and self.home is not None:
            self.keepers.prune_in_background(self.home)
        return finished

    def make_room(self) -> None:
        """Per rank: waits (reaping) until fewer disk saves than ``max_in_flight`` are in
        flight."""
        while self.saves.full():
            self.saves.wait(self.saves.on_disk()[:1])
            self.reap()

    def wait_written(self) -> None:
        """Per rank: until every save in flight is written or failed (reaped later)."""
        self.saves.wait()

    def expire_uploads(self, error: BaseException) -> None:
        """Per rank: gives up following the uploads still running, each failing with
        ``error``."""
        for save in list(self.saves.uploading):
            self.saves.uploading.remove(save)
            self._durable(save, error)

    def upload_times(self, save: Save) -> tuple[float, float] | None:
        """When this process's promotion of ``save`` started and made it durable (None: it
        ran none, or it did not succeed)."""
        up = save.upload
        if up is None or not up.done() or up.cancelled() or up.exception() is not None:
            return None
        times: tuple[float, float] = up.result()
        return times

    def _publish_timeout(self, save: Save) -> float:
        return self.writers.config.commit_timeout_secs

    def _durable(self, save: Save, error: BaseException | None) -> None:
        if save.on_durable is not None:
            save.on_durable(error)

    def record_failure(self, step: str, tier: str, where: str, error: BaseException) -> None:
        """Per rank: a failure of this rank, raised on every rank by :meth:`raise_recorded`."""
        self.failures.append(failure(self.rank, step, tier, where, error))

    def raise_recorded(self, headline: str, todo: str) -> None:
        """Collective, once the ranks agreed that some rank recorded a failure: raises
        SaveFailedError on every rank naming every rank's, and forgets them."""
        mine, self.failures = self.failures, []
        raise_failures(self.agree, mine, headline, todo)

    def drain(
        self, deadline: float | None, raise_recorded: Callable[[], None], *, late: str
    ) -> None:
        """Collective: reaps until no rank follows an upload; as soon as any rank recorded a
        failure, ``raise_recorded()`` on every rank, instead of some waiting for work that
        can no longer finish. Uploads still running at ``deadline`` (``time.monotonic()``)
        fail with TimeoutError(``late``)."""
        while True:
            self.reap()
            if deadline is not None and time.monotonic() > deadline:
                self.expire_uploads(TimeoutError(late))
            failed, pending = self.agree.vote(
                [int(bool(self.failures)), int(bool(self.saves.uploading))]
            )
            if failed:
                raise_recorded()
            if not pending:
                return
            time.sleep(0.05)

    def wait_resumed_uploads(self, deadline: float | None) -> None:
        """This rank's uploads of earlier jobs' steps (resumed at start), waited for until
        ``deadline`` (``time.monotonic()``; None: the remote's ``durable_timeout_secs``). Not
        this job's saves: a step still not durable stays committed locally, held, and the next
        job resumes it, so it is logged, not raised."""
        for tiers, _ in self.writers.owned():
            if tiers.remote is None:
                continue
            timeout = (
                tiers.remote.config.durable_timeout_secs
                if deadline is None
                else max(0.0, deadline - time.monotonic())
            )
            for step, why in sorted(tiers.wait_uploads(timeout).items()):
                logger.warning(
                    "%s (an earlier job's step) is not durable on %s yet (%s): it stays "
                    "committed in %s, and the next job on that root resumes its upload",
                    step,
                    tiers.remote.config.url,
                    why,
                    tiers.root,
                )
