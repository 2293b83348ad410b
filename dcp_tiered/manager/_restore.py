"""What the manager restores from: the candidates on its tiers, newest first, their loads into
the training state, and where each step's copies are."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .. import _gc
from ..agreement import Agreement
from ..backends.remote import RemoteBackend
from ..errors import CheckpointNotFoundError, DcpTieredError, describe
from ..events import EventLog
from ..lifecycle import Lifecycle, LoadFailure
from ..load_planner import TieredLoadPlanner
from ..policy import step_names
from ..policy.cadence import Decision
from ..policy.identity import Owner
from ..rank_state import RankState
from ..reader import TieredStorageReader
from ..tiers import snapshots
from ..tiers.catalog import list_steps
from ..tiers.local import LocalTier
from ..tiers.memory import MemoryTier
from ..tiers.replica import Replicator
from ._events import step_name

logger = logging.getLogger("dcp_tiered.manager")  # the name its records always had


class Sources:
    """The manager's tiers as restore sees them: ``root`` (the disk tier, ``local`` its
    listing), ``memory`` (with ``replica``, partners' copies too) and ``remote``."""

    def __init__(
        self,
        root: str,
        local: LocalTier,
        memory: MemoryTier | None,
        replica: Replicator | None,
        remote: RemoteBackend | None,
        *,
        allow_pickle: bool,
        group: Any,
        rank: int,
        emit: Callable[..., Any],
    ) -> None:
        self.emit = emit
        self.root, self.local, self.memory, self.replica, self.remote = (
            root,
            local,
            memory,
            replica,
            remote,
        )
        self.allow_pickle, self.group, self.rank = allow_pickle, group, rank

    def choose(
        self,
        lifecycle: Lifecycle,
        app_state: dict[str, Any],
        only: str | None,
        on_unreadable_tier: str,
    ) -> tuple[str, str] | None:
        """Collective: the (step, tier) loaded into ``app_state`` (``only``: that step), the
        newer disk steps some rank proved bad quarantined (training saves them again), and
        the newer steps some rank had no snapshot of anywhere in memory reported."""
        if self.replica is not None:  # what every rank holds, for candidates and load
            self.replica.survey()

        def abandon(
            proven: list[tuple[str, str]], passed: list[tuple[str, str]], chosen: tuple[str, str]
        ) -> None:
            reason = f"a restore fell back past it to {chosen[0]}"
            lifecycle.quarantine(self.root, disk_steps_newer(proven, chosen), reason=reason)
            lifecycle.pass_over(self.root, disk_steps_newer(passed, chosen))

        chosen = lifecycle.restore(
            lambda with_remote: self.candidates(only, with_remote),
            lambda candidate: self.load(candidate, app_state),
            on_unreadable_tier=on_unreadable_tier,
            retry="restore",
            name=lambda c: f"{c[0]} from the {c[1]} tier",
            abandon=abandon,
        )
        restored, what = -1, None
        if chosen is not None:
            number = step_names.order_number(chosen[0])
            assert number is not None  # candidates are numbered steps
            restored, what = number, f"{chosen[0]} from the {chosen[1]} tier"
        snapshots.report_lost(self.replica, restored, what, rank=self.rank, emit=self.emit)
        return chosen

    def candidates(self, only: str | None, with_remote: bool) -> list[tuple[str, str]]:
        remote = self.remote if with_remote else None
        return candidates(self.memory, self.replica, self.local, remote, only)

    def load(self, candidate: tuple[str, str], app_state: dict[str, Any]) -> str | None:
        """Loads ``candidate`` into ``app_state``: None, or why it failed."""
        name, tier = candidate
        if tier == "memory":  # its own snapshot or, with replication, a partner's copy
            assert self.memory is not None
            return snapshots.load(self.memory, self.replica, name, app_state)
        return load_dcp(
            self.root,
            self.remote,
            name,
            app_state,
            allow_pickle=self.allow_pickle,
            group=self.group,
            rank=self.rank,
        )

    def copies(self, agree: Agreement) -> dict[str, dict[str, Any]]:
        """Collective: see :meth:`~dcp_tiered.manager.CheckpointManager.copies`."""
        survey = self.replica.survey() if self.replica is not None else None
        own = self.memory.steps() if self.memory is not None else {}
        mine = agree.gather(sorted(own))
        out: dict[str, dict[str, Any]] = {}

        def entry(name: str) -> dict[str, Any]:
            return out.setdefault(
                name, {"memory": [], "partners": {}, "local": False, "remote": False}
            )

        for rank, steps in enumerate(mine):
            for name in steps:
                entry(name)["memory"].append(rank)
        for name in survey.steps() if survey is not None else []:
            assert survey is not None
            for rank in range(len(survey.own)):
                held = [h for h in survey.copies(name, rank) if h != "own"]
                if held:
                    entry(name)["partners"][rank] = held
        for s in list_steps(self.local, self.remote):
            entry(s.name).update(local=s.local, remote=s.remote)
        return dict(sorted(out.items(), key=lambda kv: -(step_names.order_number(kv[0]) or -1)))


def candidates(
    memory: MemoryTier | None,
    replica: Replicator | None,
    local: LocalTier,
    remote: RemoteBackend | None,
    only: str | None,
) -> list[tuple[str, str]]:
    """(step name, tier) pairs to try, newest first, nearest tier first (``only``: that step)."""
    found: list[tuple[int, int, str, str]] = []
    order = {"memory": 0, "local": 1}
    # With replication: steps every rank can get from its own memory or a partner's copy.
    for name, committed_at in snapshots.candidates(memory, replica).items():
        found.append((step_names.order_number(name) or -1, committed_at, name, "memory"))
    record = local.record()
    for s in list_steps(local, remote, strict=True):
        if record is not None and record.owner(s.run_id, s.name, s.save_id) == Owner.FOREIGN:
            continue  # another run's step: listed by `dcp-tiered ls`, never restored here
        found.append((step_names.order_number(s.name) or -1, s.committed_at_ns, s.name, "local"))
    if only is not None:
        found = [f for f in found if f[2] == only]
    found.sort(key=lambda f: (-f[0], order[f[3]], -f[1]))
    return [(name, tier) for _, _, name, tier in found if step_names.order_number(name) is not None]


def disk_steps_newer(failed: list[tuple[str, str]], chosen: tuple[str, str]) -> list[str]:
    """The disk steps among ``failed`` newer than ``chosen`` (a memory snapshot is only ever
    skipped, never quarantined)."""
    number = step_names.order_number(chosen[0]) or -1
    return sorted(
        {n for n, t in failed if t != "memory" and (step_names.order_number(n) or -1) > number}
    )


def load_dcp(
    root: str,
    remote: RemoteBackend | None,
    name: str,
    app_state: dict[str, Any],
    *,
    allow_pickle: bool,
    group: Any,
    rank: int,
) -> str | None:
    """Loads disk step ``name`` into ``app_state``: None, or why it failed (on every rank)."""
    reader = TieredStorageReader(
        root, remote=remote.config if remote is not None else None, allow_pickle=allow_pickle
    )
    try:
        # No collection from the first read to the last copy: the load's objects (a few per
        # item, none in cycles) all die with it, the reader's index included. Paused only in
        # parts, the young collections between the parts moved them on, and they set off full
        # collections over every live object: 20,000 tensors, a second each, one load in two
        # or three.
        with _gc.paused():
            dcp.load(
                _loadable(app_state, reader, name, rank),
                checkpoint_id=name,
                storage_reader=reader,
                planner=TieredLoadPlanner(reader=reader),
                process_group=group,
            )
            del reader
    except (CheckpointException, DcpTieredError) as e:  # DCP told every rank already
        return LoadFailure.of(e, describe(e))
    return None


def _loadable(
    app_state: dict[str, Any], reader: TieredStorageReader, name: str, rank: int
) -> dict[str, Any]:
    """``app_state`` without per-rank states the step lacks (it was saved by fewer ranks)."""
    rank_states = {k: v for k, v in app_state.items() if isinstance(v, RankState)}
    if not rank_states:
        return app_state
    reader.reset(name)
    keys = reader.read_metadata().state_dict_metadata
    out = dict(app_state)
    for k, rs in rank_states.items():
        prefix = f"{k}.{rs.key}."
        if not any(fqn.startswith(prefix) for fqn in keys):
            logger.warning(
                "%s holds no %s state for rank %d (saved with fewer ranks?): "
                "its RNG and data position start fresh",
                name,
                k,
                rank,
            )
            del out[k]
    return out


class Restoring:
    """Restore, and where copies are: the part of
    :class:`~dcp_tiered.manager.CheckpointManager` (a base class of it) that reads back."""

    rank: int
    restored_step: int | None
    _sources: Sources
    _lifecycle: Lifecycle
    _events: EventLog
    _agree: Agreement
    _remote: RemoteBackend | None

    wait: Callable[[], Any]  # the manager's
    wait_staged: Callable[[], None]
    _start: Callable[[int, dict[str, Any], Decision, float], None]  # a save to the disk tier

    def restore(
        self,
        app_state: dict[str, Any],
        step: int | None = None,
        *,
        on_unreadable_tier: str = "raise",
    ) -> int | None:
        """Load the newest step that verifies (or ``step``) into ``app_state``.

        Looks in memory, then the local disk, then the remote tier, and falls back to older
        steps when a newer one fails verification, logging why. A step restored from memory
        only is then saved to the local (and remote) tier. Returns the step to continue
        from (one past the restored step), or None when every tier was read and holds none.

        If the remote tier cannot be read, which steps exist is unknown: this raises
        TierUnavailableError on every rank, naming the tier and the cause, rather than start
        from scratch (or from an older step) while newer ones may exist. With
        ``on_unreadable_tier="skip"`` it restores from the tiers it can read, with an ERROR log.
        """
        self.wait_staged()  # a snapshot copying beside training (async_snapshots) first
        # and this manager's saves in flight: the newest step may be one of them, and a save
        # of a step that exists replaces it while a restore would read it
        self._lifecycle.wait_written()
        only = None if step is None else step_name(step)
        chosen = self._sources.choose(self._lifecycle, app_state, only, on_unreadable_tier)
        if chosen is None:
            if step is not None:
                raise CheckpointNotFoundError(f"step {step} is in no tier of this manager")
            return None
        name, tier = chosen
        number = step_names.order_number(name)
        assert number is not None
        self.restored_step = number
        logger.info("restored %s from the %s tier", name, tier)
        self._events.emit("restored", step=number, tier=tier, rank=self.rank)
        if tier == "memory" and (name, "local") not in self._lifecycle.listed:
            # Only host memory has it: persist it down the tiers before going on.
            self._start(
                number,
                app_state,
                Decision(local=True, remote=self._remote is not None),
                time.perf_counter(),
            )
        return number + 1

    def copies(self) -> dict[str, dict[str, Any]]:
        """Collective: where each step's copies are, newest first: ``memory`` (ranks holding it
        in their own memory), ``partners`` (rank -> the ranks on other nodes holding a copy of
        its snapshot), ``local`` (this node's disk) and ``remote``."""
        self.wait()
        return self._sources.copies(self._agree)
