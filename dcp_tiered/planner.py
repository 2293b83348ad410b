"""DCP's default planners: the save planner with the coordinator's global planning made
cheaper at scale, and the load planner with typed errors for a state that does not fit.

``TieredSavePlanner`` is ``DefaultSavePlanner`` (same plans, same metadata, the same errors,
plan caching with ``enable_plan_caching=True``) with two changes on the coordinator:

- the global plan's check is :func:`dcp_tiered.policy.chunk_grid.plan_errors`: one pass per
  tensor for grid-sharded tensors (FSDP, TP, both), where DCP's compares N²/2 chunk pairs for
  every tensor whose longest dimension is not the sharded one;
- the global planning runs with cyclic garbage collection paused (:mod:`dcp_tiered._gc`), as
  does the flattening of the state on every rank (``TieredLoadPlanner`` pauses it too);

and one on every rank: a save of the same structure as the last one (the same keys, shapes,
dtypes and nesting, plain tensors and values only) reuses the last local plan instead of
making one item per tensor again. With ``enable_plan_caching=True`` DCP then finds it
unchanged by identity and skips the plan exchange and the global planning as well; the plans
DCP keeps for that are made of one set of objects where they are equal (see ``_sharing``).
``cache_key`` keeps the plan caches of different writers in one process apart (DCP keeps one
per planner class otherwise).

CheckpointManager and the DeepSpeed and HF adapters use it (Megatron plans with MCore's
planner); with ``dcp.save``/``dcp.async_save`` pass it yourself::

    dcp.save(state, checkpoint_id="step-100", storage_writer=writer,
             planner=TieredSavePlanner())
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import threading
from collections import ChainMap, OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from . import _gc, _torch_compat, metadata_broadcast
from .host_copy import PLAIN_TENSORS
from .policy import flatten
from .policy.chunk_grid import plan_errors

# planner cache key -> (structure, flattening map, local plan) of its last save
_LOCAL_PLANS: dict[str, tuple[list[Any], Any, SavePlan]] = {}


def _structure(state: dict[str, Any], is_coordinator: bool) -> list[Any] | None:
    """What DCP's local plan of the flat ``state`` depends on: its keys in order, each value's
    class, and per plain tensor its size, dtype, layout, requires_grad and pinning (its
    TensorProperties); a value's key alone (a bytes item, on the coordinator only). None for
    anything else (DTensors, ShardedTensors, objects that make their own write items): those
    are planned afresh. The facts of every tensor are taken by one ``map`` (no Python frame
    per tensor; one pass over the tensors, where a pass per fact costs twice as much)."""
    values = list(state.values())
    kinds = list(map(type, values))
    tensors = values
    if not PLAIN_TENSORS.issuperset(kinds):
        for value, kind in zip(values, kinds):
            if kind not in PLAIN_TENSORS and (
                isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__")
            ):
                return None
        tensors = [v for v, kind in zip(values, kinds) if kind in PLAIN_TENSORS]
    out: list[Any] = [is_coordinator, list(state), kinds]
    out.append(list(map(_TENSOR_FACTS, tensors)))
    out.append(list(map(torch.Tensor.is_pinned, tensors)) if _may_pin() else None)
    return out


_TENSOR_FACTS = operator.attrgetter("shape", "dtype", "layout", "requires_grad")


def _may_pin() -> bool:
    """Whether any tensor here can be pinned. ATen's ``is_pinned`` asks the accelerator's
    hooks, and answers False without one (a build for CPU only, no device backend
    registered): no tensor is then asked (20,000 tensors: 7-15 ms a save). Without its check
    of the device, which could start a driver (and poison a later fork)."""
    return torch.accelerator.current_accelerator(check_available=False) is not None


# DCP's plan caching keeps, for the life of the process, the local plan, every rank's local
# plan as the coordinator received it, the global plan and the final plan: each an unpickled
# copy with objects of its own for every item (20,000 tensors: 1.2 million objects in all).
# The garbage collector walks them all at each full collection (about a second), and the
# copies are equal: where they are, the coordinator's and every rank's later copies are made
# of the objects of the earlier ones (tests/test_plan_caching.py counts them).


def _same_items(a: list[Any], b: list[Any]) -> bool:
    """Equal write items, index hints included (``MetadataIndex``'s ``==`` leaves them out)."""
    return (
        len(a) == len(b)
        and (not a or (a[0] == b[0] and a[-1] == b[-1]))
        and a == b
        and all(x.index.index == y.index.index for x, y in zip(a, b))
    )


def _sharing(plan: SavePlan, own: SavePlan) -> SavePlan:
    """``plan`` (a rank's local plan as the coordinator received it) with the items and
    planner data of ``own`` (the coordinator's local plan) where they are equal."""
    if plan.items is own.items or not _same_items(plan.items, own.items):
        return plan
    data = own.planner_data if plan.planner_data == own.planner_data else plan.planner_data
    return dataclasses.replace(plan, items=own.items, planner_data=data)


class TieredSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose global planning (coordinator only) checks grid-sharded
    tensors in linear time and pauses the garbage collector, and which reuses its local plan
    for a state of the same structure. Takes ``DefaultSavePlanner``'s arguments, and
    ``cache_key``: a name for this planner's plan caches (one per writer)."""

    def __init__(self, *args: Any, cache_key: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if cache_key is not None:
            self._cached_plans_key = f"{type(self).__name__}:{cache_key}"

    # DCP passes storage_meta only to a signature that names it (else positionally without)
    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        with _gc.paused():  # DCP flattens the state: objects per item, none in cycles
            found = flatten.flatten(state_dict) if self._flattens_both() else None
            if found is None:
                super().set_up_planner(state_dict, storage_meta, is_coordinator)
                return
            self.flatten_state_dict = self.flatten_sharded_tensors = False
            try:  # DCP's own set-up of the state flattened in one pass (policy.flatten)
                super().set_up_planner(found[0], storage_meta, is_coordinator)
            finally:
                self.flatten_state_dict = self.flatten_sharded_tensors = True
            self.mappings = found[1]

    def _flattens_both(self) -> bool:
        return bool(self.flatten_state_dict and self.flatten_sharded_tensors)

    def create_local_plan(self) -> SavePlan:
        with _gc.paused():  # objects per item (the structure, a new plan), none in cycles
            return self._local_plan()

    def _local_plan(self) -> SavePlan:
        shape = _structure(self.state_dict, self.is_coordinator)
        kept = _LOCAL_PLANS.get(self._cached_plans_key)
        if (
            shape is not None
            and kept is not None
            and kept[0] == shape
            and (not self.flatten_state_dict or kept[1] == self.mappings)
        ):
            plan = self.plan = kept[2]
            if self._enable_plan_caching:
                if _torch_compat.cached_local_plan(self._cached_plans_key) is plan:
                    return SavePlan([], usable=False)  # unchanged: DCP replays its cache
                self._pending_local_plan = plan  # promoted by finish_plan, as DCP does
            return plan
        plan = super().create_local_plan()
        if shape is not None:
            _LOCAL_PLANS[self._cached_plans_key] = (shape, self.mappings, self.plan)
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        with _gc.paused():
            own = getattr(self, "plan", None)
            if own is not None:
                all_plans = [_sharing(p, own) for p in all_plans]
            plans, metadata = super().create_global_plan(all_plans)
        metadata_broadcast.forget(metadata)  # a cached one still holds the last save's bytes
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        with _gc.paused():
            return super().finish_plan(self._sharing_final(new_plan))

    def _sharing_final(self, plan: SavePlan) -> SavePlan:
        """``plan`` (this rank's final plan, as DCP's scatter unpickled it) built from objects
        this planner already holds where they are equal: the coordinator's global plan for
        this rank, else the local plan's tensor data (only the index hints differ)."""
        if not getattr(plan, "usable", True) or not plan.items:
            return plan  # DCP replays its cached final plan
        for planned in getattr(self, "global_plan", None) or ():  # the coordinator's
            if planned.items is plan.items or _same_items(planned.items, plan.items):
                return dataclasses.replace(plan, items=planned.items)
        own = getattr(self, "plan", None)
        if own is None:
            return plan
        data = {(i.index.fqn, i.index.offset): i.tensor_data for i in own.items}
        items = []
        for item in plan.items:
            known = data.get((item.index.fqn, item.index.offset))
            if known is not None and known is not item.tensor_data and known == item.tensor_data:
                item = dataclasses.replace(item, tensor_data=known)
            items.append(item)
        return dataclasses.replace(plan, items=items)

    def resolve_data(self, write_item: WriteItem) -> Any:
        """DCP's, with a plain tensor saved whole taken straight from the flat state: DCP's
        lookup checks each item for DTensor and ShardedTensor shards on the way (20,000
        tensors: 0.2 s of the writer's time, profiled). A subclass that changes the lookup or
        the transform, and every other item, goes DCP's way."""
        if write_item.type is WriteItemType.TENSOR and _default_lookup(type(self)):
            found: Any = self.state_dict.get(write_item.index.fqn)
            kind = type(found)
            if kind is torch.Tensor or kind is torch.nn.Parameter:
                offset = write_item.index.offset
                if offset is None or (len(offset) == found.dim() and not any(offset)):
                    return found  # what DCP's find_tensor_shard returns for it
        return super().resolve_data(write_item)

    def resolve_items(self, items: Sequence[WriteItem]) -> list[Any]:
        """:meth:`resolve_data` of each of ``items``, in order: the plain tensors saved whole
        looked up and checked by columns (a data file's thousands of items; 20,000 tensors:
        0.1 s of the writer's time item by item, profiled), the other items item by item;
        every item by :meth:`resolve_data` where a column check fails (its errors)."""
        if _default_lookup(type(self)):
            at, fqns, dims, rest = _whole_tensor_keys(items)
            found: list[Any] = list(map(self.state_dict.get, fqns))
            if (
                set(map(type, found)) <= PLAIN_TENSORS
                and list(map(torch.Tensor.dim, found)) == dims
            ):
                if not rest:
                    return found  # what resolve_data gives each of them
                out: list[Any] = [None] * len(items)
                for k, value in zip(at, found):
                    out[k] = value
                for k in rest:
                    out[k] = self.resolve_data(items[k])
                return out
        return [self.resolve_data(item) for item in items]

    # DefaultSavePlanner's own steps (torch 2.13-2.15: dedup, global plan, planner data),
    # but for the check. Both the uncached and the plan-caching paths call this.
    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        global_plan, metadata = create_default_global_save_plan(self._dedup_save_plans(all_plans))
        if self.flatten_state_dict:
            merged = dict(ChainMap(*[p.planner_data for p in global_plan]))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        errors = plan_errors(metadata, len(global_plan))
        if errors:
            summary = "; ".join(errors)
            if len(summary) > 500:
                summary = summary[:500] + "... (truncated)"
            raise ValueError(f"Failed to validate global plan: {summary}")
        # what dcp.save broadcasts at the end of each save: see metadata_broadcast
        return global_plan, metadata_broadcast.broadcastable(metadata)


# The last item lists' keys, by id (the list is held: its id stays its own). DCP's plan
# caching hands every save of one structure the same lists; each writer thread has its own.
_Keys = tuple[list[int], list[str], list[int], list[int]]
_KEYS: OrderedDict[int, tuple[Sequence[WriteItem], _Keys]] = OrderedDict()
_KEYS_KEPT = 16
_keys_lock = threading.Lock()


def _whole_tensor_keys(items: Sequence[WriteItem]) -> _Keys:
    """The positions of the items that are whole tensors' (a tensor item at offset zero:
    ``resolve_data`` returns the plain tensor of that many dimensions at its fqn as it is),
    their fqns and numbers of dimensions, and the positions of every other item."""
    with _keys_lock:
        kept = _KEYS.get(id(items))
        if kept is not None and kept[0] is items:
            _KEYS.move_to_end(id(items))
            return kept[1]
    at: list[int] = []
    rest: list[int] = []
    for k, item in enumerate(items):
        offset = item.index.offset
        whole = item.type is WriteItemType.TENSOR and offset is not None and not any(offset)
        (at if whole else rest).append(k)
    keys = (
        at,
        [items[k].index.fqn for k in at],
        [len(items[k].index.offset or ()) for k in at],
        rest,
    )
    with _keys_lock:
        _KEYS[id(items)] = (items, keys)
        while len(_KEYS) > _KEYS_KEPT:
            _KEYS.popitem(last=False)
    return keys


@functools.cache
def _default_lookup(kind: type) -> bool:
    """Whether planner class ``kind`` finds and transforms items as DCP's default does (asked
    once per item: kept per class)."""
    return (
        kind.lookup_object is DefaultSavePlanner.lookup_object  # type: ignore[attr-defined]
        and kind.transform_object is DefaultSavePlanner.transform_object  # type: ignore[attr-defined]
        and kind.resolve_data is TieredSavePlanner.resolve_data  # type: ignore[attr-defined]
    )


def planner_for(writer: Any) -> TieredSavePlanner:
    """The planner the manager and the adapters save with: DCP's plan caching on, its caches
    this writer's own. A repeated save of the same structure then skips planning (DCP checks
    every rank's plan for changes and re-plans when one did); the writer commits each save
    as its own step all the same (tests/test_plan_caching.py)."""
    key = getattr(writer, "_plan_key", None) or f"{writer.root}@{id(writer)}"
    return TieredSavePlanner(enable_plan_caching=True, cache_key=key)
