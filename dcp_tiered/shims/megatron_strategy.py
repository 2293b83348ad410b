"""The megatron-core strategies' former path: they live in
:mod:`dcp_tiered.shims.megatron.strategy`, mcore's sidecar files in
:mod:`dcp_tiered.shims.megatron.sidecars`."""

from __future__ import annotations

from ..lifecycle.roots import write_file_atomically as replace_file  # exported here before
from .megatron.sidecars import claim_step_dir, remove_sidecars, write_sidecars
from .megatron.strategy import (
    TieredLoadShardedStrategy,
    TieredSaveShardedStrategy,
    common_load_strategy,
    split_dir,
)

__all__ = [
    "TieredLoadShardedStrategy",
    "TieredSaveShardedStrategy",
    "claim_step_dir",
    "common_load_strategy",
    "remove_sidecars",
    "replace_file",
    "split_dir",
    "write_sidecars",
]
