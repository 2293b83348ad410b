"""What the manager tells about one save once it ended: the facts it gathers while the save
runs, and the ``saved`` event they make."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..lifecycle import Save
from ..policy.step_names import STEP


def step_name(step: int) -> str:
    return STEP.build(step)


@dataclass
class SaveFacts:
    """One save's facts for its events and outcomes; the save itself is the lifecycle's."""

    step: int
    tier: str  # "memory" or "local"
    remote: bool  # due on the remote tier
    started: float  # epoch seconds
    stall_s: float
    stage_s: float
    nbytes: int
    timings: dict[str, float] = field(default_factory=dict)
    save: Save | None = None  # in the lifecycle's flight

    @property
    def name(self) -> str:
        return step_name(self.step)


def saved(facts: SaveFacts, rank: int, upload: tuple[float, float] | None) -> dict[str, Any]:
    """The fields of the ``saved`` event; ``upload``: when this process's upload of the step
    started and made it durable, if it ran one."""
    fields: dict[str, Any] = {
        "step": facts.step,
        "rank": rank,
        "tier": facts.tier,
        "remote": facts.remote,
        "bytes": facts.nbytes,
        "stall_s": round(facts.stall_s, 6),
        "stage_s": round(facts.stage_s, 6),
        "local_write_s": _round(facts.timings.get("write_s")),
        "commit_s": _round(facts.timings.get("commit_s")),
        "upload_s": None,
        "durable_at": None,
        "durable_after_s": None,
    }
    if upload is not None:
        fields.update(
            upload_s=round(upload[1] - upload[0], 6),
            durable_at=round(upload[1], 6),
            durable_after_s=round(upload[1] - facts.started, 6),
        )
    return fields


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 6)
