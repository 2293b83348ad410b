"""DCP's default save planner, with the coordinator's global planning made cheaper at scale.

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

from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from . import _gc
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
