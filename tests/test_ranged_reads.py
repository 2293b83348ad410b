"""Parallel ranged reads (dcp_tiered.backends.ranged_reads): the pipeline keeps fetching while
the caller works on the range it holds, pieces come back in order, and joined ranges reuse one
buffer."""

from __future__ import annotations

import threading
import time

from dcp_tiered.backends import ranged_reads

BLOB = bytes(range(256)) * 64  # 16 KiB, every byte position recognisable


def _fetch_recording(started: list[tuple[str, int, int]]):
    lock = threading.Lock()

    def fetch(key: str, start: int, end: int) -> bytes:
        with lock:
            started.append((key, start, end))
        return BLOB[start:end]

    return fetch


def test_gets_go_on_while_the_caller_holds_a_range():
    """With two GETs at a time and six pieces, holding the first range must not stop the pool:
    the next pieces are asked for ahead (twice the window), not one per range taken."""
    started: list[tuple[str, int, int]] = []
    ranges = [(k * 1024, (k + 1) * 1024) for k in range(6)]
    it = ranged_reads.read_ranges([("a", ranges)], _fetch_recording(started), 1024, 2)
    key, start, end, parts = next(it)  # the caller now holds range 0 and works on it
    deadline = time.monotonic() + 10
    while len(started) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (key, start, end, parts) == ("a", 0, 1024, [BLOB[:1024]])
    # range 0, then 2 x 2 pieces ahead of the caller; one GET per range taken would give 3
    assert len(started) == 5
    rest = list(it)
    assert [(s, e) for _, s, e, _ in rest] == ranges[1:]
    assert all(b"".join(p) == BLOB[s:e] for _, s, e, p in rest)
    assert len(started) == 6


def test_a_range_larger_than_a_piece_comes_in_its_pieces_in_order():
    started: list[tuple[str, int, int]] = []
    got = list(
        ranged_reads.read_ranges(
            [("a", [(0, 100), (100, 5000)]), ("b", [(7, 9000)])],
            _fetch_recording(started),
            2000,
            3,
        )
    )
    assert [(k, s, e) for k, s, e, _ in got] == [("a", 0, 100), ("a", 100, 5000), ("b", 7, 9000)]
    assert [len(p) for _, _, _, p in got] == [1, 3, 5]  # equal pieces of at most 2,000 bytes
    for _, s, e, parts in got:
        assert b"".join(parts) == BLOB[s:e]
        assert max(len(p) for p in parts) <= 2000


def test_closing_early_starts_no_more_gets():
    started: list[tuple[str, int, int]] = []
    ranges = [(k * 100, (k + 1) * 100) for k in range(50)]
    it = ranged_reads.read_ranges([("a", ranges)], _fetch_recording(started), 100, 2)
    next(it)
    it.close()
    seen = len(started)
    time.sleep(0.1)
    assert seen == len(started) < 50


def test_the_joiner_reuses_one_buffer():
    joiner = ranged_reads.Joiner()
    first = joiner.joined([BLOB[:3000], BLOB[3000:8000]])
    assert bytes(first) == BLOB[:8000]
    second = joiner.joined([BLOB[100:200], BLOB[200:4000]])
    assert bytes(second) == BLOB[100:4000]
    assert second.obj is first.obj  # no new allocation for a range no larger
    third = joiner.joined([BLOB, BLOB])
    assert bytes(third) == BLOB + BLOB and len(third.obj) == 2 * len(BLOB)
