"""Cyclic garbage collection paused around the bursts of allocation of a save or a restore.

Planning and committing a save allocate one small object per item of every rank (plans,
chunk metadata, ``.metadata``'s storage records): hundreds of thousands at a few hundred
ranks. Each allocation burst triggers full collections, and each full collection walks every
object the process holds (the trainer's included), so their cost grows with the size of the
heap times the number of items (measured: 35-40 % of DCP's planning and half of the
``.metadata`` pickle at 64 ranks, 80 % of a reader's manifest parse at 256,
``benchmarks/scale.py``; on one rank with 2,000 tensors, 40 % of a whole ``dcp.save``, with
20,000, 55 %). The objects made there are acyclic; nothing is gained by collecting during them.

Two forms: :func:`paused` for a block of our own code, and :func:`hold_through_dcp_call` for
the whole of one ``dcp.save``/``dcp.load`` call, whose collectives (pickled plans, write
results, metadata) run between our hooks in DCP's own code. Pauses count: the collector is
turned back on when the last one ends, and only if it was on when the first began (some
training loops turn it off and collect by hand).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

# How often a hold through a DCP call looks whether its thread has left the call.
POLL_SECS = 0.05

_lock = threading.Lock()
_pauses = 0
_was_enabled = False  # the collector's state when the first of the current pauses began
_holds: dict[int, _Hold] = {}  # thread -> its hold through a DCP call
_watched: set[_Hold] = set()  # holds whose watcher thread may still run


WATCHER = "dcp-tiered-gc-hold"


class _Hold:
    """One thread's pause through one DCP call, and the daemon thread that watches it."""

    def __init__(self, ident: int, entry: FrameType) -> None:
        self.ident, self.over, self.wake = ident, False, threading.Event()
        # The call's entry frame: a thread's next DCP call (a loop of them, with no gap the
        # watcher would see) is another call. Dropped as the hold ends: it keeps the call's
        # locals alive once the call has returned, until the watcher's next look.
        self.entry: FrameType | None = entry
        self.watcher = threading.Thread(target=_watch, args=(self,), name=WATCHER, daemon=True)


def _begin_locked() -> None:
    global _pauses, _was_enabled
    if _pauses == 0:
        _was_enabled = gc.isenabled()
        gc.disable()
    _pauses += 1


def _end_locked() -> None:
    global _pauses
    if _pauses == 0:  # a pause begun before a fork, ending in the child (see below)
        return
    _pauses -= 1
    if _pauses == 0 and _was_enabled:
        gc.enable()


def _after_fork_in_child() -> None:
    """A child forked during a pause has no watcher threads: it starts with none, and the
    collector as it was before the pause."""
    global _lock, _pauses
    if _pauses and _was_enabled:
        gc.enable()
    _lock, _pauses = threading.Lock(), 0
    _holds.clear()
    _watched.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection inside the block."""
    with _lock:
        _begin_locked()
    try:
        yield
    finally:
        with _lock:
            _end_locked()


def paused_during(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run with cyclic collection paused (see :func:`paused`)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with paused():
            return fn(*args, **kwargs)

    return run


def _dcp_entry(frame: FrameType | None) -> FrameType | None:
    """The outermost frame of ``torch.distributed.checkpoint`` code on a stack: the call's
    own, alive exactly as long as that call."""
    entry = None
    while frame is not None:
        if "/torch/distributed/checkpoint/" in frame.f_code.co_filename.replace("\\", "/"):
            entry = frame
        frame = frame.f_back
    return entry


def hold_through_dcp_call() -> None:
    """Pause collection through the ``dcp.save``/``dcp.load`` (or async save) the calling
    thread is in: called from a writer's or reader's first hooks, ended by its last hook on
    this rank (:func:`end_hold`). DCP tells a storage plugin nothing when a call fails
    elsewhere (in DCP's own code, on another rank), so a daemon thread looks at the caller's
    stack every :data:`POLL_SECS` and ends the pause once the call's outermost DCP frame has
    left it, however the call ended. Once per thread and call; outside a DCP call (a hook
    called by hand) it does nothing."""
    global _was_enabled
    ident = threading.get_ident()
    entry = _dcp_entry(sys._getframe())
    if entry is None:
        return
    with _lock:
        held = _holds.get(ident)
        if held is not None and held.entry is entry:  # begun by an earlier hook of this call
            if gc.isenabled():  # turned on since it began: on again when it ends
                _was_enabled = True
                gc.disable()
            return
        hold = _Hold(ident, entry)
        if held is not None:  # an earlier call's, which ended without its last hook
            _close(held)
            held.wake.set()
        _holds[ident] = hold
        _watched.add(hold)
        _begin_locked()
    try:
        hold.watcher.start()
    except RuntimeError:  # no thread (interpreter shutdown, a thread limit): no pause
        with _lock:
            _close(hold)
            _watched.discard(hold)


def end_hold() -> None:
    """End the calling thread's pause now: its DCP call's last hook on this rank is done."""
    with _lock:
        hold = _holds.get(threading.get_ident())
        if hold is not None:
            _close(hold)
    if hold is not None:
        hold.wake.set()


def settle() -> None:
    """End the pauses of threads that have left their DCP call, and wait for every ended
    pause's watcher to exit (a writer's ``close``: it leaves no thread behind)."""
    with _lock:
        for hold in list(_holds.values()):
            if not _in_call(hold):
                _close(hold)
        ended = [h for h in _watched if h.over]
    for hold in ended:
        hold.wake.set()
        if hold.watcher is not threading.current_thread():
            hold.watcher.join(timeout=1.0)


def _close(hold: _Hold) -> None:
    """End ``hold`` once (the caller holds the lock): its entry goes in the same locked step,
    so its thread's next call, however soon, begins a hold of its own."""
    if hold.over:
        return
    hold.over, hold.entry = True, None
    if _holds.get(hold.ident) is hold:
        del _holds[hold.ident]
    _end_locked()


def _watch(hold: _Hold) -> None:
    try:
        while True:
            with _lock:
                if hold.over:
                    return
                if not _in_call(hold):
                    _close(hold)
                    return
            hold.wake.wait(POLL_SECS)
    finally:
        with _lock:
            _watched.discard(hold)


def _in_call(hold: _Hold) -> bool:
    """Whether the hold's thread still runs its call (the entry frame is on its stack)."""
    frame = sys._current_frames().get(hold.ident)
    while frame is not None:
        if frame is hold.entry:
            return True
        frame = frame.f_back
    return False
