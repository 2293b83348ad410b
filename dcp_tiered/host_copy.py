"""Copies into host memory on threads of our own, by memcpy, never by torch's intra-op pool.

A ``copy_`` of 32,768 elements or more is a parallel region of torch's OpenMP pool, which waits
for every one of its workers; on a busy machine (the training step's own threads, our own
background writes and hashes) a worker that is not running costs the region a scheduler tick.
Measured on the development VM under load, the training benchmark's state (48 tensors, 72 MiB):
0.45 s by ``copy_``, 0.03 s by memcpy. So tensors of :data:`MEMCPY_MIN_BYTES` or more are
copied as bytes by address (one ``memmove`` each, without the GIL: a numpy view of each side
cost more than the copy of a 128 KiB tensor itself), and the work is split in two
halves by bytes, one on the caller's thread and one on a helper thread: large tensors then use
both cores as torch's pool would, and many small ones (mostly per-call cost, which one core
cannot hide) go through one ``torch._foreach_copy_`` per half.
"""

from __future__ import annotations

import ctypes
import os
import queue
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import compress
from operator import attrgetter

import numpy as np
import torch

MEMCPY_MIN_BYTES = 64 * 2**10  # smaller: copy_ runs on one thread anyway, and costs less
_SPLIT_MIN_BYTES = 2**20  # less work than this is not worth a second thread
_SPLIT_MIN_TENSORS = 16
# A checked copy of this many tensors or more checks one stretch while copying another
_PIPELINE_MIN_TENSORS = 4096
_CHECK_STRETCH = 1024
_SEGMENT_PIECE_BYTES = 16 * 2**20  # and its large tensors are copied in pieces of this size
_nbytes = attrgetter("nbytes")

Segment = tuple[int, int, int]  # (destination address, source address, bytes)
_Work = tuple[list[Segment], list[torch.Tensor], list[torch.Tensor]]  # what _run copies
# The tensor classes whose storage is the tensor's bytes: not subclasses (DTensor, ...). A set:
# asked of one class (`in`) and of all of a list's at once (`<=`, `issuperset`).
PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_memmove = ctypes.memmove  # a foreign call: the GIL is released while it copies


def copy_all(
    dsts: list[torch.Tensor],
    srcs: list[torch.Tensor],
    *,
    non_blocking: bool = False,
    split_small: bool = True,
    check: Callable[[int, int], None] | None = None,
) -> None:
    """Copy each source into its destination (same shapes). Copies to or from a GPU are
    torch's, as one batch. ``split_small=False``: tensors under :data:`MEMCPY_MIN_BYTES` all
    on this thread (a batch of them so small that handing half to the helper costs more than
    it saves); a megabyte or more of large ones is still split. ``check(start, end)``: called
    before the pairs ``[start, end)`` are copied, it raises to stop the copy (some pairs may
    have been copied by then)."""
    if not dsts:
        return
    on_cpu = not non_blocking and dsts[0].device.type == "cpu" and srcs[0].device.type == "cpu"
    if check is not None and on_cpu and len(dsts) >= _PIPELINE_MIN_TENSORS:
        _check_while_copying(dsts, srcs, check)
        return
    if check is not None:
        check(0, len(dsts))
    if not on_cpu:
        _foreach(dsts, srcs, non_blocking)
        return
    segments, small_d, small_s = _by_memcpy(dsts, srcs)
    total = sum(n for _, _, n in segments)
    many_small = split_small and len(small_d) >= _SPLIT_MIN_TENSORS
    if total < _SPLIT_MIN_BYTES and not many_small:
        _run(segments, small_d, small_s)
        return
    mine, theirs = _halves(segments, total)
    half = len(small_d) // 2 if many_small else len(small_d)
    side_by_side(
        lambda: _run(mine, small_d[:half], small_s[:half]),
        lambda: _run(theirs, small_d[half:], small_s[half:]),
    )


def _check_while_copying(
    dsts: list[torch.Tensor], srcs: list[torch.Tensor], check: Callable[[int, int], None]
) -> None:
    """Many tensors: this thread checks them a stretch at a time and queues each stretch for
    the helper (its large tensors in pieces), which copies one while this thread checks the
    next; then both copy what is left. The checks (a shape and a dtype per tensor, read from tensors no longer in any
    cache) cost a third as much as the copy with 20,000 small tensors; the copy needs no
    GIL, so the two overlap."""
    checked: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()

    def copy_checked(stop_at_end: bool) -> None:
        while True:
            try:
                item = checked.get(block=not stop_at_end)
            except queue.Empty:
                return
            if item is None:  # nothing more will come: leave it for the other thread
                checked.put(None)
                return
            _run(*item)

    other = _helper().submit(copy_checked, False)
    try:
        for start in range(0, len(dsts), _CHECK_STRETCH):
            end = min(len(dsts), start + _CHECK_STRETCH)
            check(start, end)
            segments, small_d, small_s = _by_memcpy(dsts[start:end], srcs[start:end])
            checked.put(([], small_d, small_s))
            for piece in _pieces(segments, _SEGMENT_PIECE_BYTES):  # a large tensor: both
                checked.put(([piece], [], []))  # threads copy it, as copy_all's halves do
            time.sleep(0)  # the GIL to the helper now, not at the next switch interval (5 ms)
        checked.put(None)
        copy_checked(True)
    finally:
        checked.put(None)
        other.result()


def _by_memcpy(
    dsts: list[torch.Tensor], srcs: list[torch.Tensor]
) -> tuple[list[Segment], list[torch.Tensor], list[torch.Tensor]]:
    """(segments of the pairs a memcpy copies, the other destinations, their sources). Only
    the large pairs get a Python step each; the small ones (all 20,000 of the benchmark's
    many-tensor state) are passed on by C-level maps."""
    large = [i for i, n in enumerate(map(_nbytes, dsts)) if n >= MEMCPY_MIN_BYTES]
    segments: list[Segment] = []
    rest = [True] * len(dsts) if large else []  # the pairs left to _foreach
    for i in large:
        segment = as_segment(dsts[i], srcs[i])
        if segment is not None:
            segments.append(segment)
            rest[i] = False
    if not segments:
        return segments, dsts, srcs
    return segments, list(compress(dsts, rest)), list(compress(srcs, rest))


def _pieces(segments: list[Segment], most: int) -> list[Segment]:
    """The segments cut into pieces of at most ``most`` bytes."""
    return [(d + at, s + at, min(most, n - at)) for d, s, n in segments for at in range(0, n, most)]


def side_by_side(mine: Callable[[], None], theirs: Callable[[], None]) -> None:
    """Run ``mine`` on this thread and ``theirs`` on the helper thread; return when both are
    done (the first error raised, the other having finished)."""
    other = _helper().submit(theirs)
    try:
        mine()
    finally:
        other.result()


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a flat uint8 array (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def as_segment(d: torch.Tensor, s: torch.Tensor) -> Segment | None:
    """Both tensors' addresses, where a memcpy copies one into the other: plain strided CPU
    tensors, contiguous, of one dtype and size, with no conjugate or negative bit (their
    bytes are not their values); anything else goes through copy_."""
    if type(d) not in PLAIN_TENSORS or type(s) not in PLAIN_TENSORS:
        return None
    if d.device.type != "cpu" or s.device.type != "cpu" or d.layout != torch.strided:
        return None
    if s.layout != torch.strided or d.dtype != s.dtype or d.numel() != s.numel():
        return None
    if not (d.is_contiguous() and s.is_contiguous()):
        return None
    if d.is_conj() or s.is_conj() or d.is_neg() or s.is_neg():
        return None
    return d.data_ptr(), s.data_ptr(), d.nbytes


_is_cpu = attrgetter("is_cpu")
_layout = attrgetter("layout")


def memcpy_addresses(tensors: list[torch.Tensor]) -> list[int] | None:
    """The data addresses of ``tensors`` where a memcpy may read each one's bytes as its
    values (the source side of :func:`as_segment`: plain strided CPU tensors, contiguous, no
    conjugate or negative bit); None where one may not. Checked by C-level maps, a few tenths
    of a microsecond per tensor, for the thousands of a model's state."""
    if not set(map(type, tensors)) <= PLAIN_TENSORS or not all(map(_is_cpu, tensors)):
        return None
    if set(map(_layout, tensors)) - {torch.strided}:
        return None
    if not all(map(torch.Tensor.is_contiguous, tensors)):
        return None
    if any(map(torch.Tensor.is_conj, tensors)) or any(map(torch.Tensor.is_neg, tensors)):
        return None
    return list(map(torch.Tensor.data_ptr, tensors))


def _halves(segments: list[Segment], total: int) -> tuple[list[Segment], list[Segment]]:
    """The segments split at half their bytes (one of them cut in two there)."""
    first: list[Segment] = []
    done, half = 0, total // 2
    for i, (d, s, n) in enumerate(segments):
        if done + n >= half:
            cut = half - done
            first.append((d, s, cut))
            return first, [(d + cut, s + cut, n - cut), *segments[i + 1 :]]
        first.append((d, s, n))
        done += n
    return first, []


def _run(segments: list[Segment], dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    for d, s, n in segments:
        if n:
            _memmove(d, s, n)
    _foreach(dsts, srcs, False)


def _foreach(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> None:
    if dsts:
        with torch.no_grad():  # grad mode is per thread: the helper's own
            torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


_helpers: dict[int, ThreadPoolExecutor] = {}  # pid -> its helper: a forked child makes its own


def _helper() -> ThreadPoolExecutor:
    pid = os.getpid()
    found = _helpers.get(pid)
    if found is None:  # at the trainer's priority: its work is the caller's stall
        _helpers.clear()
        found = _helpers[pid] = ThreadPoolExecutor(1, thread_name_prefix="dcp-tiered-copy")
    return found
