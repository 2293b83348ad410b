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
``BlockingAsyncStager``: ``_staging`` (AsyncStager) and ``_tiers`` (recovery, the run, durability).
Where it writes is a :class:`~dcp_tiered.tiers.root.Tiers` (built by the writer, or passed by
their owner); how, a frozen :class:`WriterConfig`. What one save asks comes with its
``checkpoint_id`` (a :class:`SaveRequest`); what it did goes to the tiers as one
:class:`~dcp_tiered.tiers.root.SaveReport`.
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

from .. import _gc, _torch_compat, metadata_broadcast
from .._collective_watch import CollectiveWatch
from .._priority import lower_this_thread
from ..backends.local import LocalBackend
from ..config import RemoteConfig
from ..errors import ConfigError
from ..policy import layout
from ..staging import DoubleBufferStager
from ..tiers import ownership
from ..tiers.root import SaveReport, Tiers
from . import _commit, _datafile, _describe, _plan
from ._config import CopyCheck, SaveRequest, WriterConfig
from ._plan import RankInfo, SaveFacts, SaveInfo
from ._plan import planned_bytes as _planned_bytes  # noqa: F401 (benchmarks/scale.py)
from ._staging import StagingRole
from ._tiers import TiersRole

logger = logging.getLogger(__name__)
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(WriterConfig))


class TieredStorageWriter(StagingRole, TiersRole, StorageWriter):
    """Writes DCP checkpoints as atomic, checksummed steps under ``root``.

    Args:
        root: directory of this run's steps on the node's local disk; each node may use its
            own. ``checkpoint_id`` passed to ``dcp.save``/``dcp.async_save`` names the step
            (a :class:`SaveRequest` also says whether the step goes to the remote tier). An
            owner of the root's tiers (the lifecycle) passes them, a
            :class:`~dcp_tiered.tiers.root.Tiers`, instead: they then stay its to close.
        config: how to write (:class:`WriterConfig`); or its fields as keyword arguments
            (``overwrite``, ``sync_files``, ``thread_count``, ...), not both.
        remote: an fsspec URL (``s3://bucket/run1``, ``file:///shared/run1``) or a
            :class:`RemoteConfig`. Committed steps are then copied there in the background;
            steps committed locally but not yet durable are re-enqueued by :meth:`recover`
            (which the first save runs).
        storage_options: fsspec options for ``remote`` (ignored with a RemoteConfig).
        run_id: this run's id (default: ``$DCP_TIERED_RUN_ID``, else the one ``root`` and the
            remote prefix record, else a new one recorded there at the first save). A root or
            prefix recording another run, or in use by another job, is refused with
            ForeignRunError. See :mod:`dcp_tiered.policy.identity`.
    """

    def __getattr__(self, name: str) -> Any:
        """The options the writer was built with, read as before :class:`WriterConfig` held
        them (``writer.thread_count``); read-only: a writer's config is fixed."""
        config = self.__dict__.get("config")  # absent while unpickling
        if config is not None and name in _CONFIG_FIELDS:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CONFIG_FIELDS:  # it would change nothing: the writer reads its config
            raise AttributeError(
                f"{name} is fixed when the writer is built: pass it to TieredStorageWriter(...)"
                " or WriterConfig(...)"
            )
        super().__setattr__(name, value)

    def __init__(
        self,
        root: str | os.PathLike[str] | Tiers,
        *,
        config: WriterConfig | None = None,
        remote: str | RemoteConfig | None = None,
        storage_options: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        if config is not None and options:
            raise ConfigError(f"pass config= or its fields ({', '.join(options)}), not both")
        self.config = config if config is not None else WriterConfig(**options)
        self._owns_tiers = not isinstance(root, Tiers)
        if isinstance(root, Tiers):
            if remote is not None or storage_options:
                raise ConfigError("the remote is the tiers' own: pass it to Tiers.open")
            self._tiers = root
        else:
            self._tiers = Tiers.open(root, remote, storage_options)
        self._stager: DoubleBufferStager | None = DoubleBufferStager(
            share_memory=self.config.staging_share_memory,
            timeout_secs=self.config.staging_timeout_secs,
        )
        self._save_ids: dict[str, str] = {}  # step -> id of this writer's last save of it
        # its plan caches' name (planner_for): its own, where an id may be a dead writer's
        self._plan_key = f"{self._tiers.root}@{uuid.uuid4().hex}"
        self._kept_metadata = _describe.KeptMetadata()  # the last .metadata, for the next
        self._step: str | None = None
        self._promote = True  # what the save being run asks (SaveRequest.promote)
        self._copy_check: CopyCheck | None = None  # ... and its copy_check
        self._free_bytes = 0  # free on this rank's root when it planned this save
        self._facts: SaveFacts | None = None  # the coordinator's, from prepare_global_plan
        self._save: SaveInfo | None = None  # the coordinator's, from write_data to finish
        self._report: SaveReport | None = None  # the coordinator's, from write_data to finish
        self._leading: tuple[str, int] | None = None  # (tmp dir, lock fd) until published
        self._watch: CollectiveWatch | None = None  # made by the process that saves
        self._coordinator, self._use_collectives = False, True
        explicit = run_id if run_id is not None else os.environ.get("DCP_TIERED_RUN_ID") or None
        self._run = ownership.RootRun(self._tiers.local.backend, self._tiers.remote, explicit)

    @property
    def root(self) -> str:
        return self._tiers.root

    @property
    def checkpoint_id(self) -> str | None:
        return self._step

    def __getstate__(self) -> dict[str, Any]:
        # PROCESS mode pickles the writer for every save: buffers, threads and lock
        # descriptors stay with the trainer process.
        state = self.__dict__.copy()
        state["_stager"] = None
        state.pop("_beside", None)  # the trainer's caller to let go, if any
        state["_leading"] = None
        state["_watch"] = None
        state["_kept_metadata"] = _describe.KeptMetadata()  # megabytes; one save's use
        return state

    def _watch_collective(self, phase: str | None) -> None:
        """The save enters DCP's collective ``phase`` (None: it left the last one)."""
        if self._watch is None:
            self._watch = CollectiveWatch(self.config.collective_timeout_warn_secs)
        if phase is None or self._step is None:
            self._watch.cancel()
        else:
            self._watch.arm(self._step, phase)

    def close(self, timeout_secs: float | None = None, *, wait_durable: bool = True) -> None:
        """Release this writer: its staging buffers and, if it built its tiers, the background
        uploads (an owner that passed them closes them itself).

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
        _gc.settle()  # the pause through the last save ends now, with its watcher thread
        self._run.release()  # this job no longer uses the root
        if self._owns_tiers:
            self._tiers.close(timeout_secs, wait_durable=wait_durable)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ StorageWriter

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never auto-selected: construct it with a root

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        _gc.hold_through_dcp_call()  # DCP's first call, where it is given a checkpoint_id
        self._wait_for_earlier_saves()
        self._promote, self._copy_check = True, None
        if isinstance(checkpoint_id, SaveRequest):
            self._step, self._promote = checkpoint_id.step, checkpoint_id.promote
            self._copy_check = checkpoint_id.copy_check
        elif checkpoint_id is not None:
            self._step = layout.validate_step_name(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        _gc.hold_through_dcp_call()  # the first hook of a save on every rank: see _gc
        self._wait_for_earlier_saves()
        return StorageMeta(checkpoint_id=self._step) if self._step else None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        _gc.hold_through_dcp_call()  # begun in storage_meta, unless DCP no longer calls it
        self._watch_collective(None)
        check, self._copy_check = self._copy_check, None  # this save's, and no later one's
        if check is not None and check.error is not None:
            # In DCP's planning step: the save fails on every rank, having written nothing
            raise check.error
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
        self._tiers.local.recover_and_sweep()
        if self._stager is not None:  # the trainer's writer, not a copy in DCP's subprocess
            self._tiers.hold_uploads()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        step = self._step
        assert step is not None
        tier = self._tiers.local
        _commit.check_target(tier, step, overwrite=self.config.overwrite, run_id=self._run.run_id)
        tier.backend.check_writable()
        # Measured before any rank writes this save (DCP scatters no plan before it has every
        # rank's), so every rank of a node judges the node's planned bytes against the same disk.
        self._free_bytes = tier.backend.free_bytes()
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
            out = _plan.lay_out(step, plans, self.config.free_space_margin_bytes)
        facts = SaveFacts(
            step=step,
            save_id=uuid.uuid4().hex[:12],
            promote=self._tiers.remote is not None and self._promote,
            run_id=self._run.decide(_plan.roots(plans, self._node_key(), self._run.run_id)),
        )
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
            self.config.free_space_margin_bytes,
            self.root,
        )
        return save

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._watch_collective(None)
        save = self._this_save(plan.storage_data)
        started = time.perf_counter()
        lower_this_thread()  # an async save's thread; the trainer's own thread is left alone
        config = self.config
        backend = self._tiers.local.backend
        backend.make_dir(save.tmp)
        lock = None
        try:
            lock = backend.lock_shared(save.tmp)
            with _gc.paused():  # a few objects per item, none in cycles: see _gc
                results = _datafile.write_items(
                    self._tiers,
                    save,
                    plan.items,
                    planner,
                    thread_count=config.thread_count,
                    sync=config.sync_files,
                )
        except BaseException:
            _datafile.abandon_tmp(backend, save, lock, config.thread_count)
            raise
        self._save_ids[save.step] = save.save_id
        while len(self._save_ids) > 1024:  # bounded, oldest first
            self._save_ids.pop(next(iter(self._save_ids)))
        report = SaveReport(
            save.step, time.perf_counter() - started, uploads=save.node_leader and save.promote
        )
        self._tiers.report(report)
        logger.debug(
            "rank %d wrote %d items of step %s to %s", save.rank, len(results), save.step, self.root
        )
        if save.node_leader and save.coordinator_node:
            self._leading = (save.tmp, lock)  # released once finish() has published
            self._save, self._report = save, report
        elif save.node_leader:
            _commit.follow(self._tiers, save, report, lock, config)
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
        try:
            self._finish(metadata, results)
        finally:
            # The coordinator's last hook. Other ranks' pause goes on through the broadcast of
            # the metadata (one object per item to unpickle) and ends as dcp.save returns.
            _gc.end_hold()

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self._save is not None and self._leading is not None and self._report is not None
        started = time.perf_counter()
        save, report, (_, lock) = self._save, self._report, self._leading
        self._save = self._report = None
        built, metadata_bytes = _describe.describe(
            save, metadata, results, kept=self._kept_metadata
        )
        try:
            _commit.coordinate(self._tiers.local, save, built, metadata_bytes, self.config)
        except BaseException:
            if not _commit.other_nodes(save):  # nothing published: leave no half step (the
                # next save's sweep would, but the disk needs room now)
                backend = self._tiers.local.backend
                _datafile.abandon_tmp(backend, save, lock, self.config.thread_count)
                self._leading = None
            raise
        self._leading = None
        LocalBackend.unlock(lock)
        metadata_broadcast.remember(metadata, metadata_bytes)  # what DCP broadcasts next
        report.commit_s = time.perf_counter() - started
        _commit.promote(self._tiers, save, report)
