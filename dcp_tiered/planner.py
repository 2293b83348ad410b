"""DCP's default planners: the save planner with the coordinator's global planning made
cheaper at scale, and the load planner with typed errors for a state that does not fit.

``TieredSavePlanner`` is ``DefaultSavePlanner`` (same plans, same metadata, the same errors,
plan caching with ``enable_plan_caching=True``) with two changes on the coordinator:

- the global plan's check is :func:`dcp_tiered.policy.chunk_grid.plan_errors`: one pass per
  tensor for grid-sharded tensors (FSDP, TP, both), where DCP's compares N²/2 chunk pairs for
  every tensor whose longest dimension is not the sharded one;
- the global planning runs with cyclic garbage collection paused (:mod:`dcp_tiered._gc`).

CheckpointManager and the DeepSpeed and HF adapters use it (Megatron plans with MCore's
planner); with ``dcp.save``/``dcp.async_save`` pass it yourself::

    dcp.save(state, checkpoint_id="step-100", storage_writer=writer,
             planner=TieredSavePlanner())
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap
from typing import Any

from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan

from . import _gc
from .errors import ConfigError, DcpTieredError, ManifestError
from .policy.chunk_grid import plan_errors


class TieredSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose global planning (coordinator only) checks grid-sharded
    tensors in linear time and pauses the garbage collector. Takes ``DefaultSavePlanner``'s
    arguments."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        with _gc.paused():
            return super().create_global_plan(all_plans)

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
        return global_plan, metadata


class TieredLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` (same arguments) that explains a size mismatch between the state
    and the step. DCP's planner compares the state's tensors with the manifest's shapes and
    raises a bare ValueError; given the ``reader`` of the load, this one reads the stored
    chunk of the first tensor that differs and raises ManifestError when the manifest
    misstates what its bytes hold (an edited, resealed manifest), else ConfigError (the state
    is not the model that was saved). Both are ValueErrors, as DCP's own is::

        reader = TieredStorageReader(root)
        dcp.load(state, checkpoint_id="step-100", storage_reader=reader,
                 planner=TieredLoadPlanner(reader=reader))
    """

    def __init__(self, *args: Any, reader: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reader = reader

    def create_local_plan(self) -> LoadPlan:
        try:
            return super().create_local_plan()
        except ValueError as e:
            if self._reader is None or "Size mismatch" not in str(e):
                raise
            raise self._explained() or e from e

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
