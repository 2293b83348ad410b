"""Chunk geometry: whether a tensor's chunks tile it as a grid, and the global save plan's
check built on that. Pure: no I/O.

DCP's ``_validate_global_plan`` sweeps each tensor's chunks along its *longest* dimension and
compares every chunk with the ones still open there. FSDP shards dimension 0, so for a
tensor whose longest dimension is another one (Llama's ``w2``, ``wk``, ``wv``) every chunk is
open at once: N²/2 box comparisons per tensor at N ranks (3 M at 256 ranks, 13 G at 16 k).
Sharded tensors are grids (FSDP, TP, both: the product of per-dimension splits), and a grid
whose cells each appear once tiles the tensor, which one pass shows. Anything else is swept
along the dimension with the most distinct offsets, where chunks overlap least.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

Box = tuple[Sequence[int], Sequence[int]]  # (offsets, sizes)


def splits(dim: int, length: int, chunks: Sequence[Box]) -> list[int] | None:
    """The sizes of the distinct pieces chunks cut dimension ``dim`` into, if they tile it."""
    pieces = sorted({(offsets[dim], sizes[dim]) for offsets, sizes in chunks})
    pos = 0
    for offset, piece in pieces:
        if offset != pos or piece <= 0:
            return None
        pos += piece
    return [piece for _, piece in pieces] if pos == length else None


def with_offsets(sizes: list[int]) -> list[tuple[int, int]]:
    out, pos = [], 0
    for size in sizes:
        out.append((pos, size))
        pos += size
    return out


def tiles_as_grid(size: Sequence[int], chunks: Sequence[Box]) -> bool:
    """Whether ``chunks`` (in any order) are each cell of a grid that tiles ``size`` once."""
    cuts = [splits(d, n, chunks) for d, n in enumerate(size)]
    if any(c is None for c in cuts):
        return False
    cells = math.prod(len(c) for c in cuts if c is not None)
    return len(chunks) == cells == len({tuple(offsets) for offsets, _ in chunks})


def plan_errors(metadata: Any, plans: int) -> list[str]:
    """What is wrong with a global save plan's chunks, in DCP's words (its
    ``_validate_global_plan``'s checks): chunks out of bounds, overlapping chunks, and, when
    more than one rank planned, chunks that do not cover their tensor."""
    errors: list[str] = []
    for key, value in metadata.state_dict_metadata.items():
        chunks = getattr(value, "chunks", None)
        if chunks is None or len(value.size) == 0:  # bytes, or a scalar
            continue
        boxes = [(c.offsets, c.sizes) for c in chunks]
        if len(boxes) > 1 and tiles_as_grid(value.size, boxes):
            continue
        volume = 0
        for c in chunks:
            if not _inside(value.size, c.offsets, c.sizes):
                errors.append(
                    f"key:{key} has out of bounds chunk: tensor-size:{value.size} chunk: {c}"
                )
            volume += math.prod(c.sizes)
        if len(chunks) > 1:
            errors.extend(
                f"key:{key} has overlapping chunks: {a} {b}" for a, b in _overlaps(chunks)
            )
        if plans > 1 and volume != math.prod(value.size):
            errors.append(
                f"key:{key} invalid fill tensor-volume: {math.prod(value.size)} "
                f"chunks-volume: {volume}"
            )
    return errors


def _inside(size: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> bool:
    return all(o >= 0 and s >= 0 and o + s <= n for n, o, s in zip(size, offsets, sizes))


def _overlaps(chunks: Sequence[Any]) -> list[tuple[Any, Any]]:
    """Pairs of overlapping chunks: a sweep along the dimension with the most distinct
    offsets, comparing each chunk only with those not yet ended there."""
    ndim = len(chunks[0].offsets)
    dim = max(range(ndim), key=lambda d: len({c.offsets[d] for c in chunks}))
    order = sorted(range(len(chunks)), key=lambda i: tuple(chunks[i].offsets))
    order.sort(key=lambda i: chunks[i].offsets[dim])  # stable: ties keep row-major order
    open_: list[tuple[int, int]] = []  # (end along dim, index), sorted
    found: list[tuple[Any, Any]] = []
    for i in order:
        box = chunks[i]
        start = box.offsets[dim]
        del open_[: bisect.bisect_right(open_, (start, len(chunks)))]
        found.extend((box, chunks[j]) for _, j in open_ if _intersect(box, chunks[j]))
        bisect.insort(open_, (start + box.sizes[dim], i))
    return found


def _intersect(a: Any, b: Any) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_
        for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    )
