"""The CRC32C of a region of neighbouring items, from the items' own CRC32Cs, for whole
columns of items at once. Pure: no I/O.

A restore of 20,000 small tensors checked each item's bytes with a CRC32C call of its own:
20,000 calls and as many slices of the read block, on the thread that also copies every
item into its target. The manifest's item CRCs determine the CRC of any run of items that
lie back to back: CRC(A + B) = CRC(A) * x^(8 len(B)) xor CRC(B), in GF(2) modulo the
CRC's polynomial (the method of zlib's crc32_combine, :func:`integrity.combine`). So a block
of items is checked with one CRC over its bytes (on the read thread, which releases the
GIL) against the value its items' CRCs combine to, before any item is copied out of it;
equal values vouch for the block's bytes, every item's among them, with a 32-bit CRC's
confidence (two corrupt items whose errors cancel would pass one check, not two; random
errors do that once in 2^32).

Combining item by item costs more Python than the CRC calls it saves; here it runs on
columns. Shifting a CRC by ``n`` bytes (multiplying it by x^(8n)) is linear over GF(2), so
for each power of two a table per byte of the CRC does it, and a column of CRCs is shifted
by a column of byte counts in one masked pass per bit of the largest count.
"""

from __future__ import annotations

import functools

import numpy as np

from . import integrity

__all__ = ["block_crcs", "shifted"]

_POLY = 0x82F63B78  # CRC32C, reflected: the low bit is the highest power of x
_BYTE = np.arange(256, dtype=np.uint32)


@functools.lru_cache(maxsize=64)
def _tables(k: int) -> np.ndarray:
    """(4, 256) uint32: multiplying by x^(8 * 2^k) modulo the polynomial, per byte of the
    CRC (byte j's table gives the product of that byte's value at its place)."""
    factor = integrity.shift_factor(2**k)
    # the product with each single bit: bit 31 is x^0, and each lower bit one more power
    basis, p = [], factor
    for _ in range(32):
        basis.append(p)
        p = (p >> 1) ^ _POLY if p & 1 else p >> 1
    basis.reverse()  # basis[i]: the product with bit i (x^(31 - i))
    tables = np.zeros((4, 256), dtype=np.uint32)
    for j in range(4):
        for bit in range(8):
            tables[j] ^= np.where((_BYTE >> bit) & 1, np.uint32(basis[8 * j + bit]), 0).astype(
                np.uint32
            )
    return tables


def shifted(crcs: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each of ``crcs`` as if ``counts`` more bytes followed its data: the term an item
    contributes to the CRC of a region that goes on for that many bytes after it."""
    out = np.asarray(crcs, dtype=np.uint32).copy()
    counts = np.asarray(counts, dtype=np.int64)
    if not len(out):
        return out
    for k in range(int(counts.max()).bit_length()):
        at = np.flatnonzero((counts >> k) & 1)
        if not len(at):
            continue
        t, c = _tables(k), out[at]
        out[at] = t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^ t[3][c >> 24]
    return out


def block_crcs(
    offsets: np.ndarray,
    lengths: np.ndarray,
    crcs: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
) -> np.ndarray:
    """The CRC32C of bytes ``starts[b]`` to ``ends[b]`` of a file, for each block ``b``, from
    the file's items (``offsets``, ``lengths``, ``crcs``: every item of the file, any order;
    a CRC of -1 is none). -1 for a block its items do not tile exactly (a gap, an overlap,
    an item across its edge) or that holds an item with no CRC: such a block's items are
    checked one by one. Blocks must not overlap."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    out = np.full(len(starts), -1, dtype=np.int64)
    if not len(starts) or not len(offsets):
        return out
    order = np.argsort(offsets, kind="stable")
    o = np.asarray(offsets, dtype=np.int64)[order]
    e = o + np.asarray(lengths, dtype=np.int64)[order]
    c = np.asarray(crcs, dtype=np.int64)[order]
    first = np.searchsorted(o, starts, side="left")  # each block's rows: first to last - 1
    last = np.searchsorted(o, ends, side="left")
    # per row: whether it starts where the one before ends (a run of such rows tiles)
    breaks = np.concatenate(([0], np.cumsum(o[1:] != e[:-1])))
    bad = np.concatenate(([0], np.cumsum(c < 0)))
    some = last > first
    lo, hi = np.where(some, first, 0), np.where(some, last - 1, 0)
    tiles = (
        some
        & (o[lo] == starts)
        & (e[hi] == ends)
        & (breaks[hi] == breaks[lo])
        & (bad[hi + 1] == bad[lo])
    )
    good = np.flatnonzero(tiles)
    if not len(good):
        return out
    # each row's term: its CRC shifted by the bytes after it in its block
    rows = np.concatenate([np.arange(first[b], last[b]) for b in good.tolist()])
    block_end = np.repeat(ends[good], last[good] - first[good])
    terms = shifted(c[rows].astype(np.uint32), block_end - e[rows])
    at = np.concatenate(([0], np.cumsum(last[good] - first[good])[:-1]))
    out[good] = np.bitwise_xor.reduceat(terms, at).astype(np.int64)
    return out
