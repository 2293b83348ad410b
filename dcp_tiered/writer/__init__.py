"""TieredStorageWriter: DCP's StorageWriter for an atomic, checksummed local tier.

Call order per save (see DCP's storage.py): every rank ``reset`` → ``storage_meta`` →
``set_up_storage_writer`` → ``prepare_local_plan``; rank 0 ``prepare_global_plan``; every rank
``write_data``; rank 0 ``finish``. The plans carry only where each rank sits (node, leader),
which stays true when DCP's plan caching replays a plan; what one save is (step, save id,
promotion) goes from the coordinator to every rank through the c10d store. The writer object
itself can thus be reused by every save and pickled for PROCESS mode.

This module holds that call sequence; the work is done by functions of private modules, one
job each: ``_plan`` (rank info, layouts, the checks before writing; no I/O), ``_datafile`` (the
data files), ``_describe`` (the manifest and DCP's ``.metadata``) and ``_commit`` (what a save
may replace, and publishing the step on every node). The public methods that are not DCP's call
sequence come from two roles the writer inherits, as DCP's ``FileSystemWriter`` inherits
``BlockingAsyncStager``: ``_staging`` (AsyncStager) and ``_tiers`` (recovery, the remote tier
outside a save, the uploads, durability).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future
from typing_extensions import Self  # a dependency of torch itself

from .. import _gc, _torch_compat
from .._collective_watch import CollectiveWatch
from .._priority import lower_this_thread
from ..backends.local import LocalBackend
from ..backends.remote import RemoteBackend, remote_backend
from ..config import RemoteConfig
from ..errors import ConfigError
from ..policy import layout
from ..staging import DoubleBufferStager
from ..tiers import ownership, uploads
from ..tiers.local import LocalTier
from . import _commit, _datafile, _describe, _plan
from ._plan import RankInfo, SaveFacts, SaveInfo
from ._plan import planned_bytes as _planned_bytes  # noqa: F401 (benchmarks/scale.py)
from ._staging import StagingRole
from ._tiers import TiersRole

logger = logging.getLogger(__name__)


class TieredStorageWriter(StagingRole, TiersRole, StorageWriter):
    """Writes DCP checkpoints as atomic, checksummed steps under ``root``.

    Args:
        root: directory of this run's steps on the node's local disk; each node may use its
            own. ``checkpoint_id`` passed to ``dcp.save``/``dcp.async_save`` names the step.
        overwrite: allow re-saving an existing step; the old one survives until the new one
            is committed.
        sync_files: fsync data, manifest and directories (turn off only for tests).
        thread_count: files (and threads) per rank; checksumming and torch.save framing are
            CPU-bound, so two threads keep up with a fast local disk.
        free_space_margin_bytes: headroom required beyond the planned bytes.
        staging_share_memory: stage into shared memory (saves a copy in PROCESS mode).
        staging_timeout_secs: how long staging waits for an earlier save to release buffers.
        commit_timeout_secs: how long nodes wait for each other during the commit.
        remote: an fsspec URL (``s3://bucket/run1``, ``file:///shared/run1``) or a
            :class:`RemoteConfig`. Committed steps are then copied there in the background;
            steps committed locally but not yet durable are re-enqueued by :meth:`recover`
            (which the first save runs).
        storage_options: fsspec options for ``remote`` (ignored with a RemoteConfig).
        collective_timeout_warn_secs: log one ERROR when a save has waited this long in one
            of DCP's collectives (the plan gather/scatter, or the final gather before
            ``finish``) because other ranks never joined: the sign of an ``async_save`` on the
            training process group. None disables the check.
        run_id: this run's id (default: ``$DCP_TIERED_RUN_ID``, else the one ``root`` and the
            remote prefix record, else a new one recorded there at the first save). A root or
            prefix recording another run, or in use by another job, is refused with
            ForeignRunError. See :mod:`dcp_tiered.policy.identity`.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        sync_files: bool = True,
        thread_count: int = 2,
        free_space_margin_bytes: int = 64 * 2**20,
        staging_share_memory: bool = False,
        staging_timeout_secs: float = 1800.0,
        commit_timeout_secs: float = 1800.0,
        remote: str | RemoteConfig | None = None,
        storage_options: Mapping[str, Any] | None = None,
        collective_timeout_warn_secs: float | None = 300.0,
        run_id: str | None = None,
    ) -> None:
        super().__init__()
        if collective_timeout_warn_secs is not None and not collective_timeout_warn_secs > 0:
            raise ConfigError(
                "collective_timeout_warn_secs must be > 0 (or None to disable), "
                f"got {collective_timeout_warn_secs}"
            )
        if thread_count < 1:
            raise ConfigError(f"thread_count must be >= 1, got {thread_count}")
        if free_space_margin_bytes < 0:
            raise ConfigError("free_space_margin_bytes must be >= 0")
        self._tier = LocalTier(LocalBackend(root))
        self.overwrite = overwrite
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.free_space_margin_bytes = free_space_margin_bytes
        self.commit_timeout_secs = commit_timeout_secs
        self._stager = DoubleBufferStager(
            share_memory=staging_share_memory, timeout_secs=staging_timeout_secs
        )
        # Steps saved here but not promoted to the remote tier (see keep_local).
        self.local_only_steps: set[str] = set()
        self._timings: dict[str, dict[str, float]] = {}
        self._save_ids: dict[str, str] = {}  # step -> id of this writer's last save of it
        self._kept_metadata = _describe.KeptMetadata()  # the last .metadata, for the next
        self._step: str | None = None
        self._free_bytes = 0  # free on this rank's root when it planned this save
        self._facts: SaveFacts | None = None  # the coordinator's, from prepare_global_plan
        self._save: SaveInfo | None = None  # the coordinator's, from write_data to finish
        self._leading: tuple[str, int] | None = None  # (tmp dir, lock fd) until published
        self._remote = remote_backend(remote, storage_options)
        self._uploader: uploads.Uploader | None = None  # this writer's hold on the uploads
        self.collective_timeout_warn_secs = collective_timeout_warn_secs
        self._watch: CollectiveWatch | None = None  # made by the process that saves
        self._coordinator, self._use_collectives = False, True
        self._remote_checked = False  # recover() checks the remote once
        explicit = run_id if run_id is not None else os.environ.get("DCP_TIERED_RUN_ID") or None
        self._run = ownership.RootRun(self._tier.backend, self._remote, explicit)

    @property
    def root(self) -> str:
        return self._tier.root

    @property
    def checkpoint_id(self) -> str | None:
        return self._step

    @property
    def local_tier(self) -> LocalTier:
        return self._tier

    @property
    def remote_backend(self) -> RemoteBackend | None:
        return self._remote

    def __getstate__(self) -> dict[str, Any]:
        # PROCESS mode pickles the writer for every save: buffers, threads and lock
        # descriptors stay with the trainer process.
        state = self.__dict__.copy()
        state["_stager"] = None
        state["_leading"] = None
        state["_uploader"] = None
        state["_watch"] = None
        state["_kept_metadata"] = _describe.KeptMetadata()  # megabytes; one save's use
        return state

    def _watch_collective(self, phase: str | None) -> None:
        """The save enters DCP's collective ``phase`` (None: it left the last one)."""
        if self._watch is None:
            self._watch = CollectiveWatch(self.collective_timeout_warn_secs)
        if phase is None or self._step is None:
            self._watch.cancel()
        else:
            self._watch.arm(self._step, phase)

    def keep_local(self, step: str) -> None:
        """Do not copy ``step`` to the remote tier when it is saved (decided by rank 0)."""
        self.local_only_steps.add(layout.validate_step_name(step))

    def pop_timings(self, step: str) -> dict[str, float]:
        """Seconds this rank spent writing (``write_s``) and, on the coordinator, committing
        (``commit_s``) ``step``, and whether this process promotes it (``uploads``: 1.0);
        empty once read or if the save ran in another process."""
        return self._timings.pop(step, {})

    def _record_timing(self, step: str, **secs: float) -> None:
        self._timings.setdefault(step, {}).update(secs)
        while len(self._timings) > 64:  # nobody reads them without a manager: stay bounded
            self._timings.pop(next(iter(self._timings)))

    def close(self, timeout_secs: float | None = None, *, wait_durable: bool = True) -> None:
        """Release this writer: its staging buffers, and its hold on the background uploads.

        With a remote tier it first waits until every step this process enqueued is durable
        there, at most ``timeout_secs`` (default: the remote's ``durable_timeout_secs``), and
        raises UploadFailedError naming each step that is not, and why. Such steps stay
        committed locally; the next writer on this root resumes their upload. With
        ``wait_durable=False`` it returns at once and the uploads go on in the background (at
        exit, what is unfinished is abandoned with one warning). Closing twice is harmless.
        """
        if self._stager is not None:
            self._stager.close()
        if self._watch is not None:
            self._watch.cancel()
        self._run.release()  # this job no longer uses the root
        self._release_uploads(timeout_secs, wait_durable)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ StorageWriter

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never auto-selected: construct it with a root

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._wait_for_earlier_saves()
        if checkpoint_id is not None:
            self._step = layout.validate_step_name(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        self._wait_for_earlier_saves()
        return StorageMeta(checkpoint_id=self._step) if self._step else None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._watch_collective(None)
        self._coordinator = is_coordinator
        self._use_collectives = kwargs.get("use_collectives", True)
        self._begin_save()
        if is_coordinator and self._run.run_id is None:  # a root that records no run yet
            self._run.learn_remote()
        self._facts = self._save = None
        if self._step is None:
            raise ConfigError(
                "no step name: pass checkpoint_id='step-N' to dcp.save/dcp.async_save"
            )

    def _begin_save(self) -> None:
        self._wait_for_earlier_saves()
        if self._leading is not None:  # the previous save we led never reached finish()
            LocalBackend.unlock(self._leading[1])
            self._leading = None
        self._run.start(hold=self._stager is not None)
        # Every earlier save of this process is over, so unlocked leftovers are abandoned.
        self._tier.recover_and_sweep()
        if self._stager is not None:  # the trainer's writer, not a copy in DCP's subprocess
            self._hold_uploads()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        step = self._step
        assert step is not None
        _commit.check_target(self._tier, step, overwrite=self.overwrite, run_id=self._run.run_id)
        self._tier.backend.check_writable()
        # Measured before any rank writes this save (DCP scatters no plan before it has every
        # rank's), so every rank of a node judges the node's planned bytes against the same disk.
        self._free_bytes = self._tier.backend.free_bytes()
        planned = plan
        if getattr(plan, "usable", True):  # an unusable plan: DCP replays the cached one
            info = RankInfo(
                node_key=self._node_key(),
                root=self.root,
                step=step,
                free_bytes=self._free_bytes,
                run_id=self._run.run_id,
            )
            planned = dataclasses.replace(plan, storage_data=info)
        if self._use_collectives:
            self._watch_collective(
                "the plan gather (every rank's local plan to the coordinator)"
                if self._coordinator
                else "the plan gather/scatter (this rank's plan to the "
                "coordinator and its global plan back)"
            )
        return planned

    def _node_key(self) -> str:
        return f"{socket.gethostname()}:{self.root}"

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        step = self._step
        assert step is not None
        out = plans  # with DCP's plan caching and no change: every rank replays its final plan
        if any(getattr(p, "usable", True) for p in plans):
            out = _plan.lay_out(step, plans, self.free_space_margin_bytes)
        facts = SaveFacts(
            step=step,
            save_id=uuid.uuid4().hex[:12],
            promote=self._remote is not None and step not in self.local_only_steps,
            run_id=self._run.decide(_plan.roots(plans, self._node_key(), self._run.run_id)),
        )
        self.local_only_steps.discard(step)
        if len(plans) > 1:
            store = _torch_compat.default_store()
            if store is None:
                raise ConfigError("a save on several ranks needs torch.distributed initialised")
            store.set(_plan.facts_key(_torch_compat.global_rank()), facts.encode())
        self._facts = facts
        if self._use_collectives:
            self._watch_collective("the plan scatter (the global plan to every rank)")
        return out

    def _this_save(self, plan_data: Any) -> SaveInfo:
        """This rank's save: its layout from the (possibly replayed) plan, the save's facts from
        the coordinator, both checked before anything is written."""
        lay = _plan.layout_of(plan_data, self._step)
        facts = self._facts
        if facts is None:  # not the coordinator: it set them before DCP scattered the plan
            store = _torch_compat.default_store()
            if store is None:
                raise ConfigError("a save on several ranks needs torch.distributed initialised")
            facts = SaveFacts.decode(bytes(store.get(_plan.facts_key(lay.coordinator))))
        save = SaveInfo(lay, facts)
        if self._run.recorded != facts.run_id:
            self._run.join(facts.run_id)  # a new run, or a root joining the run of the others
        _plan.check_save(
            save,
            self._step,
            self._node_key(),
            self._free_bytes,
            self.free_space_margin_bytes,
            self.root,
        )
        return save

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._watch_collective(None)
        save = self._this_save(plan.storage_data)
        started = time.perf_counter()
        lower_this_thread()  # an async save's thread; the trainer's own thread is left alone
        backend = self._tier.backend
        backend.make_dir(save.tmp)
        lock = None
        try:
            lock = backend.lock_shared(save.tmp)
            with _gc.paused():  # a few objects per item, none in cycles: see _gc
                results = _datafile.write_items(
                    self._tier,
                    self._remote,
                    save,
                    plan.items,
                    planner,
                    thread_count=self.thread_count,
                    sync=self.sync_files,
                )
        except BaseException:
            _datafile.abandon_tmp(backend, save, lock, self.thread_count)
            raise
        self.local_only_steps.discard(save.step)
        self._save_ids[save.step] = save.save_id
        while len(self._save_ids) > 1024:  # bounded, oldest first
            self._save_ids.pop(next(iter(self._save_ids)))
        self._record_timing(
            save.step,
            write_s=time.perf_counter() - started,
            uploads=float(save.node_leader and save.promote),
        )
        logger.debug(
            "rank %d wrote %d items of step %s to %s", save.rank, len(results), save.step, self.root
        )
        if save.node_leader and save.coordinator_node:
            self._leading = (save.tmp, lock)  # released once finish() has published
            self._save = save
        elif save.node_leader:
            _commit.follow(
                self._tier,
                self._remote,
                save,
                lock,
                overwrite=self.overwrite,
                sync=self.sync_files,
                timeout_secs=self.commit_timeout_secs,
            )
        else:
            LocalBackend.unlock(lock)
        if self._use_collectives:
            self._watch_collective(
                "the final gather of write results before finish"
                if self._coordinator
                else "the final gather of write results (and the coordinator's finish)"
            )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self._watch_collective(None)
        assert self._save is not None and self._leading is not None
        started = time.perf_counter()
        save, (_, lock) = self._save, self._leading
        self._save = None
        built, metadata_bytes = _describe.describe(
            save, metadata, results, kept=self._kept_metadata
        )
        try:
            _commit.coordinate(
                self._tier,
                save,
                built,
                metadata_bytes,
                overwrite=self.overwrite,
                sync=self.sync_files,
                timeout_secs=self.commit_timeout_secs,
            )
        except BaseException:
            if not _commit.other_nodes(save):  # nothing published: leave no half step (the
                # next save's sweep would, but the disk needs room now)
                _datafile.abandon_tmp(self._tier.backend, save, lock, self.thread_count)
                self._leading = None
            raise
        self._leading = None
        LocalBackend.unlock(lock)
        self._record_timing(save.step, commit_s=time.perf_counter() - started)
        _commit.promote(self._tier, self._remote, save)
