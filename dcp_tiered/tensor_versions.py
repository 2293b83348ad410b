"""Whether tensors changed while a copy read them, by torch's own version counters.

An in-place change made through torch (``add_``, ``copy_``, an optimizer's for-each and
for-loop steps) bumps the changed tensor's version counter, grad mode or not. A snapshot or
a disk save's staging copy made beside training (``CheckpointManager(async_snapshots=True)``)
reads the counters before and after its copy: where one moved, the copy may mix two steps and
is not committed.

This catches a training loop that forgot to wait for the copy, not every writer. Some kernels
write tensors without bumping their counters: torch 2.13's fused AdamW leaves the parameters'
and moments' alone (its step counters, in the state too, move), BatchNorm's its running
statistics' (``num_batches_tracked`` moves); a C extension handed the raw pointer moves none.
The guarantee is the caller's wait (``wait_staged()``); this is its check. Inference tensors
have no counter and are not checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ._torch_compat import ShardedTensor
from .errors import StateChangedError


def leaves(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a copy of state dict ``obj`` reads, with their paths: the local tensor of
    a DTensor and the shards of a ShardedTensor (what the optimizer changes in place)."""
    if isinstance(obj, DTensor):
        yield path, obj.to_local()
    elif isinstance(obj, ShardedTensor):
        for i, shard in enumerate(obj.local_shards()):
            yield f"{path}[shard {i}]", shard.tensor
    elif isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}[{i}]")


def read(tensors: Sequence[torch.Tensor]) -> list[tuple[int | None, int]]:
    """Each tensor's version counter (None: an inference tensor, which has none) and data
    address: a change in place moves the one, other memory given to the tensor (``.data =``,
    ``set_``, which move no counter) the other."""
    try:
        return [(t._version, t.data_ptr()) for t in tensors]
    except RuntimeError:  # an inference tensor among them: one by one
        return [(_version(t), t.data_ptr()) for t in tensors]


def require_unchanged(
    tensors: Sequence[torch.Tensor],
    before: list[tuple[int | None, int]],
    name_of: Callable[[int], str],
    where: str,
    what: str = "snapshot",
) -> None:
    """Raise StateChangedError naming (``name_of(index)``) the tensors whose counters or
    addresses moved since ``before``; ``what`` was copied (for the message)."""
    after = read(tensors)
    if after == before:
        return
    changed = [name_of(i) for i, (a, b) in enumerate(zip(after, before)) if a != b]
    shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    raise StateChangedError(
        f"{where}: {len(changed)} tensor(s) changed while the {what} copied them ({shown}), "
        f"so it mixes two steps and was not committed; the previous {what} is intact. With "
        "async_snapshots=True call wait_staged() before changing the state (before "
        "optimizer.step())."
    )


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:
        return None
