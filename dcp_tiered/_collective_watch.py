"""A watchdog for a save stuck in one of DCP's collectives.

``dcp.async_save`` on the training process group runs its plan gather/scatter and its final
gather from a background thread while training runs its own collectives on the same group: the
two interleave and every rank waits forever, silently (vanilla DCP hangs the same way). The
writer sees each phase begin and end (its hooks are called between DCP's collectives), so it
arms one daemon timer as the save enters a collective and cancels it when the next hook
arrives. When the timer fires, it looks at the saving thread's stack: only if that thread is
still inside a DCP collective does it log one ERROR naming the step, the rank, the phase, the
likely cause and the fix. A save that failed elsewhere, or ended on a rank with no later hook,
is not in a collective any more and stays silent.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

import torch.distributed as dist

logger = logging.getLogger(__name__)

THREAD_NAME = "dcp-tiered-collective-watch"


def _in_dcp_collective(frame: object) -> bool:
    """Whether a stack runs a c10d collective on behalf of torch.distributed.checkpoint."""
    c10d = dcp = False
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")  # type: ignore[attr-defined]
        c10d = c10d or name.endswith("/distributed/distributed_c10d.py")
        dcp = dcp or "/distributed/checkpoint/" in name
        frame = frame.f_back  # type: ignore[attr-defined]
    return c10d and dcp


class CollectiveWatch:
    """At most one timer at a time (a save's current phase); ``cancel`` ends it."""

    def __init__(self, threshold_secs: float | None) -> None:
        self.threshold_secs = threshold_secs
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._stuck: tuple[str, str, float] | None = None  # (step, phase, since) once reported

    def arm(self, step: str, phase: str) -> None:
        """The calling thread is about to enter DCP's collective ``phase`` of ``step``."""
        self.cancel()
        if self.threshold_secs is None or not (dist.is_available() and dist.is_initialized()):
            return  # no collectives without a process group
        rank = dist.get_rank()
        timer = threading.Timer(
            self.threshold_secs,
            self._fire,
            args=(threading.get_ident(), step, rank, phase, time.monotonic()),
        )
        timer.daemon = True
        timer.name = THREAD_NAME
        with self._lock:
            self._timer = timer
        timer.start()

    def cancel(self) -> None:
        """The save left the collective (its next phase arrived), or the writer is closing."""
        with self._lock:
            timer, self._timer = self._timer, None
            stuck, self._stuck = self._stuck, None
        if timer is not None:
            timer.cancel()
            if timer is not threading.current_thread():
                timer.join()  # no thread outlives the watch: a long-lived process stays flat
        if stuck is not None:
            step, phase, since = stuck
            logger.warning(
                "step %s: the save left %s after %.0f s", step, phase, time.monotonic() - since
            )

    def _fire(self, ident: int, step: str, rank: int, phase: str, since: float) -> None:
        frame = sys._current_frames().get(ident)
        if frame is None or not _in_dcp_collective(frame):
            return  # the save moved on (or failed) without a hook telling us: not stuck
        with self._lock:
            self._stuck = (step, phase, since)
        logger.error(
            "step %s: rank %d has waited %.0f s in %s of dcp.save/dcp.async_save, and the other "
            "ranks have not joined it. Likely cause: the save's collectives share a process "
            "group with training collectives (dcp.async_save on the default/training group: "
            "its gathers interleave with training's collectives and every rank waits forever; "
            "vanilla DCP hangs the same way). Fix: pass "
            "process_group=dcp_tiered.checkpoint_process_group() to dcp.save/dcp.async_save "
            "(CheckpointManager and the shims use their own gloo group already). If a rank "
            "is only late, raise the writer's collective_timeout_warn_secs (None disables "
            "this check). Logged once; the save keeps waiting.",
            step,
            rank,
            time.monotonic() - since,
            phase,
        )
