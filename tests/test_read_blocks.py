"""policy.read_blocks: the blocks a restore reads for whole tensors by columns, planned on
whole columns, against the item-by-item loop it replaced (the oracle), on generated files:
items back to back or with gaps, large ones, ones with no raw bytes, any subset of rows
asked for in any order, CRCs that are not what a CRC column holds."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_tiered.policy import read_blocks
from dcp_tiered.policy.manifest_types import FileColumns

BLOCK, GAP, ALONE = 1000, 40, 300


def _file(items: list[tuple[int, int, int]]) -> FileColumns:
    """A file of items (gap before, length, raw offset), back to back but for the gaps."""
    offsets, at = [], 0
    for gap, length, _ in items:
        at += gap
        offsets.append(at)
        at += length
    crcs = "".join(f"{(7 * i + 3) % 2**32:08x}" for i in range(len(items)))
    return FileColumns(
        "f",
        at,
        "00000000",
        0,
        list(range(len(items))),
        [0] * len(items),
        offsets,
        [length for _, length, _ in items],
        [raw for _, _, raw in items],
        crcs,
    )


def _oracle(f: FileColumns, rows: list[int]) -> tuple[list[tuple[int, int, list[int]]], set[int]]:
    """The loop that planned these blocks before: (start, end, rows) per block, and the rows
    left to the general path."""
    placed = sorted((f.offsets[r], r) for r in rows)
    blocks: list[list] = []
    left = set()
    for start, r in placed:
        length = f.lengths[r]
        if length >= ALONE or f.raws[r] < 0:
            left.add(r)
            continue
        end = start + length
        if (
            blocks
            and blocks[-1][1] <= start <= blocks[-1][1] + GAP
            and end - blocks[-1][0] <= BLOCK
        ):
            blocks[-1][1] = end
            blocks[-1][2].append(r)
        else:
            blocks.append([start, end, [r]])
    return [tuple(b) for b in blocks], left


items = st.lists(
    st.tuples(
        st.sampled_from([0, 0, 0, 10, 40, 41, 500]),
        st.integers(1, 400),
        st.sampled_from([0, 5, -1]),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(items, st.data())
def test_blocks_are_the_item_by_item_plan(entries, data):
    f = _file(entries)
    rows = data.draw(st.permutations(range(len(entries))))
    rows = rows[: data.draw(st.integers(1, len(rows)))]
    fqns = [f"t{r}" for r in rows]
    blocks, left = read_blocks.plan(
        f,
        np.asarray(rows),
        fqns,
        [100 + r for r in rows],
        np.asarray([r + 1 for r in rows]),
        block_bytes=BLOCK,
        gap_bytes=GAP,
        alone_bytes=ALONE,
    )
    want, want_left = _oracle(f, rows)
    assert {int(x[1:]) for x in left} == want_left
    got = [(b.start, b.end, [int(x[1:]) for x in b.rows.fqns]) for b in blocks]
    assert got == want
    for b in blocks:
        rs = [int(x[1:]) for x in b.rows.fqns]
        assert b.rows.offsets.tolist() == [f.offsets[r] for r in rs]
        assert b.rows.lengths.tolist() == [f.lengths[r] for r in rs]
        assert b.rows.raws.tolist() == [f.raws[r] for r in rs]
        assert b.rows.crcs.tolist() == [int(f.crc(r), 16) for r in rs]
        assert b.rows.dst == [100 + r for r in rs] and b.rows.nbytes.tolist() == [r + 1 for r in rs]


def test_a_crc_column_that_is_not_lower_case_hex_matches_no_crc():
    f = _file([(0, 10, 0)] * 3)
    for bad in ("ABCDEF01", "zz" + "0" * 6, " " * 8, "12 45678"):
        column = read_blocks.crc_column(dataclasses.replace(f, crcs=bad + f.crcs[8:])).tolist()
        assert column == [-1, int(f.crc(1), 16), int(f.crc(2), 16)], bad
    digits = dataclasses.replace(f, crcs="12345678" * 3)  # no letters: still a CRC column
    assert read_blocks.crc_column(digits).tolist() == [0x12345678] * 3
