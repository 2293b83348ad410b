"""Compact encodings the manifest uses, so that its size and parse time grow with the state's
shape, not with the number of ranks. Pure: no I/O.

- Runs: ``[[value, count], ...]`` for lists with repeats (the sizes of a tensor's shards).
- Progressions: ``[[start, step, count], ...]`` for lists of ranks (FSDP's chunk ``i`` is
  written by rank ``i``: one triple for all of them).
- Chunk grids: a tensor sharded as a grid (FSDP, TP, both) is stored as each dimension's
  split sizes; any other chunk list is stored explicitly.
- Sealing: the checksum of a JSON document's own bytes appended as its last member, so a
  manifest is serialised once and verified without re-encoding it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

from ..errors import ManifestError
from . import integrity
from .chunk_grid import splits, with_offsets

_SEAL_KEY = "manifest_checksum"
# ,"manifest_checksum":"0123abcd"}  -- a fixed-length tail, found without parsing
_SEAL_LEN = len(f',"{_SEAL_KEY}":"') + 8 + 2


def runs(values: Sequence[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def checked_runs(encoded: Any, what: str, *, total: int) -> list[list[int]]:
    """Runs of positive values (the split sizes of one dimension) whose sum is ``total``,
    checked, not expanded: a count of 2**40 in a few bytes is judged, never allocated."""
    pairs = _list(encoded, what)
    covered = 0
    for pair in pairs:
        value, count = _ints(pair, 2, what)
        if value <= 0:
            raise ManifestError(f"{what}: split size {value} in {encoded!r}")
        covered += value * count
    if covered != total:
        raise ManifestError(f"{what}: split sizes {encoded!r} do not add up to {total}")
    return pairs


def unruns(pairs: list[list[int]]) -> list[int]:
    """Runs checked by :func:`checked_runs`, expanded."""
    out: list[int] = []
    for value, count in pairs:
        out.extend([value] * count)
    return out


def progressions(values: Sequence[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for v in values:
        if out:
            start, step, count = out[-1]
            if count == 1:
                out[-1] = [start, v - start, 2]
                continue
            if start + step * count == v:
                out[-1][2] += 1
                continue
        out.append([v, 0, 1])
    return out


def unprogressions(encoded: Any, what: str, *, length: int, low: int, high: int) -> list[int]:
    """Progressions of ``length`` values in all, each in ``[low, high)``: counts and bounds
    are checked before anything is expanded."""
    triples = _list(encoded, what)
    total = 0
    for triple in triples:
        start, step, count = _ints(triple, 3, what, signed=True)
        # a progression's extremes are its ends
        if count <= 0 or not (low <= start < high and low <= start + step * (count - 1) < high):
            raise ManifestError(f"{what}: {triple!r} is empty or leaves {low}..{high - 1}")
        total += count
    if total != length:
        raise ManifestError(f"{what}: {encoded!r} does not hold {length} values")
    out: list[int] = []
    for start, step, count in triples:
        out.extend(range(start, start + step * count, step) if step else [start] * count)
    return out


def encode_chunks(size: Sequence[int], chunks: Sequence[tuple[Sequence[int], Sequence[int]]]):
    """``{"grid": [runs of split sizes per dim]}`` when the chunks, in order, are the row-major
    product of per-dimension splits that tile the tensor; else ``{"chunks": [[*offsets,
    *sizes], ...]}``."""
    cuts = [splits(d, n, chunks) for d, n in enumerate(size)] if size else None
    if (
        cuts is not None
        and all(c is not None for c in cuts)
        and len(chunks) == _product(len(c) for c in cuts if c is not None)
    ):
        grid = [c for c in cuts if c is not None]
        offsets = itertools.product(*[[o for o, _ in with_offsets(c)] for c in grid])
        # compared as tuples (C speed: the chunks' own are tuples or torch.Size)
        if list(offsets) == [tuple(o) for o, _ in chunks] and list(itertools.product(*grid)) == [
            tuple(s) for _, s in chunks
        ]:
            return {"grid": [runs(c) for c in grid]}
    return {"chunks": [[*offsets, *sizes] for offsets, sizes in chunks]}


def decode_chunks(
    encoded: Any, size: Sequence[int], what: str, *, max_chunks: int
) -> list[tuple[list[int], list[int]]]:
    """The chunks of a tensor of ``size``, each inside it, at most ``max_chunks`` of them (a
    grid's cell count is checked before the grid is expanded)."""
    ndim = len(size)
    if not isinstance(encoded, dict):
        raise ManifestError(f"{what}: bad chunk list {encoded!r}")
    if "grid" in encoded:
        dims = _list(encoded["grid"], what)
        if len(dims) != ndim:
            raise ManifestError(f"{what}: grid has {len(dims)} dimensions, tensor {ndim}")
        runs_of = [checked_runs(d, what, total=n) for d, n in zip(dims, size)]
        cells = 1
        for runs_of_dim in runs_of:
            cells *= sum([count for _, count in runs_of_dim])
        if cells > max_chunks:
            raise ManifestError(f"{what}: a grid of more than {max_chunks} chunks")
        grid = itertools.product(*[with_offsets(unruns(r)) for r in runs_of])
        return [([o for o, _ in cell], [s for _, s in cell]) for cell in grid]
    rows = _list(encoded.get("chunks"), what)
    if len(rows) > max_chunks:
        raise ManifestError(f"{what}: more than {max_chunks} chunks")
    out = []
    for row in rows:
        values = _ints(row, 2 * ndim, what)
        offsets, sizes = values[:ndim], values[ndim:]
        if any(o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise ManifestError(f"{what}: chunk {row!r} lies outside the tensor's {list(size)}")
        out.append((offsets, sizes))
    return out


def seal(body: dict[str, Any]) -> bytes:
    """Compact JSON of ``body`` with the CRC32C of those bytes appended as its last member."""
    return seal_text(json.dumps(body, separators=(",", ":"), ensure_ascii=False))


def seal_text(text: str) -> bytes:
    """:func:`seal` of a body already in JSON (one object)."""
    raw = text.encode()
    crc = integrity.format_checksum(integrity.checksum(raw))
    return raw[:-1] + f',"{_SEAL_KEY}":"{crc}"}}'.encode()


def is_sealed(data: bytes) -> bool:
    return data.endswith(b'"}') and data[-_SEAL_LEN:].startswith(f',"{_SEAL_KEY}":"'.encode())


def unseal(data: bytes) -> bool:
    """Whether sealed ``data`` still has the checksum it was sealed with."""
    if not is_sealed(data):
        return False
    raw = data[:-_SEAL_LEN] + b"}"
    return integrity.format_checksum(integrity.checksum(raw)) == data[-10:-2].decode("ascii")


# ---------------------------------------------------------------- helpers


def _product(values: Any) -> int:
    total = 1
    for v in values:
        total *= v
    return total


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ManifestError(f"{what}: expected a list, got {type(value).__name__}")
    return value


def _ints(value: Any, n: int, what: str, *, signed: bool = False) -> list[int]:
    if (
        not isinstance(value, list)
        or len(value) != n
        or not all(type(v) is int and (signed or v >= 0) for v in value)
    ):
        raise ManifestError(f"{what}: expected {n} integers, got {value!r}")
    return value
