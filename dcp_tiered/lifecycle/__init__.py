"""The checkpoint lifecycle every entry point shares: save, agree, commit, fail, retain, restore.

:class:`~dcp_tiered.manager.CheckpointManager` and the framework adapters (DeepSpeed engine,
Megatron facade, HF wrapper) differ in how a step is named, which planner writes it, how the
framework's state is captured and applied, and which tracker file moves after a commit. What
happens around that is this module's, the same for all of them:

- saves in flight (one for the shims, ``max_in_flight`` for the manager), each with its hooks
  (:mod:`~dcp_tiered.lifecycle.saves`);
  :meth:`~dcp_tiered.lifecycle.finishing.Finishing.finish` (collective) waits for
  them and, if one failed on any rank for any reason (an existing step, a full disk, S3 down, DCP's
  ``CheckpointException``), raises :class:`SaveFailedError` on every rank at the same call,
  naming rank, step, tier and cause and saying what to do in the framework's own terms. Nothing
  of a failed save is kept, so the next save starts clean on every rank.
- after a commit, the adapter's ``on_commit`` (its tracker: ``latest``,
  ``latest_checkpointed_iteration.txt``, ``trainer_state.json``) runs on rank 0, and
  retention runs on each node root by the one process holding its lock. The remote tier keeps
  every step unless the adapter was given a remote policy; a step the remote lacks is never
  deleted.
- :meth:`Lifecycle.close` waits until every step saved here is durable on the remote tier and
  raises on every rank if one cannot get there.
- a state that saves must restore: unless the entry point was given ``allow_pickle=True``,
  :meth:`Lifecycle.require_restorable` (run by :meth:`Lifecycle.save`) refuses, on every rank,
  a state holding a value that ``weights_only`` loading would refuse, before anything is
  written.
- :meth:`Lifecycle.start` agrees on the run (:mod:`dcp_tiered.policy.identity`): the one the
  roots and the remote prefix record, else a new one; a root, prefix or memory directory of
  another run, or a root another job uses now, refuses the start on every rank.
- :meth:`~dcp_tiered.lifecycle.restore.Restoring.restore` tries candidates newest first, falls back past steps that fail on
  any rank, quarantines only those proven bad (``IntegrityError.proves_bad``), and refuses to start
  from scratch, or from an older step, when a tier cannot be read.

Every decision across ranks goes through :class:`~dcp_tiered.agreement.Agreement` (a gloo
group of its own, never the training group).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .. import _torch_compat, runs
from ..agreement import Agreement
from ..distributed import checkpoint_process_group
from ..errors import UploadFailedError
from ..planner import planner_for
from ..policy import identity, layout
from ..policy.retention import RetentionPolicy
from ..writer import SaveRequest, TieredStorageWriter
from .failures import (
    Conventions,
    advice,
    failure,
    raise_failures,
    raise_not_durable,
)
from .finishing import Finishing
from .reaping import Reaping
from .restorable import refuse_unrestorable, unrestorable
from .restore import (
    CORRUPT,
    OTHER,
    UNREADABLE,
    LoadFailure,
    Restoring,
    attempt,
    failure_kind,
    kind_of,
)
from .retention import Keepers
from .save_thread import SaveThread
from .saves import DISK, InFlight, Save, after, quiet_single_process, settled
from .writers import Writers

__all__ = [
    "CORRUPT",
    "OTHER",
    "UNREADABLE",
    "Conventions",
    "Lifecycle",
    "LoadFailure",
    "Save",
    "Writers",
    "advice",
    "attempt",
    "failure",
    "failure_kind",
    "kind_of",
    "quiet_single_process",
    "raise_failures",
    "settled",
]

logger = logging.getLogger(__name__)


class Lifecycle(Finishing, Reaping, Restoring):
    """Saves, commit hooks, failures, retention, durability and restore for one entry point.

    Construct on every rank, in the same order. ``retention`` applies to each local root a
    save went to; ``remote_retention`` to the remote tier (None: the remote keeps everything).
    ``publish_early``: rank 0 runs ``on_commit`` as soon as the step is committed, in the
    background, instead of at the next
    :meth:`~dcp_tiered.lifecycle.finishing.Finishing.finish`. ``allow_pickle``: the
    entry point restores non-tensor values with full pickle (checkpoints you trust), so any
    state saves; otherwise a state must load back with ``weights_only``, ``trusted_classes``
    allowed. ``max_in_flight``: how many saves to disk may be in flight at once
    (:meth:`~dcp_tiered.lifecycle.reaping.Reaping.make_room`).
    """

    def __init__(
        self,
        conventions: Conventions,
        *,
        remote: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        retention: RetentionPolicy | None = None,
        remote_retention: RetentionPolicy | None = None,
        publish_early: bool = True,
        writer_options: Mapping[str, Any] | None = None,
        collective_timeout_secs: float = 1800.0,
        allow_pickle: bool = False,
        trusted_classes: tuple[type, ...] = (),
        run_id: str | None = None,
        max_in_flight: int = 1,
    ) -> None:
        self.conventions = conventions
        self.allow_pickle, self.trusted_classes = allow_pickle, tuple(trusted_classes)
        options = dict(writer_options or {})
        if run_id is not None:
            options["run_id"] = identity.validate_run_id(run_id)
        self.writers = Writers(remote, storage_options, **options)
        self.run_id: str | None = None  # agreed by start()
        self.home: str | None = None  # the root start() was given
        self.group = checkpoint_process_group(collective_timeout_secs)  # DCP's collectives
        self.agree = Agreement(collective_timeout_secs)  # ours
        self.rank = _torch_compat.global_rank()
        self.publish_early = publish_early
        self.saves = InFlight(max_in_flight)
        self.failures: list[dict[str, Any]] = []  # this rank's, since the ranks last agreed
        self.listed: list[Any] = []  # the last restore's candidates, as every rank saw them
        self.passed_over: set[tuple[str, str]] = set()  # see Restoring.pass_over
        self._publisher: ThreadPoolExecutor | None = None  # made again after release()
        self._save_thread = SaveThread()  # likewise
        self.keepers = Keepers(
            self.writers, retention, remote_retention, rank=self.rank, label=conventions.local_tier
        )

    # What the keepers apply: an adapter may set them after construction (HF's save_total_limit).
    @property
    def retention(self) -> RetentionPolicy | None:
        return self.keepers.local

    @retention.setter
    def retention(self, policy: RetentionPolicy | None) -> None:
        self.keepers.local = policy

    @property
    def remote_retention(self) -> RetentionPolicy | None:
        return self.keepers.remote

    @remote_retention.setter
    def remote_retention(self, policy: RetentionPolicy | None) -> None:
        self.keepers.remote = policy

    def start(
        self, root: str | os.PathLike[str], *, memory: str | os.PathLike[str] | None = None
    ) -> TieredStorageWriter:
        """Collective, when an entry point starts: the writer of ``root``, recovered (crashed
        saves swept, uploads resumed, the remote checked), and the run every rank joins
        (``run_id``), recorded in ``root``, ``memory`` (a memory tier's directory) and the
        remote prefix. A failure on any rank, such as a remote with no such bucket or bad
        credentials, or a root, prefix or memory directory of another run, is raised on every
        rank, so no rank goes on to wait for the others at the next collective."""
        what = f"starting {self.conventions.framework} checkpoints in {os.path.abspath(root)}"
        try:
            writer = self.agree.everywhere(lambda: self.writers.get(root), what)
            tiers = self.writers.tiers(root)
            self.run_id = self.writers.run_id = runs.join(self.agree, tiers, writer, memory, what)
        except BaseException:
            self.release()  # this job does not hold the root it was refused
            raise
        self.home = os.path.abspath(root)
        return writer

    # ------------------------------------------------------------ saving

    def save(
        self,
        root: str,
        step: str,
        state: dict[str, Any],
        *,
        sync: bool,
        planner: Any = None,
        on_commit: Callable[[], Any] | None = None,
        values: dict[str, Any] | None = None,
    ) -> None:
        """Writes ``state`` as step ``root/step`` (``dcp.save`` or ``dcp.async_save`` on the
        checkpoint group). Finishes the saves in flight first; with ``sync``, this one too.
        ``values``: what to check with :meth:`require_restorable` instead of ``state``, when
        the state holds them already serialised (DeepSpeed's skeletons). Runs on the save
        thread while the caller waits (:mod:`~dcp_tiered.lifecycle.save_thread`: the
        trainer's heap stays its own)."""
        self._save_thread.run(
            self._save,
            root,
            step,
            state,
            sync=sync,
            planner=planner,
            on_commit=on_commit,
            values=values,
        )

    def _save(
        self,
        root: str,
        step: str,
        state: dict[str, Any],
        *,
        sync: bool,
        planner: Any,
        on_commit: Callable[[], Any] | None,
        values: dict[str, Any] | None,
    ) -> None:
        self.finish()
        layout.validate_step_name(step)
        self.require_restorable(step, state if values is None else values)
        writer = self.writers.get(root)
        single = not dist.is_initialized()
        planner = planner_for(writer) if planner is None else planner
        try:
            with quiet_single_process():
                if sync:
                    self.move_aside_passed_over(root, step)  # start_async does it otherwise
                    dcp.save(
                        state,
                        checkpoint_id=step,
                        storage_writer=writer,
                        planner=planner,
                        process_group=self.group,
                        no_dist=single,
                    )
                    future = settled()
                else:
                    future = self.start_async(state, step, writer, planner=planner)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - raised at finish
            future = settled(error=e)
        self.track(root, step, future, on_commit=on_commit)
        if sync:
            self.finish()

    def start_async(
        self,
        state: dict[str, Any],
        step: str,
        writer: TieredStorageWriter,
        *,
        planner: Any = None,
        promote: bool = True,
        let_go: Callable[[], None] | None = None,
    ) -> Future[Any]:
        """``dcp.async_save`` of ``state`` as ``step`` on the checkpoint group: returns once
        staged, with the future of this rank's write. ``promote=False``: the step stays on the
        local tier. ``let_go``: called once the staging copy is all that is left before this
        returns (the caller goes on beside it; the save fails if the state changed during
        it). Once the future ended, :meth:`~dcp_tiered.lifecycle.reaping.Reaping.reap` gives
        the save its :class:`~dcp_tiered.tiers.root.SaveReport`."""
        self.move_aside_passed_over(writer.root, step)
        check = None if let_go is None else writer.copy_beside(let_go)
        try:
            return self._async_save(state, SaveRequest(step, promote, check), writer, planner)
        finally:
            if check is not None:
                writer.copy_beside(None)  # unused where the save failed before its stage

    def _async_save(
        self, state: dict[str, Any], request: SaveRequest, writer: TieredStorageWriter, planner: Any
    ) -> Future[Any]:
        return _torch_compat.upload_future(
            dcp.async_save(
                state,
                checkpoint_id=request,
                storage_writer=writer,
                planner=planner_for(writer) if planner is None else planner,
                process_group=self.group,
                no_dist=not dist.is_initialized(),
            )
        )

    def require_restorable(self, step: str, values: dict[str, Any]) -> None:
        """Collective, before a save writes anything: unless ``allow_pickle``, raises
        ConfigError on every rank when a value of any rank's ``values`` would not load back
        with ``weights_only`` (it would save, and then never restore)."""
        why = None if self.allow_pickle else unrestorable(values, self.trusted_classes)
        checkpoint = f"{self.conventions.framework} checkpoint {step!r}"
        refuse_unrestorable(self.agree, checkpoint, why)

    def track(
        self,
        root: str,
        step: str,
        future: Future[Any],
        *,
        finalize: Callable[[], Any] | None = None,
        on_commit: Callable[[], Any] | None = None,
        on_failure: Callable[[], Any] | None = None,
        on_written: Callable[[Future[Any]], bool] | None = None,
        on_durable: Callable[[BaseException | None], None] | None = None,
        tier: str = DISK,
    ) -> Save:
        """Takes charge of a save started elsewhere (mcore's strategy, the manager):
        ``future`` ends when this rank's part is written; ``finalize`` then runs on every rank
        at :meth:`~dcp_tiered.lifecycle.finishing.Finishing.finish`, ``on_commit`` on
        rank 0 once committed, ``on_failure`` on every rank if it failed. ``on_written`` and
        ``on_durable`` run per rank at :meth:`~dcp_tiered.lifecycle.reaping.Reaping.reap`."""
        save = Save(
            os.path.abspath(root),
            step,
            future,
            finalize,
            on_commit,
            on_failure,
            on_written=on_written,
            on_durable=on_durable,
            tier=tier,
        )
        if self.publish_early and on_commit is not None and finalize is None and self.rank == 0:
            if self._publisher is None:
                self._publisher = ThreadPoolExecutor(1, thread_name_prefix="dcp-tiered-publish")
            save.published = self._publisher.submit(after, future, on_commit)
        self.saves.add(save)
        return save

    # ------------------------------------------------------------ retention and the end

    def keep(self, root: str) -> bool:
        """Takes ``root``'s retention lock now, if no process holds it: whether this one
        applies retention to it."""
        return self.keepers.hold(os.path.abspath(root))

    def prune(self, root: str) -> list[str]:
        """Retention of ``root`` by the one process holding its lock (one a node root), and of
        the remote tier by rank 0 when it has a policy. Failures are logged, not raised."""
        return self.keepers.prune(os.path.abspath(root))

    def settle_retention(self) -> None:
        """Waits for the background retention pass, then runs one more over the start root."""
        if self.home is not None:
            self.keepers.settle(self.home)

    def wait_durable(self, timeout_secs: float | None = None) -> None:
        """Collective: finishes the saves in flight, then waits until every step saved here is
        on the remote tier (no-op without one); raises on every rank if one is not."""
        self.finish()
        error: UploadFailedError | None = None
        for tiers, writer in self.writers.owned():
            if tiers.remote is not None and tiers.local.steps():
                try:
                    writer.wait_durable(timeout_secs=timeout_secs)
                except UploadFailedError as e:
                    error = error or e
        self._raise_upload_failure(error)

    def close(self, timeout_secs: float | None = None) -> None:
        """Collective, at the end of the job: finishes the last saves and waits (bounded by
        ``timeout_secs``) until every step is durable; raises on every rank if any rank's
        save or upload failed. The writers are released either way."""
        try:
            self.finish()
            error: UploadFailedError | None = None
            try:
                self.writers.close(timeout_secs)
            except UploadFailedError as e:
                error = e
            self._raise_upload_failure(error)
        finally:
            self.release()

    def release(self) -> None:
        """Frees threads, buffers and locks without waiting for anything but a retention pass
        under way."""
        if self._publisher is not None:
            self._publisher.shutdown(wait=False)
            self._publisher = None
        self._save_thread.close()
        self.keepers.release()
        self.writers.close(wait_durable=False)

    def _raise_upload_failure(self, error: UploadFailedError | None) -> None:
        if self.agree.any(error is not None):
            raise_not_durable(self.agree, self.conventions, self.rank, self.writers.remote, error)
