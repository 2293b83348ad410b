"""The only module that imports private torch symbols; each use says why."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

# DCP's own CPU-copy helpers understand DTensor and ShardedTensor; re-implementing their
# reconstruction logic would drift with torch.
from torch.distributed._state_dict_utils import (  # noqa: F401
    _copy_state_dict as copy_state_dict,
    _create_cpu_state_dict as create_cpu_state_dict,
)

# Written into `.metadata` so that a vanilla FileSystemReader can read our steps.
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo  # noqa: F401


def default_store() -> Any | None:
    """The c10d store of the default process group (None without one).

    Used for the cross-node commit handshake: store operations never interleave with the
    collectives DCP runs on its process group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()
