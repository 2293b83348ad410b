"""The state Megatron-LM saves (``generate_state_dict``'s layout) and its names: the
iteration directories and the tracker file that names the newest one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from ...lifecycle.roots import MEGATRON

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0


def iteration_dir(iteration: int) -> str:
    """Megatron-LM's directory name for an iteration."""
    return MEGATRON.build(iteration)


def state_dict(
    iteration: int,
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    *,
    is_loading: bool = False,
) -> dict[str, Any]:
    """Megatron-LM's ``generate_state_dict`` layout, as a sharded state dict."""
    chunks = list(model) if isinstance(model, Sequence) else [model]
    state: dict[str, Any] = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    if len(chunks) == 1:
        state["model"] = chunks[0].sharded_state_dict()
    else:
        for i, chunk in enumerate(chunks):
            state[f"model{i}"] = chunk.sharded_state_dict()
    if optimizer is not None:
        model_state = {k: v for k, v in state.items() if k.startswith("model")}
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading)
    if opt_param_scheduler is not None:
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    return state


def apply_state(
    loaded: dict[str, Any],
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    *,
    strict: bool = True,
) -> None:
    chunks = list(model) if isinstance(model, Sequence) else [model]
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"], strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if opt_param_scheduler is not None and "opt_param_scheduler" in loaded:
        opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])


def uid(sh: ShardedTensor) -> str:
    return f"{sh.key}/{sh.global_offset}/{sh.flattened_range}"


def local_parts(sharded: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors and objects, by a key naming the shard (same on save and load)."""
    tensors, objects = {}, {}
    for sh in nested_values(sharded):
        if isinstance(sh, ShardedTensor):
            tensors[uid(sh)] = sh.data
        elif isinstance(sh, ShardedObject):
            objects[sh.unique_key] = sh.data
    return tensors, objects
