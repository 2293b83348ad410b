"""Admission of a save: what each rank says about it (one :class:`Vote`, agreed with a single
MAX all-reduce), and whether this rank's node has room for it (:class:`Room`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from ..agreement import Agreement
from ..backends.local import available_memory_bytes
from ..errors import InsufficientSpaceError, PeerLostError, ReplicationError
from ..lifecycle.restorable import unrestorable, unrestorable_error
from ..policy import cadence
from ..policy.admission import Admission, Headroom, shortfall
from ..policy.cadence import Decision
from ..policy.outcomes import SKIPPED
from ..staging import state_bytes
from ..tiers.local import LocalTier
from ..tiers.memory import MemoryTier
from ..tiers.replica import Replicator
from ..writer import TieredStorageWriter
from ._reports import Reports


@dataclass(frozen=True)
class Vote:
    """One rank's say on a save; agreed, a flag any rank raised holds on every rank."""

    wanted: Decision  # the tiers due now by this rank's clock
    failed: bool = False  # an earlier save or upload of this rank failed
    busy: bool = False  # as many disk saves in flight as the cap allows
    memory_short: bool = False  # this rank's node has no room in host memory
    local_short: bool = False  # ... or on its disk
    refused: bool = False  # the state holds a value weights_only loading would refuse

    def encode(self) -> list[int]:
        flags = (self.failed, self.busy, self.memory_short, self.local_short, self.refused)
        return cadence.encode(self.wanted) + [int(f) for f in flags]

    @classmethod
    def decode(cls, flags: list[int]) -> Vote:
        """Every rank's votes, MAX-reduced: the tiers any rank found due (clocks differ)."""
        failed, busy, memory_short, local_short, refused = (bool(f) for f in flags[3:8])
        return cls(cadence.agree(flags[:3]), failed, busy, memory_short, local_short, refused)

    def short(self, tier: str) -> bool:
        return self.memory_short if tier == "memory" else self.local_short


class Gate:
    """Admission of each save: this rank's :class:`Vote` (the tiers due, an earlier failure,
    the in-flight cap, room on this node, a state that could not be restored), agreed."""

    def __init__(
        self, room: Room, agree: Agreement, *, time_based: bool, allow_pickle: bool
    ) -> None:
        self.room, self.agree, self.time_based = room, agree, time_based
        self.restorable = allow_pickle  # checked at the first save otherwise

    def vote(
        self, step: int, app_state: dict[str, Any], wanted: Decision, *, failed: bool, busy: bool
    ) -> tuple[Vote, dict[str, str | None]]:
        """Collective: the agreed vote, and why this rank's node has no room for a tier.
        Raises ConfigError on every rank when some rank's state could never be restored."""
        # With time-based cadence another rank may find a tier due that this one does not:
        # then every rank checks its own node's room for both tiers.
        check = wanted.any or self.time_based
        short = {
            tier: self.room.shortfall(app_state, tier) if check and self.room.has(tier) else None
            for tier in ("memory", "local")
        }
        refused = None if self.restorable else refused_value(app_state)
        mine = Vote(
            wanted,
            failed=failed,
            busy=busy,
            memory_short=short["memory"] is not None,
            local_short=short["local"] is not None,
            refused=refused is not None,
        )
        try:
            vote = Vote.decode(self.agree.vote(mine.encode()))
        except PeerLostError as e:
            if self.room.replica is None:
                raise
            raise ReplicationError(f"{e} {self.room.replica.describe_partners()}") from e
        if vote.refused:
            raise unrestorable_error(f"step {step}", self.agree.gather(refused))
        self.restorable = True
        return vote, short


class Room:
    """Whether this rank's node has room for a save to the memory or the disk tier."""

    def __init__(
        self,
        admission: Admission,
        writer: TieredStorageWriter,
        tier: LocalTier,
        memory: MemoryTier | None,
        replica: Replicator | None,
    ) -> None:
        self.admission, self.writer, self.tier = admission, writer, tier
        self.memory, self.replica = memory, replica
        self.staged_bytes = 0  # what this rank's last disk save staged (the manager sets it)
        self.ranks_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self._ram_checked: tuple[float, int | None] = (-1e9, None)
        self._first_estimate: int | None = None

    def shortfall(self, app_state: dict[str, Any], tier: str) -> str | None:
        """Why ``tier`` has no room for ``app_state`` on this node (None: it has)."""
        known = self.memory.last_bytes if self.memory is not None else 0
        known = known or self.staged_bytes
        if not known and self._first_estimate is None:
            self._first_estimate = state_bytes(resolve(app_state))  # once: calls state_dict()
        nbytes = known or self._first_estimate or 0
        if tier == "memory":
            assert self.memory is not None
            # Two slots, allocated once in tmpfs (which is RAM), then reused.
            # With replication, as many again per partner whose copies this rank keeps.
            copies = 1 + (self.replica.config.factor if self.replica is not None else 0)
            new = 0 if self.memory.buffers_ready() else 2 * nbytes * copies
            headroom = Headroom(
                self.ranks_on_node,
                new_tier_bytes=new,
                new_ram_bytes=new,
                ram_available=self._ram_available(),
                tier_free=self.memory.backend.free_bytes(),
            )
        else:
            headroom = Headroom(
                self.ranks_on_node,
                new_tier_bytes=nbytes,
                new_ram_bytes=0 if self.writer.staging_buffers_ready() >= 2 else nbytes,
                ram_available=self._ram_available(),
                tier_free=self.tier.backend.free_bytes(),
            )
        return shortfall(self.admission, headroom, tier)

    def has(self, tier: str) -> bool:
        return tier == "local" or self.memory is not None

    def _ram_available(self) -> int | None:
        # Reading /proc/meminfo costs about a millisecond: at one save per step, once a second
        # is often enough (the tmpfs free-space check bounds the memory tier exactly anyway).
        now = time.monotonic()
        if now - self._ram_checked[0] > 1.0:
            self._ram_checked = (now, available_memory_bytes())
        return self._ram_checked[1]


def resolve(app_state: dict[str, Any]) -> dict[str, Any]:
    """``app_state`` with Stateful objects replaced by their state dicts (as DCP does)."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in app_state.items()}


def refused_value(app_state: dict[str, Any]) -> str | None:
    """Why a value of ``app_state`` would not load back with ``weights_only`` (None: none)."""
    return unrestorable(resolve(app_state))


def admitted(
    step: int, vote: Vote, short: dict[str, str | None], admission: Admission, reports: Reports
) -> Decision:
    """The tiers agreed due, or none when the one due has no room (``when_full='skip'``)
    or the disk saves in flight are at the cap (``when_busy='skip'``)."""
    decision = vote.wanted
    tier = "local" if decision.local else "memory"
    if decision.any and vote.short(tier):
        why = short[tier] or "another rank's node has no room"
        message = (
            f"step {step} was not saved to the {tier} tier: {why}. Nothing was written; "
            "free space, keep fewer steps or lower the cadence."
        )
        if admission.when_full == "raise":
            reports.planned(step, decision, SKIPPED, why)
            raise InsufficientSpaceError(28, message)
        warning = f"{message} (Admission.when_full='skip')"
        reports.skip(step, decision, tier, why, warning)
        return Decision()
    if decision.local and vote.busy and admission.when_busy == "skip":
        warning = (
            f"skipping the save of step {step}: {admission.max_in_flight} disk saves "
            "already in flight (Admission.when_busy='skip')"
        )
        reports.skip(step, decision, tier, "saves in flight at the cap", warning)
        return Decision()
    return decision
