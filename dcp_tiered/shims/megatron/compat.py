"""What differs between the megatron-core releases the Megatron shims support: 0.16 to 0.19.

The only module of the shims that asks which megatron-core it runs on; the rest use what it
exports. The differences that reach dcp_tiered:

- **0.17** removed ``TorchCommonLoadStrategy`` (``strategies/common.py`` keeps only the
  ``save_common``/``load_common`` functions) and ``dist_checkpointing.load``'s
  ``common_strategy`` hook (the argument stays, asserted to be None; 0.19 drops it): the
  common state is always read with torch's default loader, ``weights_only``.
- **0.17** passes a third argument, ``async_strategy``, to the load strategy's ``load`` and to
  the save strategy's ``async_save``.
- **0.19** no longer writes ``common.pt``: the common state is a ``ShardedObject`` named
  ``common_state`` inside the DCP checkpoint, and ``dist_checkpointing.load`` reads it with
  mcore's own ``FileSystemReader`` from the local directory, unless the directory holds a
  ``common.pt`` (read first, as the legacy format).

So the common state is read here, from either format, through the caller's reader (every tier,
every byte verified), and :func:`~dcp_tiered.shims.megatron.sidecars.write_sidecars` writes it
back as ``common.pt``, which every release reads.
"""

from __future__ import annotations

import importlib.metadata
import io
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from packaging.version import Version

from ...errors import ConfigError

try:
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies import common as _common
except ImportError as e:  # pragma: no cover - exercised only without megatron-core
    raise ImportError(
        "dcp_tiered.shims.megatron needs megatron-core: pip install 'dcp-tiered[megatron]'"
    ) from e

VERSION = Version(importlib.metadata.version("megatron-core"))

# megatron-core < 0.17 only: the common state's loader, which dist_checkpointing.load takes.
TorchCommonLoadStrategy: Any = getattr(_common, "TorchCommonLoadStrategy", None)
# Where megatron-core < 0.19 leaves the common state in a directory (rank 0 writes it there
# before the sharded save), and where every release looks for it first.
COMMON_NAME: str = _common.COMMON_STATE_FNAME
# How dcp_tiered carries a common.pt of mcore < 0.19 inside the step: one byte item, keyed the
# way mcore's metadata readers parse every byte item (<key>/shard_<offset>_<shape>).
CARRIED_COMMON_KEY = "dcp_tiered.common_pt/shard_0_1"
# How megatron-core >= 0.19 stores it: a ShardedObject whose bytes are torch.save([state]).
COMMON_STATE_KEY = ShardedObject("common_state", None, (1,), (0,)).unique_key


def read_common_state(reader: Any) -> dict[str, Any] | None:
    """The common (non-sharded) state of the step ``reader`` was reset to, from either format,
    read through ``reader``; None when the step holds none (not saved through
    ``dist_checkpointing.save``). Objects load as the reader allows (``weights_only`` unless it
    was built with ``allow_pickle``). Not collective."""
    present = reader.read_metadata().state_dict_metadata
    key = next((k for k in (CARRIED_COMMON_KEY, COMMON_STATE_KEY) if k in present), None)
    if key is None:
        return None
    out: dict[str, Any] = {key: io.BytesIO()}
    dcp.load(out, storage_reader=reader, no_dist=True)
    value = out[key]  # DCP's planner hands back the (vetted) value, not the bytes
    if isinstance(value, io.BytesIO):
        value.seek(0)
        value = torch.load(value, weights_only=not getattr(reader, "allow_pickle", False))
    return value if key == CARRIED_COMMON_KEY else value[0]


def common_load_strategy(allow_pickle: bool) -> Any:
    """``dist_checkpointing.load``'s ``common_strategy`` for megatron-core < 0.17 (None: mcore's
    default). From 0.17 on, mcore reads the common state with ``weights_only`` and takes no
    other loader: None without ``allow_pickle``, ConfigError with it (pass nothing to
    ``dist_checkpointing.load`` there: 0.19 refuses the argument)."""
    if not allow_pickle:
        return None
    if TorchCommonLoadStrategy is None:
        raise ConfigError(
            f"megatron-core {VERSION} reads a checkpoint's common state with weights_only and "
            "has no hook for another loader (dist_checkpointing.load's common_strategy is gone "
            "since 0.17), so objects there cannot be loaded trusted through it. Load with "
            "dcp_tiered.shims.megatron.load.load(..., allow_pickle=True) instead (the Megatron "
            "facade does): it reads the common state through dcp_tiered's reader."
        )
    return _TrustedCommonLoad()


if TorchCommonLoadStrategy is not None:

    class _TrustedCommonLoad(TorchCommonLoadStrategy):
        """mcore's ``common.pt`` loader with full pickle (mcore's own uses torch's default,
        ``weights_only``): only for checkpoints the caller trusts (``allow_pickle=True``)."""

        def load_common(self, checkpoint_dir: str | os.PathLike[str]) -> Any:
            return torch.load(
                os.path.join(checkpoint_dir, COMMON_NAME), map_location="cpu", weights_only=False
            )
