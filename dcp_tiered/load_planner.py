"""DCP's default load planner, without its per-item planning where there is nothing to plan.

When every requested value is a plain tensor saved whole, in one chunk of the same size (the
same ranks and sharding as the save, or no sharding at all), or a non-tensor value, each read
item is the whole saved item into the whole target: ``TieredLoadPlanner`` writes those items
directly instead of running DCP's chunk-overlap search per tensor. Anything else (DTensors,
ShardedTensors, chunks that differ: resharding) is planned by ``DefaultLoadPlanner`` as
before, with its checks and errors. The read items are the ones DCP would make.

Given the ``reader`` of the load, it also explains a size mismatch between the state and the
step: DCP's planner raises a bare ValueError; this one reads the stored chunk of the first
tensor that differs and raises ManifestError when the manifest misstates what its bytes hold
(an edited, resealed manifest), else ConfigError (the state is not the model that was saved).
Both are ValueErrors, as DCP's own is.

With a :class:`~dcp_tiered.reader.TieredStorageReader` (it offers the metadata it returned:
:mod:`dcp_tiered.whole_reads`), a whole tensor whose stored bytes can be copied straight into
its target gets no read item at all: the reader reads it from the manifest's columns. Any
other reader gets every read item.

CheckpointManager and the lifecycle restore with it; with ``dcp.load`` pass it yourself::

    reader = TieredStorageReader(root)
    dcp.load(state, checkpoint_id="step-100", storage_reader=reader,
             planner=TieredLoadPlanner(reader=reader))
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    STATE_DICT_TYPE,
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from . import _gc, whole_reads
from .errors import ConfigError, DcpTieredError, ManifestError
from .policy import flatten

_ZERO = torch.Size((0,))
_KEPT_HERE = "dcp_tiered:whole-reads-kept-on-this-rank"


class TieredLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` (same arguments, and the load's ``reader``) that plans
    whole-tensor reads directly and explains size mismatches (see the module)."""

    _kept: LoadPlan | None = None  # this rank's whole reads, while an empty plan travels
    # fqn -> the target of a whole read that is a contiguous CPU tensor of the saved dtype:
    # the reader may copy the stored bytes straight into it (see whole_targets)
    _raw_targets: dict[str, torch.Tensor] | None = None
    # fqn -> such a target with no read item in the plan: the reader reads it by columns
    _column_targets: dict[str, torch.Tensor] | None = None

    def __init__(self, *args: Any, reader: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reader = reader

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        with _gc.paused():  # DCP flattens the state: objects per item, none in cycles
            if not (self.flatten_state_dict and self.flatten_sharded_tensors):
                super().set_up_planner(state_dict, metadata, is_coordinator)
                return
            # DCP's own set-up (it initialises meta tensors in place first), then the state
            # flattened in one pass (policy.flatten), or as DCP does where that gives up. A
            # state with no meta tensor (most) is not walked by DCP's set-up at all, which
            # would only copy its lists (20,000 tensors: 0.05 s of a restore): a value loaded
            # into a list goes into the state's own list, not a copy put in its place.
            for_load = flatten.flatten_for_load(state_dict)
            plain = for_load is not None and for_load[2]
            self.flatten_state_dict = self.flatten_sharded_tensors = False
            try:
                super().set_up_planner({} if plain else state_dict, metadata, is_coordinator)
            finally:
                self.flatten_state_dict = self.flatten_sharded_tensors = True
            found: tuple[dict[str, Any], dict[str, tuple[Any, ...]]] | None
            if plain:
                assert for_load is not None  # plain
                self.original_state_dict = state_dict
                found = for_load[0], for_load[1]
            else:
                found = flatten.flatten(getattr(self, "original_state_dict", state_dict))
            if found is None:  # DCP's whole set-up again: its state initialisation is idempotent
                super().set_up_planner(state_dict, metadata, is_coordinator)
                return
            self.state_dict, self.mappings = found

    def create_local_plan(self) -> LoadPlan:
        with _gc.paused():  # one object per item, none in cycles: see _gc
            items = self._whole_items()
        if items is None:
            self._kept = self._raw_targets = self._column_targets = None
            try:
                return super().create_local_plan()
            except ValueError as e:
                if self._reader is None or "Size mismatch" not in str(e):
                    raise
                raise self._explained() or e from e
            except RuntimeError as e:  # DCP's for a key of the state that the step lacks
                if "Missing key in checkpoint" not in str(e):
                    raise
                step = getattr(self._reader, "checkpoint_id", None)
                raise ConfigError(
                    f"{f'step {step!r}: ' if step else ''}{e} The state being loaded is not "
                    "the one saved (another model, or renamed modules): load it into a state "
                    "with the saved keys, or plan with allow_partial_load=True to load only "
                    "the keys the step has"
                ) from e
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
        """One whole read per value, or None where DCP has to plan (see the module). A
        target the stored bytes may be copied into as they are is one of the raw targets;
        with a reader that reads those from the manifest's columns (whole_reads), it gets
        no read item at all."""
        if self.metadata is None:
            return None
        by_columns = whole_reads.reader_of(self.metadata) is not None
        saved = self.metadata.state_dict_metadata
        items = []
        raw: dict[str, torch.Tensor] = {}
        self._raw_targets = self._column_targets = None
        tensor, parameter, strided = torch.Tensor, torch.nn.Parameter, torch.strided
        zeros = None  # the last chunk offsets found all zero (the index shares them)
        for fqn, obj in self.state_dict.items():
            md = saved.get(fqn)
            if type(md) is not TensorStorageMetadata and not isinstance(md, TensorStorageMetadata):
                if isinstance(md, BytesStorageMetadata) and not isinstance(obj, torch.Tensor):
                    index = MetadataIndex(fqn)
                    items.append(ReadItem(LoadItemType.BYTE_IO, index, _ZERO, index, _ZERO, _ZERO))
                    continue
                return None
            kind = type(obj)
            chunks, size = md.chunks, md.size
            if not (kind is tensor or kind is parameter) or len(chunks) != 1:
                return None
            chunk = chunks[0]
            offsets = chunk.offsets
            if (
                size != obj.size()
                or (chunk.sizes is not size and chunk.sizes != size)
                or (offsets is not zeros and any(offsets))
            ):
                return None
            zeros = offsets
            if (
                obj.dtype == md.properties.dtype  # else copy_ converts, as DCP does
                and obj.is_cpu
                and obj.layout == strided
                and not obj.is_quantized
                and not obj.is_conj()  # bits that make its memory differ from its value
                and not obj.is_neg()
                and obj.is_contiguous()
            ):
                raw[fqn] = obj  # its memory: detached only for a commit_tensor of a subclass
                if by_columns:
                    continue
            index = MetadataIndex(fqn, offsets, 0)  # where it goes and where it comes from
            items.append(ReadItem(LoadItemType.TENSOR, index, offsets, index, offsets, size))
        if by_columns:
            self._column_targets = raw
        else:
            self._raw_targets = raw
        return items

    def column_targets(self) -> dict[str, torch.Tensor] | None:
        """The raw targets (see :meth:`whole_targets`) this plan has no read item for: the
        load's reader offered to read them from the manifest's columns (whole_reads), and
        must deliver every one of them."""
        return self._column_targets

    def whole_targets(self) -> dict[str, torch.Tensor] | None:
        """The targets of this plan's whole reads whose stored bytes may be copied into
        their memory as they are, by fqn: each a contiguous CPU tensor of the saved dtype and
        size, the state's own (a Parameter stays one). The reader still checks the stored
        bytes against the manifest, and calls commit_tensor with each, detached, only when a
        subclass overrides it (DCP's is a no-op, not worth 20,000 calls). None: resolve every
        item as DCP does."""
        return self._raw_targets

    def _explained(self) -> DcpTieredError | None:
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn) if self.metadata else None
            size = getattr(obj, "size", None)
            if not isinstance(md, TensorStorageMetadata) or size is None or md.size == size():
                continue
            step = getattr(self._reader, "checkpoint_id", None)
            try:
                stored = self._reader.stored_tensor(fqn)
            except DcpTieredError as e:
                return e
            if stored is None:  # a vanilla step: DCP's own error says it
                return None
            chunk = md.chunks[0].sizes
            if stored.size() != chunk:
                return ManifestError(
                    f"step {step!r}: the manifest says {fqn!r} is {list(md.size)} (a first "
                    f"chunk of {list(chunk)}), but its stored bytes hold "
                    f"{list(stored.size())}: the manifest does not match the data. Restore "
                    "the step from another tier or load another step."
                )
            return ConfigError(
                f"step {step!r} holds {fqn!r} as {list(md.size)}, the state being loaded has "
                f"{list(size())}: load it into a model of the shape that was saved"
            )
        return None
