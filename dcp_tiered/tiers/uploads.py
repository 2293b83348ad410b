"""The upload queue: which committed steps this process promotes to the remote tier, when.

An :class:`Uploader` runs the promotions (:class:`~dcp_tiered.tiers.promotion.Promotion`, the
remote commit protocol) of one local root to one remote in commit order, on daemon threads. Its
one owner is the root's :class:`~dcp_tiered.tiers.root.Tiers`, which stops it when closed. At
interpreter exit, what is still pending is abandoned with one warning: the steps stay committed
locally and the next writer on the root resumes them.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # before the exit hook below is registered: see there
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError

from .. import _retry
from .._daemon_pool import DaemonPool
from .._priority import lower_this_thread
from .._stdlib_compat import at_interpreter_shutdown
from ..backends.remote import RemoteBackend
from ..errors import ForeignRunError, ManifestError, UploadFailedError
from ..policy import layout
from ..policy.identity import Owner
from ..policy.retention import RetentionPolicy, StepState
from . import ownership
from .file_upload import upload_locked
from .housekeeping import RemoteRetention
from .local import LocalTier
from .promotion import CLAIMED, Promotion, claim_body
from .remote import RemoteTier

logger = logging.getLogger(__name__)

# In a save's upload area: whether the step was free on the remote when its first early
# upload on this node asked (Uploader._remote_step_free).
_REMOTE_STEP_FREE, _REMOTE_STEP_TAKEN = "remote-step-free", "remote-step-taken"


class Uploader:
    """Promotes the committed steps of one local root to one remote, in commit order. Each
    promotion's future ends with when it started and made the step durable (epoch seconds)."""

    def __init__(
        self,
        tier: LocalTier,
        remote: RemoteBackend,
        retention: Callable[[], RetentionPolicy | None] = lambda: None,
    ) -> None:
        self.tier, self.remote = tier, remote
        self._retention = retention  # the remote tier's policy, if one applies to it
        self._steps = DaemonPool(1, "dcp-tiered-upload", lower_this_thread)
        self._files = DaemonPool(
            remote.config.max_concurrency, "dcp-tiered-upload-file", lower_this_thread
        )
        self._futures: dict[str, Future[tuple[float, float]]] = {}
        self._lock = threading.Lock()
        self._resume_lock: int | None = None
        self._step_free: dict[tuple[str, str], bool] = {}  # see _remote_step_free
        self._remote_run: str | None = None  # the run the prefix is known to record
        _LIVE.add(self)

    def submit(self, step: str, *, new_commit: bool = True) -> Future[tuple[float, float]]:
        """Enqueue the promotion of ``step``. A new commit always gets its own promotion (it
        runs after any earlier one and reads the manifest then); a resume reuses a pending one."""
        with self._lock:
            fut = self._futures.get(step)
            if new_commit or fut is None or fut.done():
                fut = self._steps.submit(self._promote, step)
                self._futures[step] = fut
            return fut

    def remote_run(self, run_id: str) -> None:
        """The remote prefix recorded as run ``run_id``'s before anything of the run is written
        there (once per process); ForeignRunError if it is another run's."""
        if self._remote_run != run_id:
            self._remote_run = ownership.record_remote(self.remote, run_id, self.tier.root).run_id

    def upload_early(
        self, step: str, save_id: str, name: str, checksum: str, node: int, run_id: str
    ) -> None:
        """Start uploading a data file as soon as it is written, before the local commit.

        Data objects are invisible until the step's marker exists, so this only overlaps the
        upload with the rest of the save. Best effort: whatever does not finish here is
        uploaded by the promotion after the commit.
        """
        try:  # now, so that a promotion starting before the upload does waits on its lock
            self.tier.backend.make_dir(layout.upload_area_name(step, save_id))
        except OSError as e:
            logger.debug("early upload of %s/%s deferred to the promotion: %s", step, name, e)
            return
        self._files.submit(self._upload_early, step, save_id, name, checksum, node, run_id)

    def _upload_early(
        self, step: str, save_id: str, name: str, checksum: str, node: int, run_id: str
    ) -> None:
        keys = RemoteTier(self.remote).keys(step, save_id)
        area = layout.upload_area_name(step, save_id)
        backend = self.tier.backend
        if not (backend.exists(layout.tmp_dir_name(step, save_id)) or backend.exists(step)):
            # The save failed before this file's turn: the next save's sweep may be removing
            # its upload area now, which this upload would make again.
            logger.debug("early upload of %s/%s dropped: the save was abandoned", step, name)
            return
        try:
            upload_locked(
                self.tier,
                self.remote,
                keys,
                name,
                checksum,
                early=True,
                may_start=lambda: self._remote_step_free(keys, area, node, run_id),
            )
        except Exception as e:  # noqa: BLE001 - the promotion uploads it instead
            logger.debug("early upload of %s/%s deferred to the promotion: %s", step, name, e)

    def _remote_step_free(self, keys: layout.RemoteKeys, area: str, node: int, run_id: str) -> bool:
        """Whether no save of the step is committed on the remote (remote steps are immutable:
        never write under a committed one) and the prefix is this run's; if so, this node's
        claim on the save is written before its first object. One marker read per node and
        save: the first rank to ask records the answer in the node's upload area for the
        others."""
        step, save_id = keys.step, str(keys.save_id)
        with self._lock:
            free = self._step_free.get((step, save_id))
        if free is not None:
            return free
        backend = self.tier.backend
        lock = backend.lock_exclusive(area, "remote-step.lock")
        try:
            if backend.exists(area, _REMOTE_STEP_FREE):
                free = True
            elif backend.exists(area, _REMOTE_STEP_TAKEN):
                free = False
            else:
                try:
                    self.remote_run(run_id)
                    free = RemoteTier(self.remote).marker(step) is None
                except ForeignRunError as e:  # the promotion says so, to the caller
                    logger.debug("no early upload of %s: %s", step, e)
                    free = False
                if free:
                    self.remote.put_bytes(keys.claim(node), claim_body(keys, node, run_id))
                    backend.write_file(area, CLAIMED, b"", sync=False)
                answer = _REMOTE_STEP_FREE if free else _REMOTE_STEP_TAKEN
                backend.write_file(area, answer, b"", sync=False)
        finally:
            backend.unlock(lock)
        with self._lock:
            self._step_free[(step, save_id)] = free
        return free

    def _promote(self, step: str) -> tuple[float, float]:
        started = time.time()
        try:
            Promotion(self.tier, self.remote, step, self._files, self.remote_run).run()
        except BaseException as e:
            if not _retry.EXITING.is_set():  # at exit, _abandon_at_exit says it once
                logger.error("step %s is not durable on %s: %s", step, self.remote.config.url, e)
            raise
        return started, time.time()

    def future(self, step: str) -> Future[tuple[float, float]] | None:
        with self._lock:
            return self._futures.get(step)

    def futures(self) -> list[Future[tuple[float, float]]]:
        with self._lock:
            return list(self._futures.values())

    def steps(self) -> list[str]:
        with self._lock:
            return list(self._futures)

    def not_durable(self) -> dict[str, str]:
        """Steps this process enqueued that are not durable, each with why (now)."""
        out = {}
        with self._lock:
            futures = dict(self._futures)
        for step, fut in futures.items():
            if not fut.done():
                out[step] = "still uploading"
            elif fut.cancelled():
                out[step] = "upload cancelled"
            elif fut.exception() is not None:
                out[step] = f"{type(fut.exception()).__name__}: {fut.exception()}"
        return out

    def wait(self, timeout_secs: float | None) -> dict[str, str]:
        """Wait (at most ``timeout_secs`` in all) for every enqueued promotion; return the steps
        that are not durable then, each with why."""
        concurrent.futures.wait(self.futures(), timeout=timeout_secs)
        problems = self.not_durable()
        return {
            s: (f"still uploading after {timeout_secs} s" if why == "still uploading" else why)
            for s, why in problems.items()
        }

    def shutdown_when_idle(self) -> None:
        """Stop the pools once every promotion enqueued so far has ended (now, if none is
        pending): what is queued or running goes on, and no thread is left waiting for work
        that will never come (a writer closed while an upload ran kept one for good)."""
        pending = [f for f in self.futures() if not f.done()]
        left = [len(pending)]

        def ended(_: Future[tuple[float, float]]) -> None:
            # on the thread that ended it (a pool's own, or the exit hook's that cancelled
            # it): the threads are told to end, not waited for
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.shutdown(wait=False)

        if not pending:
            self.shutdown()
        for fut in pending:
            fut.add_done_callback(ended)

    def shutdown(self, *, cancel: bool = False, wait: bool | None = None) -> None:
        """Stop both pools: queued work is cancelled (``cancel``) or still done; the threads
        are joined unless ``wait`` is False (default: unless cancelling)."""
        wait = not cancel if wait is None else wait
        self._steps.shutdown(wait=wait, cancel_futures=cancel)
        self._files.shutdown(wait=wait, cancel_futures=cancel)
        with self._lock:
            lock, self._resume_lock = self._resume_lock, None
        if lock is not None:  # the next uploader on this root resumes, even ours
            self.tier.backend.unlock(lock)
        if all(f.done() for f in self.futures()):
            # Stopped with nothing left running: its failures were its owner's to report (a
            # close raised them); the exit hook must not repeat them as abandoned uploads
            _LIVE.discard(self)

    def resume(self) -> None:
        """Re-enqueue committed local steps that are not durable yet (one process per root)."""
        if self._resume_lock is None:
            self._resume_lock = self.tier.backend.try_lock_exclusive(layout.UPLOADER_LOCK_NAME)
            if self._resume_lock is None:
                return  # another process on this node resumes them
        record = self.tier.record()
        policy = self._retention()
        dropped = (
            RemoteRetention(self.remote, policy, record.run_id)
            if policy is not None and record is not None
            else None
        )
        for info in sorted(self.tier.steps(), key=lambda s: s.committed_at_ns):
            if not info.verified_format or not self._wants_promotion(info.name):
                continue
            if dropped is not None and dropped.pruned(StepState(info.name, info.committed_at_ns)):
                logger.info(
                    "not uploading %s/%s (again): the remote tier's retention keeps newer "
                    "steps of the run only; it stays on the local tier until the local "
                    "retention drops it",
                    self.tier.root,
                    info.name,
                )
                continue
            if record is not None and info.owner(record) != Owner.OURS:
                logger.warning(
                    "not resuming the upload of %s/%s: it is not run %s's (saved before run "
                    "identities, or by another run); `dcp-tiered adopt %s %s` makes it so",
                    self.tier.root,
                    info.name,
                    record.run_id,
                    self.tier.root,
                    info.name,
                )
                continue
            self.submit(info.name, new_commit=False)

    def _wants_promotion(self, step: str) -> bool:
        try:
            return self.tier.read_head(step).promote
        except (ManifestError, OSError):
            return True  # the promotion reports what is wrong with it


# Every uploader not yet collected, for the exit hook only: nobody looks an uploader up here
# (each has one owner), but at exit each must stop retrying and say what it leaves undone.
_LIVE: weakref.WeakSet[Uploader] = weakref.WeakSet()


def _abandon_at_exit() -> None:
    """The interpreter is exiting: stop retrying, drop queued promotions, and say once which
    steps are left committed-local (they are safe on disk and resumed by the next writer)."""
    _retry.EXITING.set()
    for up in list(_LIVE):
        up.shutdown(cancel=True)
        left = up.not_durable()
        if left:
            logger.warning(
                "dcp_tiered: exiting with step(s) %s of %s committed locally but not durable on "
                "%s. They are safe on the local disk, and the next TieredStorageWriter on that "
                "root with this remote resumes their upload. To wait for them before exiting, "
                "call close() on the writer (CheckpointManager.close(), the shims' flush/close).",
                ", ".join(sorted(left)),
                up.tier.root,
                up.remote.config.url,
            )


# Runs before concurrent.futures and asyncio shut their executors down at exit (threading's
# exit hooks run in reverse order of registration), so no upload retries against them.
at_interpreter_shutdown(_abandon_at_exit)


def wait_durable(
    up: Uploader | None, steps: list[str], timeout_secs: float | None, poll: Callable[[str], bool]
) -> None:
    """Until each of ``steps`` is durable: by the promotion ``up`` runs of it, else by polling
    ``poll(step)`` (a promotion of another process)."""
    deadline = None if timeout_secs is None else time.monotonic() + timeout_secs
    for step in steps:
        fut = up.future(step) if up is not None else None
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if fut is not None:
            try:
                fut.result(timeout=left)
            except FutureTimeoutError:
                raise TimeoutError(f"step {step!r} is not durable after {timeout_secs} s") from None
            except Exception as e:
                raise UploadFailedError(f"step {step!r} could not be made durable: {e}") from e
            continue
        while not poll(step):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"step {step!r} is not durable after {timeout_secs} s")
            time.sleep(0.2)
