"""Planning a save, with no I/O: what each rank tells the coordinator, where each rank sits, what
one save is, and the checks that refuse a save before any rank writes.

The plans carry only where each rank sits (:class:`RankInfo` up, :class:`Layout` down), which
stays true when DCP's plan caching replays a plan; what one save is (:class:`SaveFacts`) goes
from the coordinator to every rank through the c10d store, under :func:`facts_key`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from .. import _torch_compat
from ..errors import ConfigError, InsufficientSpaceError
from ..policy import identity, layout

_BYTES_ITEM_ESTIMATE = 64 * 2**10  # non-tensor items are small pickles
_PER_ITEM_OVERHEAD = 4 * 2**10  # torch.save's zip framing, about 1.5 KiB per item


@dataclass(frozen=True)
class RankInfo:
    """What each rank tells the coordinator in its local plan.

    DCP's plan caching may hand a cached copy back to the coordinator in a later save:
    ``node_key`` and ``root`` stay true for it; ``step`` and ``free_bytes`` are the save's that
    made the plan, so the coordinator reads them only while no plan is cached in its process
    (every rank checks both again before writing, see :func:`check_save`)."""

    node_key: str
    root: str
    step: str
    free_bytes: int
    run_id: str | None = None  # the run this rank's root records (or was told), if any


@dataclass(frozen=True)
class Layout:
    """What the coordinator hands back to each rank with its final plan.

    DCP's plan caching replays it unchanged in later saves with the same plan, so it holds only
    what stays true for them (where the rank sits), never which save it is (``SaveFacts``)."""

    rank: int
    node: int
    node_key: str  # host:root of this rank when the plan was made
    node_leader: bool
    coordinator_node: bool
    world_size: int
    node_bytes: int  # planned bytes of the whole node, for the admission check
    coordinator: int  # global rank of the coordinator: names the store key of each save's facts
    node_of: tuple[int, ...] = ()  # every rank's node; the coordinator's layout only


@dataclass(frozen=True)
class SaveFacts:
    """What one save is, decided by the coordinator and sent to every rank through the c10d
    store (never inside a plan, which DCP may cache and replay)."""

    step: str
    save_id: str
    promote: bool  # copy the committed step to the remote tier
    run_id: str  # the run every node's root and the remote prefix record, or a new one

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> SaveFacts:
        body = json.loads(raw)
        return cls(
            step=str(body["step"]),
            save_id=str(body["save_id"]),
            promote=bool(body["promote"]),
            run_id=identity.validate_run_id(body["run_id"]),
        )


@dataclass(frozen=True)
class SaveInfo:
    """One save as a rank runs it: its place from the plan and the save's own facts."""

    layout: Layout
    facts: SaveFacts

    step = property(lambda self: self.facts.step)
    save_id = property(lambda self: self.facts.save_id)
    promote = property(lambda self: self.facts.promote)
    run_id = property(lambda self: self.facts.run_id)
    rank = property(lambda self: self.layout.rank)
    node = property(lambda self: self.layout.node)
    node_leader = property(lambda self: self.layout.node_leader)
    coordinator_node = property(lambda self: self.layout.coordinator_node)
    world_size = property(lambda self: self.layout.world_size)

    @property
    def tmp(self) -> str:
        return layout.tmp_dir_name(self.step, self.save_id)


def facts_key(coordinator: int) -> str:
    # One key per coordinator, overwritten by each save: the coordinator sets it before DCP
    # scatters the plan, every rank reads it before it writes, and the next save cannot reach
    # the coordinator's prepare_global_plan before every rank has finished this one.
    return f"dcp_tiered/save/{coordinator}"


def roots(plans: list[SavePlan], own: str, own_run: str | None) -> dict[str, str | None]:
    """The run each node's root records (or was told), as its ranks planned it (plans DCP's
    cache replays carry none: the coordinator's own root stands for them)."""
    found = {i.node_key: i.run_id for p in plans if isinstance(i := p.storage_data, RankInfo)}
    found[own] = own_run or found.get(own)
    return found


def planned_bytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return _BYTES_ITEM_ESTIMATE
    numel = math.prod(item.tensor_data.chunk.sizes)
    return numel * item.tensor_data.properties.dtype.itemsize + _PER_ITEM_OVERHEAD


def lay_out(step: str, plans: list[SavePlan], margin: int) -> list[SavePlan]:
    """Each usable plan with its rank's layout. With DCP's plan caching, ranks whose final
    plan did not change get an unusable one and replay theirs: the layout is computed from
    the full plan DCP cached, so that it agrees with theirs."""
    full = plans
    if not all(getattr(p, "usable", True) for p in plans):
        cached = _torch_compat.cached_global_plan(plans)
        if cached is None:
            raise ConfigError(
                f"step {step!r}: DCP's plan caching sent a partial plan whose cached global "
                "plan cannot be found; save with enable_plan_caching=False"
            )
        full = cached
    infos = [p.storage_data for p in full]
    if not all(isinstance(i, RankInfo) for i in infos):
        raise ConfigError(
            f"step {step!r}: a local plan carries no dcp_tiered rank info (another storage "
            "writer's plan, replayed by DCP's plan caching?); save with one "
            "TieredStorageWriter on every rank"
        )
    if not _torch_compat.plan_cache_in_use():
        # Every plan was made for this save: refuse early, before any rank writes. With a
        # cached plan each rank checks its own node in write_data instead.
        steps = {i.step for i in infos}
        if len(steps) != 1:
            raise ConfigError(f"ranks disagree on the step name: {sorted(steps)}")
    layouts = _layouts(full, infos, _torch_compat.global_rank())
    if not _torch_compat.plan_cache_in_use():
        _check_space(infos, layouts, margin)
    return [
        dataclasses.replace(p, storage_data=lay) if getattr(p, "usable", True) else p
        for p, lay in zip(plans, layouts)
    ]


def _layouts(plans: list[SavePlan], infos: list[RankInfo], coordinator: int) -> list[Layout]:
    """Every rank's place: ranks sharing a host and root form a node, led by its lowest rank."""
    nodes: dict[str, int] = {}
    node_of = [nodes.setdefault(i.node_key, len(nodes)) for i in infos]
    leader: dict[int, int] = {}
    node_bytes = [0] * len(nodes)
    for rank, (plan, node) in enumerate(zip(plans, node_of)):
        leader.setdefault(node, rank)
        node_bytes[node] += sum(planned_bytes(i) for i in plan.items)
    return [
        Layout(
            rank=rank,
            node=node,
            node_key=infos[rank].node_key,
            node_leader=leader[node] == rank,
            coordinator_node=node == node_of[0],
            world_size=len(plans),
            node_bytes=node_bytes[node],
            coordinator=coordinator,
            node_of=tuple(node_of) if rank == 0 else (),
        )
        for rank, node in enumerate(node_of)
    ]


def _check_space(infos: list[RankInfo], layouts: list[Layout], margin: int) -> None:
    for node in sorted({lay.node for lay in layouts}):
        ranks = [lay.rank for lay in layouts if lay.node == node]
        need = layouts[ranks[0]].node_bytes + margin
        free = min(infos[r].free_bytes for r in ranks)
        if need > free:
            raise InsufficientSpaceError(
                errno.ENOSPC,
                f"step {infos[ranks[0]].step!r} needs {need / 2**20:.1f} MiB (with "
                f"{margin / 2**20:.0f} MiB margin) on {infos[ranks[0]].root} (ranks {ranks}) but "
                f"only {free / 2**20:.1f} MiB is free; free space or keep fewer steps. "
                "Nothing was written and earlier steps are intact.",
            )


def layout_of(plan_data: Any, step: str | None) -> Layout:
    """The layout the plan DCP handed to write_data carries (it may be a replayed one)."""
    if not isinstance(plan_data, Layout):
        raise ConfigError(
            f"step {step!r}: the plan DCP handed to write_data carries "
            "no dcp_tiered layout; save with one TieredStorageWriter on "
            "every rank"
        )
    return plan_data


def check_save(
    save: SaveInfo, step: str | None, node_key: str, free_bytes: int, margin: int, root: str
) -> None:
    """This rank's checks of its save before it writes anything: the coordinator's step is its
    own, a replayed plan was made for this node, and the node's planned bytes fit the disk."""
    facts, lay = save.facts, save.layout
    if facts.step != step:
        raise ConfigError(
            f"ranks disagree on the step name: {sorted({facts.step, str(step)})} "
            f"(rank {lay.rank} saves {step!r}, the coordinator {facts.step!r}); pass "
            "the same checkpoint_id on every rank. Nothing of this save is committed."
        )
    if lay.node_key != node_key:
        _torch_compat.forget_save_plans()
        raise ConfigError(
            f"step {facts.step!r}: DCP's plan cache (enable_plan_caching=True) replayed a "
            f"plan made for {lay.node_key}, but this writer saves to {node_key}. "
            "Nothing was written; this process's plan cache is cleared, so the next save "
            "plans afresh."
        )
    need = lay.node_bytes + margin
    if need > free_bytes:
        raise InsufficientSpaceError(
            errno.ENOSPC,
            f"step {facts.step!r} needs {need / 2**20:.1f} MiB (with "
            f"{margin / 2**20:.0f} MiB margin) on {root} (node "
            f"{lay.node}) but only {free_bytes / 2**20:.1f} MiB is free; free space "
            "or keep fewer steps. Nothing was written on this node and earlier steps are "
            "intact.",
        )
