"""A state dict copied into reused buffers with one batched tensor copy.

Staging (``staging.py``) and the memory tier copy the same structure into the same buffers on
every save. Walking DCP's generic helpers costs several Python calls per tensor and one
``copy_`` each; here one walk pairs every source tensor with its buffer, checking structure,
shape and dtype on the way, and one batch copies them all (:mod:`dcp_tiered.host_copy`). Anything
else than plain dicts, lists, tuples, plain tensors and simple values (a DTensor, a
ShardedTensor, an OrderedDict, ...) raises :class:`Mismatch` before a byte is copied, and the
caller uses its general path.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch

from . import host_copy
from .host_copy import PLAIN_TENSORS

SIMPLE = (int, float, str, bytes, bool, type(None))  # immutable: never copied
# nn.Module.state_dict() returns an OrderedDict: the commonest state there is. Its buffers (and
# this path's result) are plain dicts, as torch's own copy makes them.
DICTS = (dict, OrderedDict)
_shape = attrgetter("shape")  # the same torch.Size as .size(), fetched for less
_dtype = attrgetter("dtype")


class Mismatch(Exception):
    """The state does not fit the buffers, or holds what this path does not copy."""


def copy_into(
    state: Any,
    buffers: Any,
    *,
    non_blocking: bool = False,
    on_value: Callable[[Any, Any], Any] | None = None,
    descriptions: Descriptions | None = None,
) -> Any:
    """Copy every tensor of ``state`` into the tensor at the same place of ``buffers`` (same
    shape and dtype) in one batched copy; returns ``state``'s structure holding the buffers'
    tensors. A non-tensor value is deep-copied (immutable ones kept), or, with ``on_value``,
    replaced by ``on_value(buffers' leaf there, value)``. Raises Mismatch where ``state``
    does not fit, having copied nothing (or, with thousands of tensors, whose checks run
    beside the copy, some of them: the buffers are then the caller's to fill again; staging
    does). ``descriptions``: kept by the owner of ``buffers``
    for as long as it reuses them (:func:`new_descriptions`), so that later copies into them
    skip describing them again."""
    out, dsts, srcs, expected = pair_unchecked(
        state, buffers, on_value=on_value, descriptions=descriptions
    )
    host_copy.copy_all(dsts, srcs, non_blocking=non_blocking, check=expected.check)
    return out


def pair(
    state: Any,
    buffers: Any,
    *,
    on_value: Callable[[Any, Any], Any] | None = None,
    descriptions: Descriptions | None = None,
) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """What :func:`copy_into` copies, without copying: (result, destinations, sources)."""
    out, dsts, srcs, expected = pair_unchecked(
        state, buffers, on_value=on_value, descriptions=descriptions
    )
    expected.check(0, len(srcs))
    return out, dsts, srcs


def pair_unchecked(
    state: Any,
    buffers: Any,
    *,
    on_value: Callable[[Any, Any], Any] | None = None,
    descriptions: Descriptions | None = None,
) -> tuple[Any, list[torch.Tensor], list[torch.Tensor], Expected]:
    """:func:`pair`, except that the shapes and dtypes of the tensors in dicts of tensors
    are not compared yet: the caller checks each stretch with ``Expected.check`` before it
    copies it (so that it can check one stretch while another is being copied)."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    known = {} if descriptions is None else descriptions
    expected = Expected(srcs, [], [])
    out = _pair(state, buffers, dsts, srcs, on_value, known, expected)
    return out, dsts, srcs, expected


@dataclass(frozen=True, slots=True)
class Expected:
    """The shape and dtype that each source must have, in the sources' order."""

    srcs: list[torch.Tensor]
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]

    def check(self, start: int, end: int) -> None:
        """Raise Mismatch unless ``srcs[start:end]`` have the expected shapes and dtypes."""
        part = self.srcs[start:end]
        if self.shapes[start:end] != list(map(_shape, part)):
            raise Mismatch
        if self.dtypes[start:end] != list(map(_dtype, part)):
            raise Mismatch


def _pair(
    obj: Any,
    buf: Any,
    dsts: list[torch.Tensor],
    srcs: list[torch.Tensor],
    on_value: Callable[[Any, Any], Any] | None,
    known: Descriptions,
    expected: Expected,
) -> Any:
    kind = type(obj)
    if kind in PLAIN_TENSORS:
        if type(buf) is not torch.Tensor or buf.shape != obj.shape or buf.dtype != obj.dtype:
            raise Mismatch
        dsts.append(buf)
        srcs.append(obj)
        expected.shapes.append(buf.shape)
        expected.dtypes.append(buf.dtype)
        return buf
    if kind in DICTS:
        if type(buf) not in DICTS or len(buf) != len(obj):
            raise Mismatch
        flat = _pair_tensor_dict(obj, buf, dsts, srcs, known, expected)
        if flat is not None:
            return flat
        try:
            return {
                k: _pair(v, buf[k], dsts, srcs, on_value, known, expected) for k, v in obj.items()
            }
        except KeyError:
            raise Mismatch from None
    if kind is list or kind is tuple:
        if type(buf) not in (list, tuple) or len(buf) != len(obj):
            raise Mismatch
        items = [_pair(v, b, dsts, srcs, on_value, known, expected) for v, b in zip(obj, buf)]
        return items if kind is list else tuple(items)
    if isinstance(obj, (torch.Tensor, dict, list, tuple)) or isinstance(buf, torch.Tensor):
        raise Mismatch  # a subclass (the general path), or a tensor that became a value
    if on_value is not None:
        return on_value(buf, obj)
    return obj if kind in SIMPLE else copy.deepcopy(obj)


def _pair_tensor_dict(
    obj: dict[Any, Any],
    buf: dict[Any, Any],
    dsts: list[torch.Tensor],
    srcs: list[torch.Tensor],
    known: Descriptions,
    expected: Expected,
) -> dict[Any, Any] | None:
    """A dict of plain tensors only (a module's or an optimizer's flat state, thousands of
    entries) paired by C-level maps, not a Python call per tensor: the buffers' side is
    described once (:class:`_Described`); the state's side, a shape and a dtype per tensor,
    is left in ``expected`` for the caller to check. None where ``obj`` holds anything else
    (the general walk then takes it)."""
    values = list(obj.values())
    if not values or not set(map(type, values)) <= PLAIN_TENSORS:
        return None
    described = _described(buf, known)
    if described.keys != list(obj):
        return None  # other keys, or the same in another order: the general walk decides
    dsts += described.tensors
    srcs += values
    expected.shapes.extend(described.sizes)
    expected.dtypes.extend(described.dtypes)
    return dict(zip(described.keys, described.tensors))


@dataclass(frozen=True, slots=True)
class _Described:
    """A buffers dict of tensors, as :func:`_pair_tensor_dict` compares a state with it."""

    of: dict[Any, Any]
    keys: list[Any]
    tensors: list[torch.Tensor]
    sizes: list[torch.Size]
    dtypes: list[torch.dtype]


# id of a buffers dict -> its description (holding the dict, so the id stays its own)
Descriptions = dict[int, _Described]


def _described(buf: dict[Any, Any], known: Descriptions) -> _Described:
    found = known.get(id(buf))
    if found is not None and found.of is buf and len(found.keys) == len(buf):
        return found
    tensors = list(buf.values())
    if set(map(type, tensors)) != {torch.Tensor}:
        raise Mismatch
    found = known[id(buf)] = _Described(
        buf, list(buf), tensors, list(map(_shape, tensors)), list(map(_dtype, tensors))
    )
    return found


def new_descriptions() -> Descriptions:
    """A cache of buffer descriptions for :func:`copy_into` and :func:`pair`, for the owner
    of the buffers to keep beside them (and drop with them: it holds them)."""
    return {}
