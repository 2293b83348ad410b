"""A memory-tier snapshot copied into its slot and checksummed in the same stretch of time.

The slot is checked by a hash over fixed chunks of its bytes (``memory_chunks``), not per
tensor: a state of 20,000 tensors costs a few dozen hash calls, as one of 30 large tensors
does. The copy runs in batches of about a chunk, in the slot's byte order, and a tensor of a
chunk or more a chunk at a time; as soon as a chunk is filled, the background thread hashes it
(from the CPU's cache) while the caller copies the next one. A snapshot is then valid about
when its copy ends. Restores verify the same chunks.

A state whose large tensors a memcpy may copy (plain contiguous CPU tensors, the usual case)
goes chunk by chunk instead (``chunk_copy``: each chunk copied and hashed by one thread); this
tensor-by-tensor copy is for the rest (GPU states, large non-contiguous tensors), and makes
the plan both use.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import batch_copy, host_copy
from ..policy import memory_chunks
from ..policy import memory_format as fmt
from . import chunk_copy


@dataclass
class CopyPlan:
    """How one state structure is copied into one slot (made once, reused every save)."""

    tree: Any  # the state's structure, its slot views at the tensors, keys at the values
    batches: list[tuple[int, int, int]]  # (first, end) tensors, chunks complete after them
    chunks: chunk_copy.ChunkPlan | None  # the copy by chunks (chunk_copy), where it can run
    # batch_copy's descriptions of the tree's dicts of views (dropped with the plan)
    described: batch_copy.Descriptions = field(default_factory=batch_copy.new_descriptions)


def plan(
    state: dict[str, Any],
    regions: list[fmt.Region],
    views: list[torch.Tensor],
    buffer: torch.Tensor,
    *,
    by_chunks: bool = True,
) -> CopyPlan | None:
    """The plan for ``state`` (whose tensors ``views`` hold, in order), or None where it holds
    distributed tensors or containers other than dicts, lists and tuples. ``by_chunks=False``
    (a state on a GPU: its device copies go in one batch): no copy by chunks."""
    by_key = {r.key: v for r, v in zip(regions, views)}
    try:
        tree = _tree(state, (), by_key)
        _, dsts, _ = batch_copy.pair(state, tree, on_value=lambda key, value: value)
    except (batch_copy.Mismatch, KeyError):
        return None
    base = buffer.data_ptr()
    chunks = chunk_copy.plan(dsts, base, buffer.nbytes) if by_chunks else None
    return CopyPlan(tree, batches(dsts, base), chunks)


def _tree(obj: Any, path: fmt.Path, by_key: dict[str, torch.Tensor]) -> Any:
    kind = type(obj)
    if kind in batch_copy.DICTS:
        return {k: _tree(v, (*path, k), by_key) for k, v in obj.items()}
    if kind is list or kind is tuple:
        return kind(_tree(v, (*path, i), by_key) for i, v in enumerate(obj))
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return by_key[fmt.key(path)]
    if isinstance(obj, (torch.Tensor, dict, list, tuple)):
        raise batch_copy.Mismatch
    return fmt.key(path)


def batches(dsts: list[torch.Tensor], base: int) -> list[tuple[int, int, int]]:
    """Copy batches of about a chunk each: (first, end) tensors, and how many chunks are
    complete once they are copied. Tensors not in byte order: one batch, checked after."""
    out, first, pending, end = [], 0, 0, 0
    for i, d in enumerate(dsts):
        offset = d.data_ptr() - base
        if offset < end:
            return [(0, len(dsts), 0)]
        if d.nbytes >= memory_chunks.CHUNK_BYTES and first < i:  # a batch of its own
            out.append((first, i, offset // memory_chunks.CHUNK_BYTES))
            first, pending = i, 0
        end = offset + d.nbytes
        pending += d.nbytes
        if pending >= memory_chunks.CHUNK_BYTES:
            out.append((first, i + 1, end // memory_chunks.CHUNK_BYTES))
            first, pending = i + 1, 0
    if first < len(dsts):
        out.append((first, len(dsts), 0))
    return out


def copy_and_checksum(
    buffer: torch.Tensor,
    size: int,
    dsts: list[torch.Tensor],
    srcs: list[torch.Tensor],
    steps: list[tuple[int, int, int]],
    submit: Callable[..., Future[str]],
) -> list[Future[str]]:
    """Copy ``srcs`` into ``dsts`` (views of ``buffer``) batch by batch, handing each chunk to
    ``submit`` (the background thread) once it is complete, unless the copy hashed it already;
    the futures of every chunk's checksum, in order."""
    chunk_bytes = memory_chunks.CHUNK_BYTES
    futures: list[Future[str] | None] = [None] * memory_chunks.count(size, chunk_bytes)
    queued = 0

    def hand_over(complete: int) -> None:
        nonlocal queued
        for chunk in range(queued, complete):
            if futures[chunk] is None:
                futures[chunk] = submit(memory_chunks.checksum, buffer, chunk, chunk_bytes, size)
        queued = max(queued, complete)

    base = buffer.data_ptr()
    for first, end, ready in steps:
        one = end - first == 1 and ready
        if not (one and _by_chunks(buffer, size, dsts[first], srcs[first], base, futures)):
            # about a chunk (4 MiB): its small tensors on this thread, beside the hashing one
            host_copy.copy_all(dsts[first:end], srcs[first:end], split_small=False)
        hand_over(ready)
    hand_over(len(futures))
    return [f for f in futures if f is not None]


def _by_chunks(
    buffer: torch.Tensor,
    size: int,
    dst: torch.Tensor,
    src: torch.Tensor,
    base: int,
    futures: list[Future[str] | None],
) -> bool:
    """Copy one large tensor of the slot chunk by chunk, on this thread and the copy helper's
    (``host_copy``: memcpy, not torch's pool) taking turns, each hashing the chunk it just
    filled while it is still in the CPU's cache; the hashes go into ``futures``. False, having
    copied nothing, for a tensor on another device or laid out otherwise."""
    plain = type(src) in (torch.Tensor, torch.nn.Parameter) and src.device.type == "cpu"
    if not (plain and src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous()):
        return False
    chunk_bytes, offset = memory_chunks.CHUNK_BYTES, dst.data_ptr() - base
    d, s = host_copy.as_bytes(dst), host_copy.as_bytes(src)
    pieces, done = [], 0
    while done < len(d):  # [start, end) of the tensor's bytes, ending on chunk boundaries
        end = min(len(d), (offset + done) // chunk_bytes * chunk_bytes + chunk_bytes - offset)
        pieces.append((done, end))
        done = end

    def copy(turn: list[tuple[int, int]]) -> None:
        for start, end in turn:
            whole = (offset + start) % chunk_bytes == 0 and end - start == chunk_bytes
            digest = _copy_hashing(d, s, start, end) if whole else None
            if not whole:
                np.copyto(d[start:end], s[start:end])
            if (offset + end) % chunk_bytes == 0:  # filled (the bytes of a chunk this tensor
                chunk = (offset + end) // chunk_bytes - 1  # starts in were copied earlier)
                done: Future[str] = Future()
                done.set_result(digest or memory_chunks.checksum(buffer, chunk, chunk_bytes, size))
                futures[chunk] = done

    host_copy.side_by_side(lambda: copy(pieces[::2]), lambda: copy(pieces[1::2]))
    return True


# The copy's step within a chunk: a piece hashed right after its copy is still in the core's own
# cache (L2), so the hash reads no memory the copy has not just touched (a 4 MiB chunk hashed
# after its copy: 1.14x a plain copy; in 512 KiB pieces: no slower than the copy).
_PIECE_BYTES = 512 * 2**10


def _copy_hashing(d: np.ndarray, s: np.ndarray, start: int, end: int) -> str:
    """Copy ``s[start:end]`` (one whole chunk of the slot) into ``d``, hashing as it goes."""
    hasher = memory_chunks.streaming()
    for a in range(start, end, _PIECE_BYTES):
        b = min(a + _PIECE_BYTES, end)
        np.copyto(d[a:b], s[a:b])
        hasher.update(memoryview(d[a:b]))  # type: ignore[arg-type]  # a numpy buffer
    return memory_chunks.hex_digest(hasher)
