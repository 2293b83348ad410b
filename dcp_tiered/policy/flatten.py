"""DCP's flattening of a state (``flatten_state_dict``, then ``_flatten_sharded_tensors``) in
one pass, for the states it cannot change: no ShardedTensor anywhere. Pure: no I/O.

Both DCP planners flatten the whole state on every save and every load, and DCP walks it
twice (the second walk only rewrites nested ShardedTensors, and copies everything else), with
an abstract-class check and a few closures per value: 20,000 tensors, about 0.12 s a save
and as much a load (profiled: ``_traverse_obj``, ``_is_terminal``, ``set_element``). The
result here is the same dict, with the same keys in the same order and the same mapping of
each key to its path; anything this walk does not know exactly as DCP does makes it give up
(None), and the caller runs DCP's own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import _version

# Leaves the walk takes without an isinstance check (the common ones): none is a Mapping, a
# list or a ShardedTensor.
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, bytes, type(None)})


_STR_ONLY = frozenset({str})
_PLAIN_DICTS = frozenset({dict, OrderedDict})  # whose keys, values and items agree


class _NotPlain(Exception):
    """Something only DCP's own walk handles: a ShardedTensor, or a duplicate key."""


def flatten(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]] | None:
    """(flat state, key -> path) exactly as DCP's save planner's ``set_up_planner`` makes them
    (and its load planner's, for a state without ShardedTensors), or None: use DCP's."""
    found = _flatten(state)
    return None if found is None else (found[0], found[1])


def flatten_for_load(
    state: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]], bool] | None:
    """:func:`flatten`'s result, and whether DCP's load set-up (``_init_state_dict``, run
    before it flattens) would leave ``state`` as it is but for the identity of its lists and
    tuples. That walk makes real tensors of meta ones (DTensors too), puts a copy in place of
    every list and tuple (the same elements), and None in place of any value it does not
    know (not a dict, tensor, number, string, bytes, list or tuple: a Mapping that is not a
    dict included)."""
    found = _flatten(state)
    if found is None:
        return None
    flat, paths, foreign = found
    return flat, paths, not foreign and all(map(_left_as_is, flat.values()))


def _flatten(
    state: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]], list[Any]] | None:
    if _version._derived_version == "2_3":  # DCP's old traversal: not this one
        return None
    flat: dict[str, Any] = {}
    paths: dict[str, tuple[Any, ...]] = {}
    foreign: list[Any] = []  # Mappings that are not dicts
    try:
        _visit((), state, flat, paths, foreign)
    except _NotPlain:
        return None
    return flat, paths, foreign


def _visit(
    path: tuple[Any, ...],
    value: Any,
    flat: dict[str, Any],
    paths: dict[str, tuple[Any, ...]],
    foreign: list[Any],
) -> None:
    kind = type(value)
    if kind is dict or (kind not in _PLAIN and isinstance(value, Mapping)):
        str_keys = _STR_ONLY >= set(map(type, value))
        if not str_keys and len({str(k) for k in value}) < len(value):
            raise _NotPlain  # keys equal as strings (0 and "0"): DCP's two walks differ
        if kind is not dict and not isinstance(value, dict):
            foreign.append(value)
        prefix = ".".join(map(str, path)) + "." if path else ""
        if kind in _PLAIN_DICTS and str_keys and _PLAIN.issuperset(map(type, value.values())):
            _leaves(path, prefix, value, flat, paths)  # a module's or optimizer's tensors
            return
        for k, v in value.items():
            key = str(k)
            if type(v) in _PLAIN:  # a leaf, taken here: most of a state (no call per value)
                fqn = prefix + key
                if fqn in flat:
                    raise _NotPlain  # DCP raises its own error for it
                flat[fqn] = v
                paths[fqn] = (*path, key)
            else:
                _visit((*path, key), v, flat, paths, foreign)
        return
    if (kind is list or (kind not in _PLAIN and isinstance(value, list))) and not _terminal(value):
        for i, v in enumerate(value):
            before = len(flat)
            _visit((*path, i), v, flat, paths, foreign)
            if len(flat) == before:  # an element without values ({}): a load's walk pads
                raise _NotPlain  # the rebuilt list with None, and the two walks differ
        return
    if kind not in _PLAIN and isinstance(value, ShardedTensor):
        raise _NotPlain  # DCP rewrites nested ones
    fqn = ".".join(map(str, path))
    if fqn in flat:
        raise _NotPlain  # DCP raises its own error for it
    flat[fqn] = value
    paths[fqn] = path


def _leaves(
    path: tuple[Any, ...],
    prefix: str,
    value: Mapping[str, Any],
    flat: dict[str, Any],
    paths: dict[str, tuple[Any, ...]],
) -> None:
    """A dict of string keys to leaves only, taken whole (a state's bulk: 20,000 tensors in
    two dicts, 9 -> 4 ms): the same entries, in the same order, as one at a time. Only a
    dict or an OrderedDict: a subclass may iterate its keys in another order than its
    ``items()``, which DCP walks."""
    keys = [prefix + key for key in value] if prefix else list(value)
    if not flat.keys().isdisjoint(keys):
        raise _NotPlain  # DCP raises its own error for it
    flat.update(zip(keys, value.values()))
    paths.update(zip(keys, [(*path, key) for key in value]))


def _terminal(values: list[Any]) -> bool:
    """DCP's ``_is_terminal`` of a list: no tensor in it, no mapping, no list that is not."""
    for entry in values:
        kind = type(entry)
        if kind is int or kind is float or kind is str:
            continue
        if isinstance(entry, (Mapping, torch.Tensor)):
            return False
        if isinstance(entry, list) and not _terminal(entry):
            return False
    return True


_META = torch.device("meta")
_AS_IS = frozenset({int, float, bool, str, bytes, type(None)})  # DCP's walk returns these


def _left_as_is(value: Any) -> bool:
    kind = type(value)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return not value.is_meta
    if kind in _AS_IS:
        return True
    if kind is list or kind is tuple:  # rebuilt of the same elements (a list of values
        return all(map(_left_as_is, value))  # a path each is not a value: not seen here)
    if isinstance(value, torch.Tensor) and not isinstance(value, ShardedTensor):
        return getattr(value, "device", _META) != _META  # a DTensor: its device is its mesh's
    return False
