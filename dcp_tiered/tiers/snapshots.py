"""Memory snapshots at a restore, with or without peer replication: which steps every rank can
load from memory, loading one, and the warning about newer steps lost with their node.

CheckpointManager and the Megatron facade both restore through these, so both agree on the
same step the same way: with replication, :meth:`Replicator.survey` (collective) first, then
a step is a memory candidate when every rank can get it from its own memory or a partner's
copy, and a rank without its own copy fetches and verifies a partner's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..errors import DcpTieredError
from ..policy import step_names
from ..policy.replication import describe_lost
from .memory import MemoryTier
from .replica import Replicator

logger = logging.getLogger(__name__)


def candidates(memory: MemoryTier | None, replica: Replicator | None) -> dict[str, int]:
    """Step name -> commit time (ns; 0 for surveyed steps) of the memory steps to try. With
    replication, the steps of the last survey that every rank can get whole; else this rank's
    own snapshots (the ranks agree on each step as they load it)."""
    if replica is not None and replica.survey_ is not None:
        return dict.fromkeys(replica.survey_.whole(), 0)
    return memory.steps() if memory is not None else {}


def load(
    memory: MemoryTier, replica: Replicator | None, name: str, state: dict[str, Any]
) -> str | None:
    """Load this rank's snapshot of ``name`` into ``state``; None, or why it failed. With
    replication it is collective: every rank calls it for the same step, and a rank whose own
    copy is missing or fails verification takes a partner's."""
    if replica is not None:
        return replica.load(name, state)
    try:
        memory.load(name, state)
    except (DcpTieredError, OSError) as e:
        return f"rank {memory.rank}: {type(e).__name__}: {e}"
    return None


def report_lost(
    replica: Replicator | None,
    restored: int,
    what: str | None,
    *,
    rank: int,
    emit: Callable[..., Any],
) -> None:
    """Warn (rank 0) about steps newer than ``restored`` that some rank had no copy of in any
    memory (its node and partners lost together): which steps, whose, and what was restored
    instead (``what``; None: nothing). Emits a ``lost`` event."""
    survey = replica.survey_ if replica is not None else None
    lost = survey.lost(restored) if survey is not None else {}
    if not lost or survey is None or rank != 0:
        return
    message = describe_lost(survey, lost, what)
    logger.warning("%s", message)
    emit(
        "lost",
        steps=sorted(lost, key=lambda s: step_names.order_number(s) or -1),
        ranks=sorted({r for ranks in lost.values() for r in ranks}),
        restored=what,
        reason=message,
    )
