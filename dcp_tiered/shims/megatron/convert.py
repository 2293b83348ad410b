"""``dcp-tiered convert megatron``: a legacy Megatron-LM checkpoint as a ``torch_dist`` one.

Input: Megatron-LM's ``--ckpt-format torch`` layout::

    SRC/latest_checkpointed_iteration.txt            the iteration (or "release")
    SRC/iter_0000100/mp_rank_00/model_optim_rng.pt   one file per tensor-parallel rank
    SRC/iter_0000100/mp_rank_01/model_optim_rng.pt

Output: ``DST/iter_0000100``, a ``torch_dist`` checkpoint written through
:class:`TieredSaveShardedStrategy`, in exactly the layout ``GPTModel.sharded_state_dict()``
gives, so stock ``dist_checkpointing.load`` reads it into a model at any tensor-parallel size:

- Tensor-parallel shards are concatenated back into whole tensors, along the dimension
  Megatron's layers split: column-parallel layers (``linear_qkv``, ``linear_fc1``, the word
  embeddings and the output layer) on dim 0, row-parallel weights (``linear_proj``,
  ``linear_fc2``) on dim 1; everything else is replicated and must agree across ranks.
- Per-layer keys ``decoder.layers.<i>.<name>`` become one tensor ``decoder.layers.<name>``
  with a leading layer axis, as ``torch_dist`` stacks them, and the layer norms of mcore's
  local spec take the Transformer Engine names its ``sharded_state_dict`` maps them to.
  Stacked, a checkpoint's keys do not depend on the layer count per pipeline stage, and it
  loads through the same mcore code path as checkpoints Megatron itself saves; per-layer keys
  would load into nothing.
- ``iteration``, ``checkpoint_version`` and ``opt_param_scheduler`` are carried over, and
  ``DST/latest_checkpointed_iteration.txt`` names the result (written atomically, last).
  Optimizer state is not: the legacy files key it by parameter position, and the distributed
  optimizer keeps it in ``distrib_optim.pt`` buffers; resume it from a ``torch_dist`` save.

Input files are opened with torch's ``weights_only`` loader (plus ``argparse.Namespace``, for
Megatron's ``args``); a file needing anything else is refused unless the source is trusted.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from ...errors import CheckpointExistsError, CheckpointNotFoundError, ConfigError, IntegrityError
from ...lifecycle.roots import local_tier, write_file_atomically
from .state import TRACKER, iteration_dir
from .strategy import TieredSaveShardedStrategy

FILE_NAME = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_LAYER = re.compile(r"^(.*\.layers)\.(\d+)\.(.+)$")
_COLUMN = (
    "linear_qkv.weight",
    "linear_qkv.bias",
    "linear_fc1.weight",
    "linear_fc1.bias",
    "word_embeddings.weight",
    "output_layer.weight",
)
_ROW = ("linear_proj.weight", "linear_fc2.weight")
# mcore's local layer spec names its layer norms apart; its sharded_state_dict_keys_map saves
# them under the Transformer Engine names (fused into the next linear), and so do we.
_TE_NAMES = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)


def convert(
    src: str,
    dst: str,
    *,
    iteration: int | None = None,
    trust_source: bool = False,
    overwrite: bool = False,
) -> str:
    """Converts ``iteration`` (default: the tracker's) of ``src`` into ``dst``; returns the
    directory written."""
    name = _iteration_name(src, iteration)
    files = _rank_files(os.path.join(src, name))
    if local_tier(dst).has_step(name) and not overwrite:
        raise CheckpointExistsError(
            f"{os.path.join(dst, name)} already exists; choose another "
            "destination or pass --overwrite"
        )
    states = [_load(path, trust_source) for path in files]
    args = states[0].get("args")
    if len(files) > 1 and (
        getattr(args, "swiglu", False) or getattr(args, "gated_linear_unit", False)
    ):
        raise ConfigError(
            f"{src}: gated MLPs (swiglu) interleave linear_fc1's tensor-parallel "
            "halves; merging them is not supported yet"
        )
    model = _stack_layers(_merge_tensor_parallel([s["model"] for s in states], files))
    common: dict[str, Any] = {
        k: states[0][k]
        for k in ("iteration", "checkpoint_version", "opt_param_scheduler")
        if k in states[0]
    }
    return _write(dst, name, model, common)


def _iteration_name(src: str, iteration: int | None) -> str:
    if iteration is not None:
        return iteration_dir(iteration)
    tracker = os.path.join(src, TRACKER)
    try:
        with open(tracker) as f:
            value = f.read().strip()
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{tracker} does not exist: is {src} a Megatron-LM save directory? Pass "
            "--iteration N to convert iter_N without it."
        ) from None
    if value == "release":
        return "release"
    if not value.isdigit():
        raise IntegrityError(f"{tracker} holds {value!r}, not an iteration number")
    return iteration_dir(int(value))


def _rank_files(iter_dir: str) -> list[str]:
    """Tensor-parallel ranks' files, in rank order; pipeline and expert parallelism refused."""
    if not os.path.isdir(iter_dir):
        raise CheckpointNotFoundError(f"{iter_dir} does not exist")
    ranks = {}
    for entry in os.listdir(iter_dir):
        m = _RANK_DIR.match(entry)
        if m is None:
            continue
        if m.group(2) is not None or m.group(3) is not None:
            raise ConfigError(
                f"{iter_dir}/{entry}: pipeline- or expert-parallel checkpoints "
                "are not supported yet (only tensor-parallel mp_rank_XX)"
            )
        ranks[int(m.group(1))] = os.path.join(iter_dir, entry, FILE_NAME)
    if not ranks or sorted(ranks) != list(range(len(ranks))):
        raise CheckpointNotFoundError(
            f"{iter_dir} holds no complete set of mp_rank_XX/{FILE_NAME} (found ranks "
            f"{sorted(ranks)})"
        )
    return [ranks[r] for r in range(len(ranks))]


def _load(path: str, trust_source: bool) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"{path} does not exist")
    if trust_source:
        return torch.load(path, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise IntegrityError(
            f"{path} holds objects the weights_only loader refuses ({e}). If you trust this "
            "checkpoint, pass --trust-source (it is then unpickled without restriction)."
        ) from e


def _merge_tensor_parallel(models: list[dict[str, Any]], files: list[str]) -> dict[str, Any]:
    merged = {}
    for key, first in models[0].items():
        if not isinstance(first, torch.Tensor):
            if key.endswith("._extra_state") and _LAYER.match(key):
                merged[key] = first  # per layer, replicated across tensor-parallel ranks
            continue
        shards = [s for m in models if isinstance(s := m.get(key), torch.Tensor)]
        if len(shards) != len(models):
            raise IntegrityError(f"{key} is missing from some of {files}")
        dim = 0 if key.endswith(_COLUMN) else 1 if key.endswith(_ROW) else None
        if dim is None or len(shards) == 1:
            if any(not torch.equal(s, first) for s in shards[1:]):
                raise IntegrityError(
                    f"{key} should be replicated across tensor-parallel ranks "
                    "but differs between them"
                )
            merged[key] = first
        else:
            merged[key] = torch.cat(shards, dim=dim)
    return merged


def _stack_layers(model: dict[str, Any]) -> dict[str, Any]:
    """Layer tensors stacked into ShardedTensors, layer ``_extra_state`` values as one
    ShardedObject per layer (how ``torch_dist`` saves them)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    layers: dict[str, dict[int, Any]] = defaultdict(dict)
    out: dict[str, Any] = {}
    for key, tensor in model.items():
        m = _LAYER.match(key)
        if m is None:
            out[key] = ShardedTensor.from_rank_offsets(key, tensor)
        else:
            name = m.group(3)
            for local, te in _TE_NAMES:
                if name.startswith(local):
                    name = te + name[len(local) :]
            layers[f"{m.group(1)}.{name}"][int(m.group(2))] = tensor
    for key, by_index in layers.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise IntegrityError(f"{key}: layers {sorted(by_index)} are not 0..N-1")
        n = len(by_index)
        if key.endswith("._extra_state"):
            for i in range(n):
                out[f"{key}.{i}"] = ShardedObject(key, by_index[i], (n,), (i,), replica_id=0)
        else:
            out[key] = ShardedTensor.from_rank_offsets(
                key, torch.stack([by_index[i] for i in range(n)])
            )
    return out


def _write(dst: str, name: str, model: dict[str, Any], common: dict[str, Any]) -> str:
    from megatron.core import dist_checkpointing

    state = {**common, "model": model}
    step_dir = os.path.join(dst, name)
    with tempfile.TemporaryDirectory(prefix="dcp-tiered-convert-") as rendezvous:
        owns_group = not dist.is_initialized()
        if owns_group:  # mcore's save wants a process group: this process alone
            dist.init_process_group(
                "gloo", init_method=f"file://{rendezvous}/store", rank=0, world_size=1
            )
        try:
            os.makedirs(step_dir, exist_ok=True)
            strategy = TieredSaveShardedStrategy()
            dist_checkpointing.save(state, step_dir, sharded_strategy=strategy)
            strategy.close()
            tracked = name if name == "release" else str(int(name.removeprefix("iter_")))
            write_file_atomically(os.path.join(dst, TRACKER), tracked.encode())
        finally:
            if owns_group:
                dist.destroy_process_group()
    return step_dir
