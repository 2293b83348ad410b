"""CPU priority of checkpoint threads: background saves yield the CPU to training.

On Linux the nice value is per thread, so a checkpoint thread can run at a lower priority than
the training thread of the same process. When a core is idle the save runs at full speed;
when training needs the CPU, the save waits (Megatron's ``async_ckpt_cpu_priority`` does the
same for its checkpoint process).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable

BACKGROUND_NICE = 10


# Threads that run the trainer's own calls while it waits (the manager's save thread): at its
# priority, never lowered, as the main thread.
_stand_ins: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def lower_this_thread(nice: int = BACKGROUND_NICE) -> None:
    """Raise the calling thread's nice value to ``nice`` (never lower it); a no-op on the
    main thread, whose priority is the trainer's, on a thread standing in for it, and where
    threads cannot be reniced."""
    if nice <= 0 or threading.current_thread() is threading.main_thread() or standing_in():
        return
    if not hasattr(os, "setpriority") or _nice_of_this_thread() >= nice:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        pass  # not permitted here: run at normal priority


def as_this_thread() -> Callable[[], None]:
    """An initializer for worker threads of the calling thread: each runs at its priority.
    A blocking ``dcp.save`` runs on the trainer's thread, which waits for its writers: below
    the trainer's priority they would give the cores the trainer is not using to any other
    process that wants them. An async save's thread lowers itself first, and its writers
    with it."""
    return functools.partial(lower_this_thread, _nice_of_this_thread())


def as_the_caller() -> Callable[[], None]:
    """An initializer for a thread that runs the calling thread's own calls while it waits:
    at its priority (:func:`as_this_thread`), and never lowered later."""
    at_its_priority = as_this_thread()

    def stand_in() -> None:
        at_its_priority()
        _stand_ins.add(threading.current_thread())

    return stand_in


def standing_in() -> bool:
    """Whether the calling thread stands in for a waiting caller (:func:`as_the_caller`)."""
    return threading.current_thread() in _stand_ins


def _nice_of_this_thread() -> int:
    """The calling thread's nice value; 0 where it cannot be read."""
    if not hasattr(os, "getpriority"):
        return 0
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except OSError:
        return 0


def background_threads() -> int:
    """Writer threads for saves that run beside training (the CheckpointManager's): one on a
    machine of fewer than four usable cores, else two. On two cores, a training loop with a
    disk save every 10 steps kept 0.85 of its throughput with one writer thread and 0.70 with
    two (median of 6 paired runs each, 0.1 s steps, 72 MiB state): two writer threads share a
    core with the training thread however low their priority."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return 1 if cores < 4 else 2
