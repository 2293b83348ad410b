"""``dist_checkpointing.load`` through the tiers, the same on megatron-core 0.16 to 0.19::

    from dcp_tiered.shims import megatron_load
    state = megatron_load.load(model.sharded_state_dict(), "ckpt/iter_0000100",
                               remote="s3://bucket/run-1")          # on every rank

mcore's own ``dist_checkpointing.load`` reads the checkpoint's common (non-sharded) state
itself, from the local directory: ``common.pt`` with torch's ``weights_only`` loader, or, from
0.19 on, mcore's own ``FileSystemReader`` on the directory's DCP files. This does what it does,
in the same order, with the common state read through :class:`TieredStorageReader` as well as
the shards (through :class:`TieredLoadShardedStrategy`): from the nearest tier holding a valid
copy, every byte verified, so a step held only by the remote tier or by another node's root
loads; and ``allow_pickle`` applies to the common state on every release (from 0.17 on,
``dist_checkpointing.load`` takes no other loader for it). Nothing is written to the directory.
"""

from __future__ import annotations

import os
from typing import Any

from ...reader import TieredStorageReader
from .strategy import TieredLoadShardedStrategy, split_dir  # megatron-core's ImportError

# isort: split
from megatron.core.dist_checkpointing.dict_utils import merge
from megatron.core.dist_checkpointing.mapping import apply_factory_merges
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
from megatron.core.dist_checkpointing.utils import (
    extract_sharded_base,
    force_all_tensors_to_non_fp8,
)

from . import compat as _mcore_compat


def load(
    sharded_state_dict: Any,
    checkpoint_dir: str | os.PathLike[str],
    *,
    remote: Any = None,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
    sharded_strategy: TieredLoadShardedStrategy | None = None,
) -> dict[str, Any]:
    """Collective: the state of ``checkpoint_dir`` (``root/step``) shaped by
    ``sharded_state_dict``, as ``dist_checkpointing.load`` returns it (with the default
    ``strict``). ``allow_pickle``: objects load with full pickle (checkpoints you trust)."""
    root, step = split_dir(checkpoint_dir)
    strategy = sharded_strategy or TieredLoadShardedStrategy(
        remote=remote, storage_options=storage_options, allow_pickle=allow_pickle
    )
    reader = TieredStorageReader(
        root, remote=remote, storage_options=storage_options, allow_pickle=allow_pickle
    )
    reader.reset(step)
    # A step saved with the strategy alone (not dist_checkpointing.save) has no common state.
    common = _mcore_compat.read_common_state(reader) or {}
    if not getattr(strategy, "stream_ckpt_dequant", False):  # as mcore's load (0.19: planner)
        force_all_tensors_to_non_fp8(sharded_state_dict)
    sharded, nonpersistent, factories = load_preprocess(sharded_state_dict)
    merge(common, nonpersistent)
    sharded, _ = extract_sharded_base(sharded)
    merge(common, strategy.load(sharded, os.path.abspath(os.fspath(checkpoint_dir))))
    return apply_factory_merges(common, factories)


__all__ = ["load"]
