"""How one entry of a manifest index decodes: a tensor's properties, size and chunks, and a
key's path in the state. Pure: no I/O. :mod:`dcp_tiered.policy.manifest` parses the index
around them and checks what spans entries (counts, writers, sections)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import ManifestError
from . import manifest_codec

__all__ = ["Shape", "decode_entry", "path_of", "whole_tensor"]


_PATH_PARTS = frozenset((str, int))


def path_of(parts: Any) -> tuple[Any, ...]:
    """A key's path in the state (planner data): its ints as they are, anything else as a
    string. Most paths are strings and ints already, and come back as they are in one step."""
    if type(parts) is list and _PATH_PARTS.issuperset(map(type, parts)):
        return tuple(parts)
    return tuple(p if isinstance(p, int) else str(p) for p in parts)


class Shape(NamedTuple):
    """What every whole tensor of one shape shares: its grid as the index writes it, and
    its size and zero offsets as torch.Size (immutable, so shared by every such entry)."""

    grid: list[list[list[int]]] | None
    size: torch.Size
    offsets: torch.Size


def whole_tensor(
    raw: Any,
    ranks: Any,
    props: list[TensorProperties],
    world_size: int,
    shapes: dict[tuple[int, ...], Shape] | None = None,
) -> tuple[TensorStorageMetadata, list[int]] | None:
    """The entry of a tensor saved whole by one rank (every tensor of a single-rank or
    replicated state: most entries), decoded; None for anything else, which the general
    decoder then checks and decodes. Its grid is one run per dimension covering it (a
    0-d tensor: one chunk of no dimensions), its writers one progression of one rank.
    ``shapes``: the shapes seen so far in this index (a state has a few hundred shapes for
    20,000 tensors), whose grids and sizes are not made again."""
    if type(raw) is not dict or raw.get("type") != "tensor" or type(ranks) is not list:
        return None
    size, which = raw.get("size"), raw.get("props")
    if type(size) is not list or type(which) is not int or not 0 <= which < len(props):
        return None
    for n in size:
        if type(n) is not int or n <= 0:  # ints only: the key below would take True for 1
            return None
    key = tuple(size)
    shape = shapes.get(key) if shapes is not None else None
    if shape is None:
        grid = [[[n, 1]] for n in size] if size else None
        shape = Shape(grid, torch.Size(size), torch.Size([0] * len(size)))
        if shapes is not None:
            shapes[key] = shape
    grid = raw.get("grid")
    if grid is not None:
        if shape.grid is None or grid != shape.grid:
            return None
    elif size or raw.get("chunks") != [[]]:
        return None
    if len(ranks) != 1 or type(ranks[0]) is not list or len(ranks[0]) != 3:
        return None
    rank, step, count = ranks[0]
    if not (type(rank) is type(step) is type(count) is int):  # not bool: True == 1
        return None
    if not 0 <= rank < world_size or step != 0 or count != 1:
        return None
    chunk = ChunkStorageMetadata(shape.offsets, shape.size)
    return TensorStorageMetadata(props[which], shape.size, [chunk]), [rank]


def decode_entry(
    raw: Any, fqn: str, props: list[TensorProperties], max_chunks: int
) -> TensorStorageMetadata | BytesStorageMetadata:
    if not isinstance(raw, dict) or raw.get("type") not in ("tensor", "bytes"):
        raise ManifestError(f"bad entry for {fqn!r}: {raw!r}")
    if raw["type"] == "bytes":
        return BytesStorageMetadata()
    size = raw.get("size")
    if not isinstance(size, list) or not all(type(v) is int and v >= 0 for v in size):
        raise ManifestError(f"{fqn!r}: bad size {size!r}")
    chunks = manifest_codec.decode_chunks(
        raw, size, f"chunks of {fqn!r}", max_chunks=max(max_chunks, 0)
    )
    which = raw.get("props")
    if type(which) is not int or not 0 <= which < len(props):
        raise ManifestError(f"{fqn!r}: bad properties reference {which!r}")
    return TensorStorageMetadata(
        properties=props[which],
        size=torch.Size(size),
        chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )
