"""A memory-tier snapshot copied into its slot and checksummed in the same stretch of time.

The slot is checked by CRC32C over fixed chunks of its bytes (``memory_format.CHUNK_BYTES``),
not per tensor: a state of 20,000 tensors costs a few dozen checksum calls, as one of 30 large
tensors does. The copy runs in batches of about a chunk, in the slot's byte order; as soon as a
batch has filled a chunk, the background thread checksums it while the caller copies the next
one. A snapshot is then valid about when its copy ends. Restores verify the same chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import batch_copy
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
        end = offset + d.nbytes
        pending += d.nbytes
        if pending >= fmt.CHUNK_BYTES:
            out.append((first, i + 1, end // fmt.CHUNK_BYTES))
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
    for first, end, ready in steps:
        batch_copy.copy_all(dsts[first:end], srcs[first:end])
        while len(futures) < ready:
            futures.append(submit(fmt.chunk_checksum, buffer, len(futures), fmt.CHUNK_BYTES, size))
    while len(futures) < fmt.chunk_count(size, fmt.CHUNK_BYTES):
        futures.append(submit(fmt.chunk_checksum, buffer, len(futures), fmt.CHUNK_BYTES, size))
    return futures
