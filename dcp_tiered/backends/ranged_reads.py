"""Reading remote objects with parallel ranged GETs sized to the object.

Restores (the reader) and hydration (a step copied back into the local tier) read remote
objects in byte ranges. A range is at most ``span`` bytes (about one upload part, see
``tiers.remote.chunk_bytes``): a small object is one GET, a large one as many part-sized GETs
as it has parts, ``window`` (``RemoteConfig.max_concurrency``) in flight at once across all
the objects read, so the pipeline does not drain at an object's end: as many again wait their
turn, so a GET that ends starts the next at once, however long the caller takes with the
range it holds. Ranges are handed back in order, a range that spans several GETs (one item
larger than a part) in its pieces: :class:`Joiner` joins them into a buffer it reuses. Memory:
twice the GETs in flight, plus the range being handed out.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

# A small gap between two wanted ranges is fetched rather than paid for with another GET.
MERGE_GAP_BYTES = 1 * 2**20
# Pieces asked for ahead of the caller, per GET in flight: the pool runs ``window`` at once and
# the rest wait their turn, so the pool never idles while the caller checks and copies a range
# (the bytes of the pieces done but not yet taken are the memory this costs).
AHEAD_PER_GET = 2


def coalesce(spans: Sequence[tuple[int, int]], max_bytes: int) -> list[tuple[int, int]]:
    """Merge byte ranges ``[start, end)`` (sorted by start) separated by at most a small gap
    into ranges of at most ``max_bytes``; a single range larger than that stays whole (it is
    read in pieces by :func:`read_ranges`)."""
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start - merged[-1][1] <= MERGE_GAP_BYTES and end - merged[-1][0] <= max_bytes:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def read_ranges(
    objects: Sequence[tuple[str, Sequence[tuple[int, int]]]],
    fetch: Callable[[str, int, int], bytes],
    span: int,
    window: int,
) -> Generator[tuple[str, int, int, list[bytes]], None, None]:
    """``(key, start, end, pieces)`` of every range of every object in ``objects`` (key,
    ranges), in the order given, each read with ``fetch(key, start, end)`` in equal pieces of at
    most ``span`` bytes (``pieces``: their bytes, in order), ``window`` pieces in flight.
    Closing the iterator early waits for the pieces in flight and starts no more."""
    counts = [[_pieces(end - start, span) for start, end in ranges] for _, ranges in objects]
    pieces = [
        (key, start + k * (end - start) // n, start + (k + 1) * (end - start) // n)
        for (key, ranges), ns in zip(objects, counts)
        for (start, end), n in zip(ranges, ns)
        for k in range(n)
    ]
    window = max(1, min(window, len(pieces)))
    with ThreadPoolExecutor(window, thread_name_prefix="dcp-tiered-get") as pool:
        queued: collections.deque[Future[bytes]] = collections.deque()
        ahead = 0

        def fill() -> None:
            nonlocal ahead
            while ahead < len(pieces) and len(queued) < AHEAD_PER_GET * window:
                queued.append(pool.submit(fetch, *pieces[ahead]))
                ahead += 1

        def take() -> bytes:
            fill()
            fut = queued.popleft()
            fill()  # keep ``window`` in flight while this one is waited for
            return fut.result()

        try:
            for (key, ranges), ns in zip(objects, counts):
                for (start, end), n in zip(ranges, ns):
                    yield key, start, end, [take() for _ in range(n)]
        finally:
            for fut in queued:
                fut.cancel()


class Joiner:
    """Joins a range's pieces into one buffer, reused from range to range: a fresh bytes object
    of 32 MiB costs 8,192 page faults, which on a VM took longer than the copy itself (and a
    joined range outlived only until the next, so one buffer serves them all)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def joined(self, parts: Sequence[bytes]) -> memoryview:
        """The pieces' bytes back to back, valid until the next call."""
        size = sum(len(p) for p in parts)
        if len(self._buffer) < size:
            self._buffer = bytearray(size)
        view = memoryview(self._buffer)
        at = 0
        for part in parts:
            view[at : at + len(part)] = part
            at += len(part)
        return view[:size]


def _pieces(length: int, span: int) -> int:
    """How many GETs read ``length`` bytes in pieces of at most ``span``, of equal size (an
    item a little larger than a part is two halves, not a part and a sliver)."""
    return max(1, -(-length // span))
