"""A memory-tier snapshot copied into its slot and checksummed in the same stretch of time.

The slot is checked by a hash over fixed chunks of its bytes (``memory_chunks``), not per
tensor: a state of 20,000 tensors costs a few dozen hash calls, as one of 30 large tensors
does. The copy runs in batches of about a chunk, in the slot's byte order, and a tensor of a
chunk or more a chunk at a time; as soon as a chunk is filled, the background thread hashes it
(from the CPU's cache) while the caller copies the next one. A snapshot is then valid about
when its copy ends. Restores verify the same chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import batch_copy
from ..policy import memory_chunks
from ..policy import memory_format as fmt


@dataclass
class CopyPlan:
    """How one state structure is copied into one slot (made once, reused every save)."""

    tree: Any  # the state's structure, its slot views at the tensors, keys at the values
    batches: list[tuple[int, int, int]]  # (first, end) tensors, chunks complete after them
    # batch_copy's descriptions of the tree's dicts of views (dropped with the plan)
    described: batch_copy.Descriptions = field(default_factory=batch_copy.new_descriptions)


def plan(
    state: dict[str, Any],
    regions: list[fmt.Region],
    views: list[torch.Tensor],
    buffer: torch.Tensor,
) -> CopyPlan | None:
    """The plan for ``state`` (whose tensors ``views`` hold, in order), or None where it holds
    distributed tensors or containers other than dicts, lists and tuples."""
    by_key = {r.key: v for r, v in zip(regions, views)}
    try:
        tree = _tree(state, (), by_key)
        _, dsts, _ = batch_copy.pair(state, tree, on_value=lambda key, value: value)
    except (batch_copy.Mismatch, KeyError):
        return None
    return CopyPlan(tree, batches(dsts, buffer.data_ptr()))


def _tree(obj: Any, path: fmt.Path, by_key: dict[str, torch.Tensor]) -> Any:
    kind = type(obj)
    if kind is dict:
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
    ``submit`` (the background thread) once it is complete; the futures of every chunk's
    checksum, in order."""
    futures: list[Future[str]] = []
    chunk_bytes = memory_chunks.CHUNK_BYTES

    def hand_over(complete: int) -> None:
        while len(futures) < complete:
            futures.append(submit(memory_chunks.checksum, buffer, len(futures), chunk_bytes, size))

    base = buffer.data_ptr()
    for first, end, ready in steps:
        if end - first == 1 and ready:  # one tensor of a chunk or more
            _copy_by_chunks(dsts[first], srcs[first], dsts[first].data_ptr() - base, hand_over)
        else:
            batch_copy.copy_all(dsts[first:end], srcs[first:end])
        hand_over(ready)
    hand_over(memory_chunks.count(size, chunk_bytes))
    return futures


def _copy_by_chunks(
    dst: torch.Tensor, src: torch.Tensor, offset: int, hand_over: Callable[[int], None]
) -> None:
    """Copy one large tensor (at byte ``offset`` of the slot) a chunk at a time, handing each
    chunk over as soon as it is filled: its hash then reads it from the cache, not from memory.
    A tensor on another device, or laid out otherwise, is copied whole."""
    plain = type(src) in (torch.Tensor, torch.nn.Parameter) and src.device.type == "cpu"
    if not (plain and src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous()):
        batch_copy.copy_all([dst], [src])
        return
    chunk_bytes, item = memory_chunks.CHUNK_BYTES, dst.element_size()
    d, s = dst.view(-1), src.detach().view(-1)
    done = 0
    while done < d.numel():
        boundary = (offset + done * item) // chunk_bytes * chunk_bytes + chunk_bytes
        end = min(d.numel(), max(done + 1, (boundary - offset) // item))
        d[done:end].copy_(s[done:end])
        done = end
        hand_over((offset + done * item) // chunk_bytes)
