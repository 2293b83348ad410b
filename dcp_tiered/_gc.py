"""Cyclic garbage collection paused around the coordinator's bursts of allocation.

Planning and committing a save allocate one small object per item of every rank (plans,
chunk metadata, ``.metadata``'s storage records): hundreds of thousands at a few hundred
ranks. Each allocation burst triggers full collections, and each full collection walks every
object the coordinator holds, the gathered plans included, so their cost grows with the
square of the job's size (measured: 35-40 % of DCP's planning and half of the ``.metadata``
pickle at 64 ranks, and 80 % of a reader's manifest parse at 256, ``benchmarks/scale.py``).
The objects made there are acyclic; nothing is gained by collecting during them.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection inside the block; the collector's state is restored after it (it
    stays off if the program had turned it off: some training loops collect by hand)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def paused_during(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run with cyclic collection paused (see :func:`paused`)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with paused():
            return fn(*args, **kwargs)

    return run
