"""Process-group helper for async saves."""

from __future__ import annotations

import datetime

import torch.distributed as dist

_GROUPS: dict[int, dist.ProcessGroup] = {}


def checkpoint_process_group(timeout_secs: float = 1800.0) -> dist.ProcessGroup | None:
    """A dedicated gloo group for checkpoint collectives (created once, on every rank).

    Pass it as ``dcp.async_save(..., process_group=checkpoint_process_group())``. DCP runs an
    async save's collectives from a background thread; on the training group they interleave
    with training collectives and gloo aborts or hangs (see dcp-cpu-findings). Must be called
    by every rank in the same order, like any group creation. Returns None without a
    default process group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    key = id(dist.group.WORLD)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_secs)
        )
    return _GROUPS[key]
