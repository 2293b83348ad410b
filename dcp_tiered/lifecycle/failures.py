"""How a failed save is told: the entry point's conventions, one record per failure, the
advice, and the collective raise that names every rank's failures on every rank."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..agreement import Agreement
from ..errors import (
    CheckpointExistsError,
    ForeignPathError,
    InsufficientSpaceError,
    SaveFailedError,
    causes,
    describe,
)


@dataclass(frozen=True)
class Conventions:
    """How an entry point speaks to its users in errors.

    Args:
        framework: its name in messages ("DeepSpeed").
        overwrite_hint: how to allow replacing an existing step, in the framework's terms.
        kept: what still names the previous checkpoint after a failed save.
        local_tier: its name for the node's disk tier, in retention's log lines.
    """

    framework: str
    overwrite_hint: str = "pass overwrite=True to replace an existing step atomically"
    kept: str = "the previous checkpoint is intact"
    local_tier: str = "local"


def failure(
    rank: int, step: str, tier: str, where: str, error: BaseException | str
) -> dict[str, Any]:
    """One record of :attr:`SaveFailedError.failures`."""
    return {
        "rank": rank,
        "step": step,
        "tier": tier,
        "where": where,
        "error": error if isinstance(error, str) else describe(error),
    }


def advice(errors: list[BaseException], conventions: Conventions) -> str:
    """What to do about a failed save, in the entry point's own terms."""
    found = [c for e in errors for c in causes(e)]
    if any(isinstance(c, ForeignPathError) for c in found):
        return "move what is at that path away, or save under another name"
    if any(isinstance(c, CheckpointExistsError) for c in found):
        return f"save under a new name, or {conventions.overwrite_hint}"
    if any(isinstance(c, InsufficientSpaceError) for c in found):
        return "free space on the tier named (or keep fewer steps), then save again"
    return "fix the cause above and save again; training can go on"


def raise_failures(agree: Agreement, mine: list[dict[str, Any]], headline: str, todo: str) -> None:
    """Collective, once the ranks agreed that some rank failed: SaveFailedError on every rank,
    listing every rank's ``mine``."""
    everyone = [f for part in agree.gather(mine) for f in part]
    lines = "\n".join(
        f"  rank {f['rank']}: {f['step']} on the {f['tier']} tier ({f['where']}): {f['error']}"
        for f in everyone
    )
    raise SaveFailedError(f"{headline}:\n{lines}\n{todo}.", everyone)


def raise_save_failed(
    agree: Agreement,
    conventions: Conventions,
    rank: int,
    root: str,
    step: str,
    error: BaseException | None,
) -> None:
    """Collective, once the ranks agreed that the save of ``step`` failed on some rank:
    SaveFailedError on every rank, with the advice of the rank that failed."""
    where = os.path.join(root, step)
    mine = [] if error is None else [failure(rank, step, "local", where, error)]
    todo = f"{conventions.kept}; {advice([error] if error is not None else [], conventions)}"
    # The advice of the rank that failed, on every rank.
    todo = next((t for t in agree.gather(todo if error is not None else None) if t), todo)
    raise_failures(
        agree,
        mine,
        f"{conventions.framework} checkpoint {step!r} in {root} was not saved",
        todo,
    )


def raise_not_durable(
    agree: Agreement, conventions: Conventions, rank: int, remote: Any, error: BaseException | None
) -> None:
    """Collective, once the ranks agreed that a step did not become durable on some rank:
    SaveFailedError on every rank."""
    mine = [] if error is None else [failure(rank, "-", "remote", str(remote), error)]
    raise_failures(
        agree,
        mine,
        f"{conventions.framework}: not every step became durable on the remote tier",
        "the steps are committed locally; the next job on this root resumes their upload",
    )
