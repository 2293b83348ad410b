"""Saves run on a thread of their own while the trainer's thread waits for them: the manager's
(``CheckpointManager.save``) and the adapters' (:meth:`~dcp_tiered.lifecycle.Lifecycle.save`,
which the DeepSpeed engine, the HF wrapper and the torchtitan checkpointer call; the Megatron
strategy's saves; memory snapshots through
:class:`~dcp_tiered.lifecycle.memory.MemorySnapshots`).

glibc gives the main thread the main arena (the ``brk`` heap) and each other thread an arena
of its own. A save allocates and frees as it plans, stages and describes (Python objects,
headers, small tensors); made on the trainer's thread, those blocks land among the ones the
training step allocates and frees, and once freed they can leave a free top of the heap that
``free`` trims, taking the step's memory with it: every step after it faults its activations
in again. Measured in a training loop (72 MiB state, 0.3 s steps, a memory snapshot every
step, ``/work/scratch/s23/tm.py``): 7,000-17,500 minor faults per step and steps 12-40 ms
slower in most loops (without checkpoints: 0-300 faults); with the save on this thread, no
fault and steps as long as without checkpoints.

What the save needs of the caller's thread goes with it: its priority (the thread is made
at the priority of the thread that made the manager, and a save never lowers it as it lowers
an async save's own thread) and, once CUDA is in use, its current device and stream, so that
a copy of CUDA state is ordered after the work that made it as it would be on the caller's
thread (other devices' streams are their defaults there). Grad mode is per thread; the copies
set their own. A save asked for on a save thread (a hook of one save that saves) runs there
inline: the thread never waits for itself.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from .._daemon_pool import DaemonPool
from .._priority import as_the_caller, standing_in

T = TypeVar("T")


class SaveThread:
    """Runs one call at a time on its thread and waits for it (``run``), as if inline, or
    until the call lets the caller go (``start``)."""

    def __init__(self) -> None:
        self._initializer = as_the_caller()
        self._pool: DaemonPool | None = None
        self._pid = -1

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if standing_in():  # already on a save thread (any SaveThread's)
            return fn(*args, **kwargs)
        call = functools.partial(fn, *args, **kwargs)
        return self._submit(functools.partial(_as_caller, _caller_context(), call)).result()

    def start(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, Future[None]]:
        """Run ``fn(*args, release=..., **kwargs)`` and wait until it calls ``release(value)``,
        returns or raises: ``value`` (or what it returned; what it raised first is raised
        here), and a future of the rest of the call, which holds what it raised after the
        release. Inline on a save thread, as ``run``."""
        if standing_in():
            nothing_left: Future[None] = Future()
            nothing_left.set_result(None)
            return fn(*args, release=lambda _: None, **kwargs), nothing_left
        handed: Future[T] = Future()
        context = _caller_context()

        def call() -> None:
            try:  # entering the caller's context too: its failure must reach the caller
                value = _as_caller(
                    context, functools.partial(fn, *args, release=handed.set_result, **kwargs)
                )
            except BaseException as e:
                if handed.done():
                    raise  # the caller has gone: the rest's future holds it
                handed.set_exception(e)
                return
            if not handed.done():
                handed.set_result(value)

        rest = self._submit(call)
        return handed.result(), rest

    def _submit(self, call: Callable[[], T]) -> Future[T]:
        if self._pool is None or self._pid != os.getpid():  # a forked child: the thread is gone
            self._pool = DaemonPool(1, "dcp-tiered-save", self._initializer)
            self._pid = os.getpid()
        return self._pool.submit(call)

    def close(self) -> None:
        if self._pool is not None and self._pid == os.getpid():
            # from its own thread (a save's hook that closes): it ends after this call
            self._pool.shutdown(wait=not standing_in())
        self._pool = None


def _caller_context() -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """What to enter on the save's thread to run as the calling thread would."""
    if not torch.cuda.is_initialized():
        return contextlib.nullcontext
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream(device)

    def on_callers_stream() -> contextlib.AbstractContextManager[Any]:
        torch.cuda.set_device(device)
        return torch.cuda.stream(stream)

    return on_callers_stream


def _as_caller(
    context: Callable[[], contextlib.AbstractContextManager[Any]], call: Callable[[], T]
) -> T:
    with context():
        return call()
