"""A verified memory-tier snapshot matched against the state it is loaded into: every value
taken from the snapshot's objects, every tensor paired with the snapshot's view of the same
key, shape and dtype. Pure (no copy, no I/O): the caller copies the pairs in one batch."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._torch_compat import ShardedTensor
from ..errors import IntegrityError
from .memory_format import Path, key


def fill(
    template: Any,
    tensors: dict[str, torch.Tensor],
    objects: dict[str, Any],
    where: str,
    path: Path = (),
) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``template`` with every other value than a tensor taken from ``objects``, and the
    (template tensor, snapshot tensor) pairs to copy, checked to fit: the caller copies them
    all in one batch. Raises IntegrityError naming the first path that does not fit."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    return _fill(template, tensors, objects, where, path, pairs), pairs


def _fill(
    template: Any,
    tensors: dict[str, torch.Tensor],
    objects: dict[str, Any],
    where: str,
    path: Path,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> Any:
    if isinstance(template, dict):
        for k in list(template):
            template[k] = _fill(template[k], tensors, objects, where, (*path, k), pairs)
        return template
    if isinstance(template, list):
        for i in range(len(template)):
            template[i] = _fill(template[i], tensors, objects, where, (*path, i), pairs)
        return template
    if isinstance(template, tuple):
        return tuple(
            _fill(v, tensors, objects, where, (*path, i), pairs) for i, v in enumerate(template)
        )
    if isinstance(template, ShardedTensor):
        for i, shard in enumerate(template.local_shards()):
            pairs.append(_pair(shard.tensor, tensors, key((*path, f"#shard{i}")), where))
        return template
    if isinstance(template, DTensor):
        pairs.append(_pair(template.to_local(), tensors, key(path), where))
        return template
    if isinstance(template, torch.Tensor):
        pairs.append(_pair(template, tensors, key(path), where))
        return template
    k = key(path)
    if k not in objects:
        raise IntegrityError(f"{where} has no value for {k}: saved with another state layout")
    return objects[k]


def _pair(
    dst: torch.Tensor, tensors: dict[str, torch.Tensor], k: str, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    src = tensors.get(k)
    if src is None or src.shape != dst.shape or src.dtype != dst.dtype:
        got = "nothing" if src is None else f"{src.dtype} {list(src.shape)}"
        raise IntegrityError(
            f"{where}: {k} is {dst.dtype} {list(dst.shape)} here but {got} in the snapshot "
            "(another model, world size or sharding); the disk and remote tiers reshard"
        )
    return dst, src
