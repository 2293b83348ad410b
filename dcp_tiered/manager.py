"""CheckpointManager: what a training loop calls every step.

A snapshot in host memory every step, the local disk every N steps, the remote tier every M
(PAI EasyCkpt's hierarchy), each tier with its own retention::

    mgr = CheckpointManager(memory="/dev/shm/run1", local="/nvme/ckpt/run1",
                            remote="s3://bucket/run1")
    start = mgr.restore(app_state)        # step to start from, or None for a fresh run
    for step in range(start or 0, total):
        train_step()
        mgr.save(step, app_state)         # returns after staging; never waits for I/O
    mgr.close()                           # waits for in-flight work; errors surface here

Every rank calls ``save`` with the same step, in the same order. Ranks agree on each save with
one small all-reduce on a group of their own, so time-based cadence, admission control and
failures of any rank lead every rank to the same decision, and no rank hangs in a save the
others skipped.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful
from typing_extensions import Self  # a dependency of torch itself

from . import _torch_compat
from .backends.local import available_memory_bytes
from .backends.remote import RemoteBackend
from .errors import (
    CheckpointNotFoundError,
    ConfigError,
    DcpTieredError,
    InsufficientSpaceError,
    PeerLostError,
    ReplicationError,
    causes,
    describe,
)
from .events import EventLog
from .lifecycle import Conventions, Lifecycle, LoadFailure, failure, raise_failures
from .load_planner import TieredLoadPlanner
from .planner import planner_for
from .policy import cadence, layout
from .policy.admission import Admission, Headroom, shortfall
from .policy.cadence import Decision, SavePolicy
from .policy.identity import Owner
from .policy.memory_format import first_refused
from .policy.outcomes import COMMITTED, FAILED, PENDING, SKIPPED, Outcomes, SaveOutcome
from .policy.replication import Replication
from .policy.retention import Retention
from .rank_state import RankState
from .reader import TieredStorageReader
from .staging import state_bytes
from .tiers import housekeeping, snapshots, uploads
from .tiers.catalog import list_steps
from .tiers.memory import MemoryTier
from .tiers.replica import Replicator

logger = logging.getLogger(__name__)


CONVENTIONS = Conventions("CheckpointManager")


def step_name(step: int) -> str:
    return f"step-{step}"


@dataclass
class _InFlight:
    step: int
    tier: str  # "memory" or "local"
    remote: bool
    future: Future[Any]
    started: float  # epoch seconds
    stall_s: float
    stage_s: float
    nbytes: int
    timings: dict[str, float] = field(default_factory=dict)
    upload: Future[None] | None = None

    @property
    def name(self) -> str:
        return step_name(self.step)


class CheckpointManager:
    """Saves to host memory, local disk and a remote tier on a cadence; restores the newest
    step that verifies.

    Args:
        local: the node's local checkpoint directory (NVMe).
        memory: a directory in host shared memory (``/dev/shm/...``): its snapshots survive
            the death of the training processes, not of the node. None: no memory tier.
        remote: an fsspec URL or RemoteConfig; steps due there are copied in the background.
        storage_options: fsspec options for ``remote``.
        policy: cadence per tier (:class:`SavePolicy`).
        retention: what each tier keeps (:class:`Retention`).
        admission: in-flight cap and space checks (:class:`Admission`).
        events: JSON-lines file of save events; default ``<local>/.dcp-tiered-events.jsonl``,
            None for the ``dcp_tiered.events`` logger only.
        collective_timeout_secs: how long a rank waits for the others in checkpoint
            collectives before raising instead of hanging.
        writer_options: more TieredStorageWriter arguments for the local tier
            (``sync_files``, ``thread_count``, ``commit_timeout_secs`` ...).
        allow_pickle: restore non-tensor values with full pickle. Only for checkpoints you
            trust: a pickle can run arbitrary code. Without it, a state holding a value that
            ``weights_only`` loading refuses (an ``io.BytesIO``, a custom class) is refused at
            its first save, on every rank, instead of saving what could never be restored.
        replication: copy each memory snapshot to partner nodes' host memory
            (:class:`Replication`), so a node lost before its upload loses nothing; needs
            ``memory``. A restore takes each rank's snapshot from its own memory or a partner.
        run_id: this run's id (default ``$DCP_TIERED_RUN_ID``, else the run ``local`` and the
            remote prefix record, else a new one). ``local``, ``memory`` and the remote prefix
            record it; a directory or prefix of another run, or a root another job uses now, is
            refused at start with ForeignRunError on every rank. Only this run's steps and
            snapshots are ever restored, quarantined or deleted (see docs/guarantees.md).
    """

    def __init__(
        self,
        *,
        local: str | os.PathLike[str],
        memory: str | os.PathLike[str] | None = None,
        remote: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        policy: SavePolicy | None = None,
        retention: Retention | None = None,
        admission: Admission | None = None,
        events: str | os.PathLike[str] | None = "default",
        collective_timeout_secs: float = 600.0,
        writer_options: Mapping[str, Any] | None = None,
        allow_pickle: bool = False,
        replication: Replication | None = None,
        run_id: str | None = None,
    ) -> None:
        if replication is not None and memory is None:
            raise ConfigError("replication copies memory snapshots: it needs memory=...")
        self.policy = policy or SavePolicy()
        self.retention = retention or Retention()
        self.admission = admission or Admission()
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self._ranks_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        options = dict(writer_options or {})
        options.setdefault("overwrite", True)  # a replayed step replaces its abandoned twin
        self._lifecycle = Lifecycle(
            CONVENTIONS,
            remote=remote,
            storage_options=storage_options,
            writer_options=options,
            collective_timeout_secs=collective_timeout_secs,
            run_id=run_id,
        )
        # Saves run their collectives on one group, the manager's votes on another: a vote on
        # the training thread never interleaves with a background save's collectives.
        self._save_pg, self._agree = self._lifecycle.group, self._lifecycle.agree
        if memory is not None and os.path.realpath(memory) == os.path.realpath(local):
            raise ConfigError("memory and local must be different directories")
        # Recovered (crashes swept, uploads on, the remote checked) and the run agreed;
        # fails on every rank.
        self._local = self._lifecycle.start(local, memory=memory)
        self.run_id = self._lifecycle.run_id
        self.allow_pickle = allow_pickle
        self._memory = (
            MemoryTier(
                memory,
                self.rank,
                allow_pickle=allow_pickle,
                run_id=self.run_id,
                world_size=dist.get_world_size() if self._distributed else 1,
            )
            if memory is not None
            else None
        )
        self._remote = self._local.remote_backend
        # One process per directory applies retention: whoever holds its lock (the kernel
        # drops it with the process), whatever the node layout.
        self._local_keeper = self._local.local_tier.backend.try_lock_exclusive(
            layout.RETENTION_LOCK_NAME
        )
        self._events = EventLog(
            os.path.join(self._local.root, layout.EVENTS_LOG) if events == "default" else events
        )
        self._replica = (
            Replicator(
                self._memory,
                replication,
                timeout_secs=collective_timeout_secs,
                emit=self._events.emit,
            )
            if replication is not None and self._memory is not None
            else None
        )
        self._last: dict[str, float] = {t: time.time() for t in ("memory", "local", "remote")}
        self._in_flight: list[_InFlight] = []
        self._uploading: list[_InFlight] = []
        self._failures: list[dict[str, Any]] = []
        self._outcomes = Outcomes()  # what each save achieved, per tier (see wait())
        self._unreported: list[int] = []  # steps wait() has not reported final yet
        self._housekeeper = ThreadPoolExecutor(1, thread_name_prefix="dcp-tiered-retention")
        self._housekeeping: Future[None] | None = None
        self.restored_step: int | None = None
        self.last_stall_secs = 0.0
        self.skipped_saves = 0
        self._ram_checked: tuple[float, int | None] = (-1e9, None)
        self._first_estimate: int | None = None
        self._time_based = any(
            e is not None and e.secs is not None
            for e in (self.policy.memory, self.policy.local, self.policy.remote)
        )
        self._closed = False
        self._restorable = allow_pickle  # checked at the first save otherwise
        if self.rank == 0:
            self._record_tiers(memory)

    def _record_tiers(self, memory: Any) -> None:
        tiers = {
            "memory": os.path.abspath(memory) if memory is not None else None,
            "remote": self._remote.config.url if self._remote is not None else None,
        }
        self._local.local_tier.backend.replace_root_file(
            layout.TIERS_RECORD, json.dumps(tiers).encode()
        )

    # ------------------------------------------------------------ save

    def save(self, step: int, app_state: dict[str, Any], *, force: bool = False) -> Decision:
        """Save ``app_state`` as ``step-<step>`` to the tiers due now; returns once staged.

        ``force=True`` saves to the local and remote tiers whatever the cadence (end of an
        epoch, a pre-emption notice). Raises SaveFailedError on every rank if an earlier
        background save or upload failed on any rank. Returns where this save went.
        """
        if self._closed:
            raise ConfigError("this CheckpointManager is closed")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        t0 = time.perf_counter()
        now = time.time()
        self._reap()
        wanted = cadence.decide(
            self.policy,
            step,
            now,
            self._last,
            force=force,
            has_memory=self._memory is not None,
            has_remote=self._remote is not None,
        )
        # The cap is on disk saves, which hold staging buffers; a memory snapshot waits only
        # for the previous snapshot's checksum pass.
        busy = sum(r.tier == "local" for r in self._in_flight) >= self.admission.max_in_flight
        # With time-based cadence another rank may find a tier due that this one does not:
        # then every rank checks its own node's room for both tiers.
        check = wanted.any or self._time_based
        short = {
            tier: self._shortfall(app_state, tier) if check and self._has(tier) else None
            for tier in ("memory", "local")
        }
        refused = None if self._restorable else _refused_value(app_state)
        try:
            flags = self._agree.vote(
                cadence.encode(wanted)
                + [
                    int(bool(self._failures)),
                    int(busy),
                    int(short["memory"] is not None),
                    int(short["local"] is not None),
                    int(refused is not None),
                ]
            )
        except PeerLostError as e:
            if self._replica is None:
                raise
            raise ReplicationError(f"{e} {self._replica.describe_partners()}") from e
        if flags[7]:
            why = next(w for w in self._agree.gather(refused) if w)
            raise ConfigError(
                f"step {step} was not saved: {why}, so it could never be restored. Keep "
                "tensors, numbers, strings, lists and dicts in the state or, for checkpoints "
                "you trust, construct CheckpointManager(..., allow_pickle=True)."
            )
        self._restorable = True
        if flags[3]:
            self._raise_failures()
        decision = cadence.agree(flags[:3])
        if not decision.any:
            self.last_stall_secs = time.perf_counter() - t0
            return decision
        tier = "local" if decision.local else "memory"
        if flags[5 if tier == "memory" else 6]:
            why = short[tier] or "another rank's node has no room"
            self._record(step, decision, SKIPPED, why)
            return self._refuse(step, tier, why, t0)
        if flags[4] and tier == "local":
            if self.admission.when_busy == "skip":
                self._record(step, decision, SKIPPED, "saves in flight at the cap")
                self.skipped_saves += 1
                logger.warning(
                    "skipping the save of step %d: %d disk saves already in flight "
                    "(Admission.when_busy='skip')",
                    step,
                    self.admission.max_in_flight,
                )
                self._events.emit(
                    "skipped",
                    step=step,
                    tier=tier,
                    rank=self.rank,
                    reason="saves in flight at the cap",
                )
                self.last_stall_secs = time.perf_counter() - t0
                return Decision()
            while (local := [r for r in self._in_flight if r.tier == "local"]) and len(
                local
            ) >= self.admission.max_in_flight:
                self._wait(local[0])
                self._reap()
        self._start(step, app_state, decision, t0)
        for t in ("memory", "local", "remote"):
            if getattr(decision, t):
                self._last[t] = now
        return decision

    def _refuse(self, step: int, tier: str, why: str, t0: float) -> Decision:
        message = (
            f"step {step} was not saved to the {tier} tier: {why}. Nothing was written; "
            "free space, keep fewer steps or lower the cadence."
        )
        if self.admission.when_full == "raise":
            raise InsufficientSpaceError(28, message)
        self.skipped_saves += 1
        logger.warning("%s (Admission.when_full='skip')", message)
        self._events.emit("skipped", step=step, tier=tier, rank=self.rank, reason=why)
        self.last_stall_secs = time.perf_counter() - t0
        return Decision()

    def _shortfall(self, app_state: dict[str, Any], tier: str) -> str | None:
        known = self._memory.last_bytes if self._memory is not None else 0
        known = known or self._local.last_staged_bytes
        if not known and self._first_estimate is None:
            self._first_estimate = _state_bytes(app_state)  # once: it calls state_dict()
        nbytes = known or self._first_estimate or 0
        if tier == "memory":
            assert self._memory is not None
            # Two slots, allocated once in tmpfs (which is RAM), then reused.
            # With replication, as many again per partner whose copies this rank keeps.
            copies = 1 + (self._replica.config.factor if self._replica is not None else 0)
            new = 0 if self._memory.buffers_ready() else 2 * nbytes * copies
            headroom = Headroom(
                self._ranks_on_node,
                new_tier_bytes=new,
                new_ram_bytes=new,
                ram_available=self._ram_available(),
                tier_free=self._memory.backend.free_bytes(),
            )
        else:
            headroom = Headroom(
                self._ranks_on_node,
                new_tier_bytes=nbytes,
                new_ram_bytes=0 if self._local.staging_buffers_ready() >= 2 else nbytes,
                ram_available=self._ram_available(),
                tier_free=self._local.local_tier.backend.free_bytes(),
            )
        return shortfall(self.admission, headroom, tier)

    def _ram_available(self) -> int | None:
        # Reading /proc/meminfo costs about a millisecond: at one save per step, once a second
        # is often enough (the tmpfs free-space check bounds the memory tier exactly anyway).
        now = time.monotonic()
        if now - self._ram_checked[0] > 1.0:
            self._ram_checked = (now, available_memory_bytes())
        return self._ram_checked[1]

    def _has(self, tier: str) -> bool:
        return tier == "local" or self._memory is not None

    def _record(self, step: int, decision: Decision, state: str, why: str | None = None) -> None:
        """The outcome of the tiers ``decision`` saves ``step`` to: the disk (and remote) or
        host memory."""
        tiers = ["local"] if decision.local else ["memory"]
        if decision.local and decision.remote and self._remote is not None:
            tiers.append("remote")
        self._outcomes.record(step, tiers, state, why)
        if step not in self._unreported:
            self._unreported.append(step)

    def _start(self, step: int, app_state: dict[str, Any], decision: Decision, t0: float) -> None:
        name = step_name(step)
        started = time.time()
        self._record(step, decision, PENDING)
        if decision.local:
            if not decision.remote:
                self._local.keep_local(name)
            future = _torch_compat.upload_future(
                dcp.async_save(
                    app_state,
                    checkpoint_id=name,
                    storage_writer=self._local,
                    planner=planner_for(self._local),
                    process_group=self._save_pg,
                )
            )
            stage_s, nbytes = self._local.last_stall_secs, self._local.last_staged_bytes
        else:
            assert self._memory is not None
            future = self._start_memory(name, app_state)
            if self._replica is not None:  # in the background, once committed
                self._replica.offer(step, name, future)
            stage_s, nbytes = self._memory.last_copy_secs, self._memory.last_bytes
        stall = time.perf_counter() - t0
        self.last_stall_secs = stall
        self._in_flight.append(
            _InFlight(
                step=step,
                tier="local" if decision.local else "memory",
                remote=decision.remote and self._remote is not None,
                future=future,
                started=started,
                stall_s=stall,
                stage_s=stage_s,
                nbytes=nbytes,
            )
        )

    def _start_memory(self, name: str, app_state: dict[str, Any]) -> Future[dict[str, float]]:
        assert self._memory is not None
        try:
            return self._memory.save(name, _resolve(app_state))
        except (DcpTieredError, OSError) as e:  # this rank only: reported to all at next save
            failed: Future[dict[str, float]] = Future()
            failed.set_exception(e)
            return failed

    # ------------------------------------------------------------ completion

    def wait(self) -> dict[int, dict[str, SaveOutcome]]:
        """Block until this rank's saves in flight are committed on their tier (uploads go
        on in the background). Their failures are raised at the next ``save`` or ``close``.

        Returns what each save achieved: step -> tier (``"memory"``, ``"local"``,
        ``"remote"``) -> :class:`~dcp_tiered.policy.outcomes.SaveOutcome` (``state``: committed,
        skipped, failed or pending, with the ``reason``), for every step saved or skipped
        since the previous ``wait()`` and every step still pending then (an upload usually
        is: it is reported again until it is final). This process's view: the remote
        outcome is known to the processes that upload (every node's first rank; rank 0's
        is the commit), other ranks report no remote outcome."""
        for rec in list(self._in_flight):
            self._wait(rec)
        if self._replica is not None:
            self._replica.drain()
        self._reap()
        report = self._outcomes.steps(self._unreported)
        self._unreported = [
            step for step, tiers in report.items() if not all(o.done for o in tiers.values())
        ]
        return report

    def outcome(self, step: int) -> dict[str, SaveOutcome]:
        """What the save of ``step`` achieved on each tier so far (empty: never saved by this
        manager, or too long ago: the newest 1,024 steps are kept). Non-blocking; call
        :meth:`wait` or :meth:`close` first for final answers."""
        self._reap()
        return self._outcomes.of(step)

    def outcomes(self) -> dict[int, dict[str, SaveOutcome]]:
        """:meth:`outcome` of every step this manager saved or skipped, oldest first."""
        self._reap()
        return self._outcomes.steps()

    def _wait(self, rec: _InFlight) -> None:
        futures.wait([rec.future])  # without raising: _reap records its failure

    def _reap(self) -> None:
        """Collect finished saves and uploads: record failures, emit events, prune tiers."""
        finished = False
        for rec in [r for r in self._in_flight if r.future.done()]:
            self._in_flight.remove(rec)
            finished = True
            error = rec.future.exception()
            if error is not None and self._did_not_fit(error):
                self._skip_unfit(rec, error)
                continue
            if error is not None:
                self._fail(rec, rec.tier, error)
                continue
            rec.timings = (
                rec.future.result() if rec.tier == "memory" else self._local.pop_timings(rec.name)
            )
            self._outcomes.record(rec.step, [rec.tier], COMMITTED)
            if rec.timings.get("uploads"):  # this process promotes its node's copy
                self._uploading.append(rec)
            else:
                if rec.remote:  # another process uploads: its outcome is not known here
                    self._outcomes.forget(rec.step, "remote")
                self._emit(rec)
        for rec in list(self._uploading):
            # A follower node publishes (and enqueues its upload) just after the save returns.
            rec.upload = rec.upload or self._upload_future(rec)
            if rec.upload is None and time.time() - rec.started > self._local.commit_timeout_secs:
                self._uploading.remove(rec)
                self._fail(rec, "remote", TimeoutError("this node never published the step"))
                continue
            if rec.upload is None or not rec.upload.done():
                continue
            self._uploading.remove(rec)
            finished = True
            error = rec.upload.exception()
            if error is not None:
                self._fail(rec, "remote", error)
            else:
                self._outcomes.record(rec.step, ["remote"], COMMITTED)
                self._emit(rec)
        if finished:
            self._prune_in_background()

    def _did_not_fit(self, error: BaseException) -> bool:
        """A save the tier had no room for after all (the state grew past the estimate, or
        something else filled the disk): under ``when_full='skip'`` it is skipped, not failed."""
        return self.admission.when_full == "skip" and any(
            isinstance(c, InsufficientSpaceError) for c in causes(error)
        )

    def _skip_unfit(self, rec: _InFlight, error: BaseException) -> None:
        self.skipped_saves += 1
        tiers = [rec.tier] + (["remote"] if rec.remote else [])
        self._outcomes.record(rec.step, tiers, SKIPPED, describe(error))
        logger.warning(
            "step %d was not saved to the %s tier, which had no room for it after "
            "all (Admission.when_full='skip'; nothing of it was kept, earlier steps "
            "are intact): %s",
            rec.step,
            rec.tier,
            describe(error),
        )
        self._events.emit(
            "skipped", step=rec.step, tier=rec.tier, rank=self.rank, reason=describe(error)
        )

    def _upload_future(self, rec: _InFlight) -> Future[None] | None:
        """This rank's promotion of the step, if this rank's node leader is this process."""
        if self._remote is None:
            return None
        return uploads.uploader_for(self._local.local_tier, self._remote).future(rec.name)

    def _fail(self, rec: _InFlight, tier: str, error: BaseException) -> None:
        where = (
            self._remote.config.url
            if tier == "remote" and self._remote is not None
            else self._memory.root
            if tier == "memory" and self._memory is not None
            else self._local.root
        )
        self._failures.append(failure(self.rank, rec.name, tier, where, error))
        tiers = [tier] + (["remote"] if rec.remote and tier != "remote" else [])
        self._outcomes.record(rec.step, tiers, FAILED, describe(error))
        self._events.emit(
            "failed", step=rec.step, rank=self.rank, tier=tier, where=where, error=describe(error)
        )

    def _emit(self, rec: _InFlight) -> None:
        fields: dict[str, Any] = {
            "step": rec.step,
            "rank": self.rank,
            "tier": rec.tier,
            "remote": rec.remote,
            "bytes": rec.nbytes,
            "stall_s": round(rec.stall_s, 6),
            "stage_s": round(rec.stage_s, 6),
            "local_write_s": _round(rec.timings.get("write_s")),
            "commit_s": _round(rec.timings.get("commit_s")),
            "upload_s": None,
            "durable_at": None,
            "durable_after_s": None,
        }
        times = (
            uploads.uploader_for(self._local.local_tier, self._remote).times(rec.name)
            if rec.upload is not None and self._remote is not None
            else None
        )
        if times is not None:
            fields.update(
                upload_s=round(times[1] - times[0], 6),
                durable_at=round(times[1], 6),
                durable_after_s=round(times[1] - rec.started, 6),
            )
        self._events.emit("saved", **fields)

    # ------------------------------------------------------------ agreement across ranks

    def _raise_failures(self) -> None:
        mine, self._failures = self._failures, []
        raise_failures(
            self._agree,
            mine,
            "checkpoint failure(s) since the last save",
            "Earlier committed steps are intact; fix the cause and keep training, or restore",
        )

    # ------------------------------------------------------------ retention

    def _prune_in_background(self) -> None:
        if self._housekeeping is not None and not self._housekeeping.done():
            return  # the running pass will be followed by the next completion's
        self._housekeeping = self._housekeeper.submit(self._prune)

    def _prune(self) -> None:
        try:
            if self._local_keeper is not None:
                housekeeping.prune_local(
                    self._local.local_tier, self.retention.local, self._remote, label="local"
                )
            if self.rank == 0 and self._remote is not None and self.retention.remote is not None:
                housekeeping.prune_remote(self._remote, self.retention.remote, self.run_id)
        except Exception as e:  # noqa: BLE001 - a background pass: logged, retried later
            logger.warning("retention pass failed (retried after the next save): %s", e)

    # ------------------------------------------------------------ restore

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

        def load(candidate: tuple[str, str]) -> str | None:
            name, tier = candidate
            return (
                self._load_memory(name, app_state)
                if tier == "memory"
                else self._load_dcp(name, app_state)
            )

        if self._replica is not None:  # what every rank holds, for _candidates and load
            self._replica.survey()
        chosen = self._lifecycle.restore(
            lambda with_remote: self._candidates(step, self._remote if with_remote else None),
            load,
            on_unreadable_tier=on_unreadable_tier,
            retry="restore",
            name=lambda c: f"{c[0]} from the {c[1]} tier",
            abandon=self._abandon,
        )
        if chosen is None:
            self._report_lost(-1, None)
            if step is not None:
                raise CheckpointNotFoundError(f"step {step} is in no tier of this manager")
            return None
        name, tier = chosen
        number = layout.step_number(name)
        assert number is not None
        self._report_lost(number, f"{name} from the {tier} tier")
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

    def _report_lost(self, restored: int, what: str | None) -> None:
        """Warn (rank 0) about newer steps some rank had no copy of anywhere in memory."""
        snapshots.report_lost(self._replica, restored, what, rank=self.rank, emit=self._events.emit)

    def _abandon(self, proven: list[tuple[str, str]], chosen: tuple[str, str]) -> None:
        """Steps newer than the one restored and proven bad on disk are quarantined: training
        saves them again. (A memory snapshot is only ever skipped.)"""
        number = layout.step_number(chosen[0]) or -1
        newer = sorted(
            {n for n, t in proven if t != "memory" and (layout.step_number(n) or -1) > number}
        )
        self._lifecycle.quarantine(
            self._local.root, newer, reason=f"a restore fell back past it to {chosen[0]}"
        )

    def _load_dcp(self, name: str, app_state: dict[str, Any]) -> str | None:
        reader = TieredStorageReader(
            self._local.root,
            remote=self._remote.config if self._remote is not None else None,
            allow_pickle=self.allow_pickle,
        )
        try:
            dcp.load(
                self._loadable(app_state, reader, name),
                checkpoint_id=name,
                storage_reader=reader,
                planner=TieredLoadPlanner(reader=reader),
                process_group=self._save_pg,
            )
        except (CheckpointException, DcpTieredError) as e:  # DCP told every rank already
            return LoadFailure.of(e, describe(e))
        return None

    def _load_memory(self, name: str, app_state: dict[str, Any]) -> str | None:
        """This rank's own snapshot (ranks agree on the outcome in the restore loop), or with
        replication, a partner's copy when its own is missing or fails verification."""
        assert self._memory is not None
        return snapshots.load(self._memory, self._replica, name, app_state)

    def _candidates(self, step: int | None, remote: RemoteBackend | None) -> list[tuple[str, str]]:
        """(step name, tier) pairs to try, newest first, nearest tier first."""
        found: list[tuple[int, int, str, str]] = []
        order = {"memory": 0, "local": 1}
        # With replication: steps every rank can get from its own memory or a partner's copy.
        for name, committed_at in snapshots.candidates(self._memory, self._replica).items():
            found.append((layout.step_number(name) or -1, committed_at, name, "memory"))
        record = self._local.local_tier.record()
        for s in list_steps(self._local.local_tier, remote, strict=True):
            if record is not None and record.owner(s.run_id, s.name, s.save_id) == Owner.FOREIGN:
                continue  # another run's step: listed by `dcp-tiered ls`, never restored here
            found.append((layout.step_number(s.name) or -1, s.committed_at_ns, s.name, "local"))
        if step is not None:
            found = [f for f in found if f[2] == step_name(step)]
        found.sort(key=lambda f: (-f[0], order[f[3]], -f[1]))
        return [(name, tier) for _, _, name, tier in found if layout.step_number(name) is not None]

    def _loadable(
        self, app_state: dict[str, Any], reader: TieredStorageReader, name: str
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
                    self.rank,
                )
                del out[k]
        return out

    # ------------------------------------------------------------ shutdown and status

    def copies(self) -> dict[str, dict[str, Any]]:
        """Collective: where each step's copies are, newest first: ``memory`` (ranks holding it
        in their own memory), ``partners`` (rank -> the ranks on other nodes holding a copy of
        its snapshot), ``local`` (this node's disk) and ``remote``."""
        self.wait()
        survey = self._replica.survey() if self._replica is not None else None
        own = self._memory.steps() if self._memory is not None else {}
        mine = self._agree.gather(sorted(own))
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
        for s in list_steps(self._local.local_tier, self._remote):
            entry(s.name).update(local=s.local, remote=s.remote)
        return dict(sorted(out.items(), key=lambda kv: -(layout.step_number(kv[0]) or -1)))

    def close(self, timeout_secs: float | None = None) -> None:
        """Wait for in-flight saves, uploads and retention; raise SaveFailedError on every
        rank if any of them failed on any rank.

        Ranks poll together: as soon as any rank's save or upload fails, every rank raises,
        instead of some waiting for work that can no longer finish. ``timeout_secs`` bounds
        the wait for uploads; uploads still running then are reported as failures.
        """
        if self._closed:
            return
        self._closed = True
        deadline = None if timeout_secs is None else time.monotonic() + timeout_secs
        for rec in list(self._in_flight):
            self._wait(rec)
        if self._replica is not None:
            self._replica.drain(timeout_secs)
        try:
            while True:
                self._reap()
                if deadline is not None and time.monotonic() > deadline:
                    for rec in list(self._uploading):
                        self._uploading.remove(rec)
                        self._fail(
                            rec,
                            "remote",
                            TimeoutError(f"not durable after close(timeout_secs={timeout_secs})"),
                        )
                failed, pending = self._agree.vote(
                    [int(bool(self._failures)), int(bool(self._uploading))]
                )
                if failed:
                    self._raise_failures()
                if not pending:
                    break
                time.sleep(0.05)
            if self._housekeeping is not None:
                self._housekeeping.result()
            self._prune()
        finally:
            self._release()

    def _release(self) -> None:
        self._housekeeper.shutdown()
        if self._replica is not None:
            self._replica.close(0)
        if self._memory is not None:
            self._memory.close()
        self._lifecycle.release()  # close() above waited (bounded) already
        if self._local_keeper is not None:
            self._local.local_tier.backend.unlock(self._local_keeper)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolve(app_state: dict[str, Any]) -> dict[str, Any]:
    """``app_state`` with Stateful objects replaced by their state dicts (as DCP does)."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in app_state.items()}


def _refused_value(app_state: dict[str, Any]) -> str | None:
    """Why a value of ``app_state`` would not load back with ``weights_only`` (None: none)."""
    return first_refused(_resolve(app_state))


def _state_bytes(app_state: dict[str, Any]) -> int:
    """Tensor bytes of ``app_state`` on this rank."""
    return state_bytes(_resolve(app_state))


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 6)
