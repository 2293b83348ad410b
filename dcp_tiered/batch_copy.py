"""A state dict copied into reused buffers with one batched tensor copy.

Staging (``staging.py``) and the memory tier copy the same structure into the same buffers on
every save. Walking DCP's generic helpers costs several Python calls per tensor and one
``copy_`` each; here one walk pairs every source tensor with its buffer, checking structure,
shape and dtype on the way, and a single ``torch._foreach_copy_`` copies them all. Anything
else than plain dicts, lists, tuples, plain tensors and simple values (a DTensor, a
ShardedTensor, an OrderedDict, ...) raises :class:`Mismatch` before a byte is copied, and the
caller uses its general path.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter, methodcaller
from typing import Any

import torch

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_PLAIN_TENSOR_TYPES = frozenset(_PLAIN_TENSORS)
_SIMPLE = (int, float, str, bytes, bool, type(None))
_size = methodcaller("size")
_dtype = attrgetter("dtype")


class Mismatch(Exception):
    """The state does not fit the buffers, or holds what this path does not copy."""


def copy_into(
    state: Any,
    buffers: Any,
    *,
    non_blocking: bool = False,
    on_value: Callable[[Any, Any], Any] | None = None,
) -> Any:
    """Copy every tensor of ``state`` into the tensor at the same place of ``buffers`` (same
    shape and dtype) in one batched copy; returns ``state``'s structure holding the buffers'
    tensors. A non-tensor value is deep-copied (immutable ones kept), or, with ``on_value``,
    replaced by ``on_value(buffers' leaf there, value)``. Raises Mismatch, having copied
    nothing, where ``state`` does not fit."""
    out, dsts, srcs = pair(state, buffers, on_value=on_value)
    copy_all(dsts, srcs, non_blocking=non_blocking)
    return out


def pair(
    state: Any, buffers: Any, *, on_value: Callable[[Any, Any], Any] | None = None
) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """What :func:`copy_into` copies, without copying: (result, destinations, sources)."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    return _pair(state, buffers, dsts, srcs, on_value), dsts, srcs


def copy_all(
    dsts: list[torch.Tensor], srcs: list[torch.Tensor], *, non_blocking: bool = False
) -> None:
    if dsts:
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


def _pair(
    obj: Any,
    buf: Any,
    dsts: list[torch.Tensor],
    srcs: list[torch.Tensor],
    on_value: Callable[[Any, Any], Any] | None,
) -> Any:
    kind = type(obj)
    if kind in _PLAIN_TENSORS:
        if type(buf) is not torch.Tensor or buf.shape != obj.shape or buf.dtype != obj.dtype:
            raise Mismatch
        dsts.append(buf)
        srcs.append(obj)
        return buf
    if kind is dict:
        if type(buf) is not dict or len(buf) != len(obj):
            raise Mismatch
        flat = _pair_tensor_dict(obj, buf, dsts, srcs)
        if flat is not None:
            return flat
        try:
            return {k: _pair(v, buf[k], dsts, srcs, on_value) for k, v in obj.items()}
        except KeyError:
            raise Mismatch from None
    if kind is list or kind is tuple:
        if type(buf) not in (list, tuple) or len(buf) != len(obj):
            raise Mismatch
        items = [_pair(v, b, dsts, srcs, on_value) for v, b in zip(obj, buf)]
        return items if kind is list else tuple(items)
    if isinstance(obj, (torch.Tensor, dict, list, tuple)) or isinstance(buf, torch.Tensor):
        raise Mismatch  # a subclass (the general path), or a tensor that became a value
    if on_value is not None:
        return on_value(buf, obj)
    return obj if kind in _SIMPLE else copy.deepcopy(obj)


def _pair_tensor_dict(
    obj: dict[Any, Any], buf: dict[Any, Any], dsts: list[torch.Tensor], srcs: list[torch.Tensor]
) -> dict[Any, Any] | None:
    """A dict of plain tensors only (a module's or an optimizer's flat state, thousands of
    entries) paired by C-level maps, not a Python call per tensor: the buffers' side is
    described once (:class:`_Described`), the state's side costs a size and a dtype per
    tensor. None where ``obj`` holds anything else (the general walk then takes it)."""
    values = list(obj.values())
    if not values or not set(map(type, values)) <= _PLAIN_TENSOR_TYPES:
        return None
    described = _described(buf)
    if described.keys != list(obj):
        return None  # other keys, or the same in another order: the general walk decides
    if described.sizes != list(map(_size, values)) or described.dtypes != list(map(_dtype, values)):
        raise Mismatch
    dsts += described.tensors
    srcs += values
    return dict(zip(described.keys, described.tensors))


@dataclass(frozen=True, slots=True)
class _Described:
    """A buffers dict of tensors, as :func:`_pair_tensor_dict` compares a state with it."""

    of: dict[Any, Any]
    keys: list[Any]
    tensors: list[torch.Tensor]
    sizes: list[torch.Size]
    dtypes: list[torch.dtype]


# id of a buffers dict -> its description. Buffers are made once and reused every save
# (staging, the memory tier), so this holds one entry per dict of them; a dict that went away
# and whose id came back is told apart by ``of``.
_DESCRIPTIONS: dict[int, _Described] = {}
_MAX_DESCRIPTIONS = 4096


def _described(buf: dict[Any, Any]) -> _Described:
    found = _DESCRIPTIONS.get(id(buf))
    if found is not None and found.of is buf and len(found.keys) == len(buf):
        return found
    tensors = list(buf.values())
    if set(map(type, tensors)) != {torch.Tensor}:
        raise Mismatch
    if len(_DESCRIPTIONS) >= _MAX_DESCRIPTIONS:
        _DESCRIPTIONS.clear()
    found = _DESCRIPTIONS[id(buf)] = _Described(
        buf, list(buf), tensors, list(map(_size, tensors)), list(map(_dtype, tensors))
    )
    return found
