"""The process groups of the checkpoint layer: made once per process, destroyed at exit."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os

import torch.distributed as dist

from ._torch_compat import global_rank

_GROUPS: dict[tuple[str, int, float], dist.ProcessGroup] = {}


def checkpoint_process_group(timeout_secs: float = 1800.0) -> dist.ProcessGroup | None:
    """A dedicated gloo group for checkpoint collectives (created once, on every rank).

    Pass it as ``dcp.async_save(..., process_group=checkpoint_process_group())``. DCP runs an
    async save's collectives from a background thread; on the training group they interleave
    with training collectives and gloo aborts or hangs (see dcp-cpu-findings). Must be called
    by every rank in the same order, like any group creation. Returns None without a
    default process group.
    """
    return _group("save", timeout_secs)


def agreement_group(timeout_secs: float = 1800.0) -> dist.ProcessGroup | None:
    """The gloo group the lifecycle's votes run on (see :mod:`dcp_tiered.agreement`): apart
    from the training group and from the one background saves use. Same rules as above."""
    return _group("agreement", timeout_secs)


def replication_group(timeout_secs: float = 1800.0) -> dist.ProcessGroup | None:
    """The gloo group peer replication sends snapshots on, from a background thread of its
    own: apart from every other group, so its rounds never interleave with theirs."""
    return _group("replication", timeout_secs)


def is_job_leader() -> bool:
    """Global rank 0, or the only process."""
    return global_rank() == 0


def is_node_leader() -> bool:
    """Whether this process writes its node's node-wide files: ``LOCAL_RANK`` 0 (as torchrun
    sets it), else global rank 0 (without torchrun, a node is one process or the whole job)."""
    return int(os.environ.get("LOCAL_RANK", global_rank())) == 0


def _group(purpose: str, timeout_secs: float) -> dist.ProcessGroup | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    key = (purpose, id(dist.group.WORLD), timeout_secs)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_secs)
        )
    return _GROUPS[key]


@atexit.register
def _destroy_groups() -> None:
    """Our groups go before the interpreter tears down: a gloo group left to the C++ exit path
    can abort a finished job ("terminate called without an active exception")."""
    groups = list(_GROUPS.values())
    _GROUPS.clear()
    if not (dist.is_available() and dist.is_initialized()):
        return
    for group in groups:
        with contextlib.suppress(Exception):  # already destroyed with the default group
            dist.destroy_process_group(group)
