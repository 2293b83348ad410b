"""DCP's default load planner, without its per-item planning where there is nothing to plan.

When every requested value is a plain tensor saved whole, in one chunk of the same size (the
same ranks and sharding as the save, or no sharding at all), or a non-tensor value, each read
item is the whole saved item into the whole target: ``TieredLoadPlanner`` writes those items
directly instead of running DCP's chunk-overlap search per tensor. Anything else (DTensors,
ShardedTensors, chunks that differ: resharding) is planned by ``DefaultLoadPlanner`` as
before, with its checks and errors. The read items are the ones DCP would make.

CheckpointManager and the lifecycle restore with it; with ``dcp.load`` pass it yourself::

    dcp.load(state, storage_reader=reader, planner=TieredLoadPlanner())
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from . import _gc

_ZERO = torch.Size((0,))
_KEPT_HERE = "dcp_tiered:whole-reads-kept-on-this-rank"


class TieredLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that plans whole-tensor reads directly. Takes its arguments."""

    _kept: LoadPlan | None = None  # this rank's whole reads, while an empty plan travels

    def create_local_plan(self) -> LoadPlan:
        with _gc.paused():  # one object per item, none in cycles: see _gc
            items = self._whole_items()
        if items is None:
            self._kept = None
            return super().create_local_plan()
        # DCP sends every rank's plan to the coordinator and back (pickled both ways), for a
        # global step that changes nothing in a default load: these whole reads stay here,
        # and an empty plan that says so travels instead.
        self._kept = LoadPlan(items)
        return LoadPlan([], planner_data=_KEPT_HERE)

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        kept = getattr(self, "_kept", None)
        if new_plan.planner_data == _KEPT_HERE and not new_plan.items and kept is not None:
            return super().finish_plan(kept)
        return super().finish_plan(new_plan)

    def _whole_items(self) -> list[ReadItem] | None:
        """One whole read per value, or None where DCP has to plan (see the module)."""
        if self.metadata is None:
            return None
        saved = self.metadata.state_dict_metadata
        items = []
        for fqn, obj in self.state_dict.items():
            md = saved.get(fqn)
            if isinstance(md, BytesStorageMetadata) and not isinstance(obj, torch.Tensor):
                index = MetadataIndex(fqn)
                items.append(ReadItem(LoadItemType.BYTE_IO, index, _ZERO, index, _ZERO, _ZERO))
                continue
            kind = type(obj)
            if (
                not isinstance(md, TensorStorageMetadata)
                or not (kind is torch.Tensor or kind is torch.nn.Parameter)
                or len(md.chunks) != 1
                or md.size != obj.size()
                or md.chunks[0].sizes != md.size
                or any(md.chunks[0].offsets)
            ):
                return None
            offsets = md.chunks[0].offsets
            index = MetadataIndex(fqn, offsets, 0)  # where it goes and where it comes from
            items.append(ReadItem(LoadItemType.TENSOR, index, offsets, index, offsets, md.size))
        return items
