"""The checkpoint lifecycle every entry point shares: save, agree, commit, fail, retain, restore.

:class:`~dcp_tiered.manager.CheckpointManager` and the framework adapters (DeepSpeed engine,
Megatron facade, HF wrapper) differ in how a step is named, which planner writes it, how the
framework's state is captured and applied, and which tracker file moves after a commit. What
happens around that is this module's, the same for all of them:

- one save in flight; :meth:`Lifecycle.finish` (collective) waits for it and, if it failed on
  any rank for any reason (an existing step, a full disk, S3 down, DCP's
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
- :meth:`Lifecycle.restore` tries candidates newest first, falls back past steps that fail on
  any rank, quarantines only those proven bad (``IntegrityError.proves_bad``), and refuses to start
  from scratch, or from an older step, when a tier cannot be read.

Every decision across ranks goes through :class:`~dcp_tiered.agreement.Agreement` (a gloo
group of its own, never the training group).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from . import _torch_compat, runs
from .agreement import Agreement
from .backends.local import LocalBackend
from .backends.remote import remote_backend
from .distributed import checkpoint_process_group
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    ForeignPathError,
    InsufficientSpaceError,
    IntegrityError,
    SaveFailedError,
    TierError,
    TierUnavailableError,
    UploadFailedError,
    causes,
    describe,
)
from .planner import planner_for
from .policy import identity, layout
from .policy.memory_format import first_refused
from .policy.retention import RetentionPolicy
from .tiers.housekeeping import prune_local, prune_remote
from .tiers.local import LocalTier
from .tiers.remote import quarantine_remote_step
from .writer import TieredStorageWriter

logger = logging.getLogger(__name__)

C = TypeVar("C")


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


class Writers:
    """One :class:`TieredStorageWriter` per root, kept: staging buffers are reused save after
    save. A writer is recovered (crashed saves swept, unfinished uploads resumed) when first
    used, as an explicit step, not as a side effect of building it."""

    def __init__(
        self, remote: Any = None, storage_options: Mapping[str, Any] | None = None, **options: Any
    ) -> None:
        self.remote, self.storage_options, self.options = remote, storage_options, options
        self._writers: dict[str, TieredStorageWriter] = {}
        self.run_id: str | None = None  # the run every root of these writers records

    def get(self, root: str | os.PathLike[str]) -> TieredStorageWriter:
        root = os.path.abspath(root)
        if root not in self._writers:
            writer = TieredStorageWriter(
                root, remote=self.remote, storage_options=self.storage_options, **self.options
            )
            writer.recover()
            # A root the run saves to later (a shim's root per checkpoint) joins the run: the
            # one agreed at start, else the one the earlier roots' saves decided.
            run = self.run_id or next((w.run_id for w in self._writers.values() if w.run_id), None)
            if run is not None:
                writer.join_run(run)
            self._writers[root] = writer
        return self._writers[root]

    def __iter__(self) -> Any:
        return iter(list(self._writers.values()))

    def close(self, timeout_secs: float | None = None, *, wait_durable: bool = True) -> None:
        """Closes every writer; with ``wait_durable``, raises UploadFailedError naming the
        steps that did not become durable (after closing them all)."""
        writers, self._writers = list(self._writers.values()), {}
        error: UploadFailedError | None = None
        for writer in writers:
            try:
                writer.close(timeout_secs, wait_durable=wait_durable)
            except UploadFailedError as e:
                error = error or e
        if error is not None:
            raise error


@dataclass
class _Save:
    root: str
    step: str
    future: Future[Any]
    finalize: Callable[[], Any] | None  # every rank, once written (mcore's finalize fns)
    on_commit: Callable[[], Any] | None  # rank 0, once committed (the framework's tracker)
    on_failure: Callable[[], Any] | None  # every rank, when it failed on any (clean-up)
    published: Future[Any] | None = None  # rank 0: on_commit run in the background


class Lifecycle:
    """Saves, commit hooks, failures, retention, durability and restore for one entry point.

    Construct on every rank, in the same order. ``retention`` applies to each local root a
    save went to; ``remote_retention`` to the remote tier (None: the remote keeps everything).
    ``publish_early``: rank 0 runs ``on_commit`` as soon as the step is committed, in the
    background, instead of at the next :meth:`finish`. ``allow_pickle``: the entry point
    restores non-tensor values with full pickle (checkpoints you trust), so any state saves;
    otherwise a state must load back with ``weights_only``, ``trusted_classes`` allowed.
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
    ) -> None:
        self.conventions = conventions
        self.allow_pickle, self.trusted_classes = allow_pickle, tuple(trusted_classes)
        options = dict(writer_options or {})
        if run_id is not None:
            options["run_id"] = identity.validate_run_id(run_id)
        self.writers = Writers(remote, storage_options, **options)
        self.run_id: str | None = None  # agreed by start()
        self.retention, self.remote_retention = retention, remote_retention
        self.group = checkpoint_process_group(collective_timeout_secs)  # DCP's collectives
        self.agree = Agreement(collective_timeout_secs)  # ours
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.publish_early = publish_early
        self._inflight: _Save | None = None
        self.listed: list[Any] = []  # the last restore's candidates, as every rank saw them
        self._publisher: ThreadPoolExecutor | None = None  # made again after release()
        # root -> (its backend, the retention lock if this process holds it)
        self._keepers: dict[str, tuple[LocalBackend, int | None]] = {}

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
            self.run_id = self.writers.run_id = runs.join(self.agree, writer, memory, what)
        except BaseException:
            self.release()  # this job does not hold the root it was refused
            raise
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
        checkpoint group). Finishes the save in flight first; with ``sync``, this one too.
        ``values``: what to check with :meth:`require_restorable` instead of ``state``, when
        the state holds them already serialised (DeepSpeed's skeletons)."""
        self.finish()
        layout.validate_step_name(step)
        self.require_restorable(step, state if values is None else values)
        writer = self.writers.get(root)
        single = not dist.is_initialized()
        planner = planner_for(writer) if planner is None else planner
        try:
            with quiet_single_process():
                if sync:
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
                    future = _torch_compat.upload_future(
                        dcp.async_save(
                            state,
                            checkpoint_id=step,
                            storage_writer=writer,
                            planner=planner,
                            process_group=self.group,
                            no_dist=single,
                        )
                    )
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - raised at finish
            future = settled(error=e)
        self.track(root, step, future, on_commit=on_commit)
        if sync:
            self.finish()

    def require_restorable(self, step: str, values: dict[str, Any]) -> None:
        """Collective, before a save writes anything: unless ``allow_pickle``, raises
        ConfigError on every rank when a value of any rank's ``values`` would not load back
        with ``weights_only`` (it would save, and then never restore)."""
        why = None if self.allow_pickle else first_refused(values, self.trusted_classes)
        if not self.agree.any(why is not None):
            return
        rank, why = next((r, w) for r, w in enumerate(self.agree.gather(why)) if w)
        raise ConfigError(
            f"{self.conventions.framework} checkpoint {step!r} was not saved: on rank {rank}, "
            f"{why}, so it could never be restored. Keep tensors, numbers, strings, lists and "
            "dicts in the state, or pass allow_pickle=True only for checkpoints you trust "
            "(non-tensor values then load with full pickle, which can run code)."
        )

    def track(
        self,
        root: str,
        step: str,
        future: Future[Any],
        *,
        finalize: Callable[[], Any] | None = None,
        on_commit: Callable[[], Any] | None = None,
        on_failure: Callable[[], Any] | None = None,
    ) -> None:
        """Takes charge of a save started elsewhere (mcore's strategy): ``future`` ends when
        this rank's part is written; ``finalize`` then runs on every rank at :meth:`finish`,
        ``on_commit`` on rank 0 once committed, ``on_failure`` on every rank if it failed."""
        record = _Save(os.path.abspath(root), step, future, finalize, on_commit, on_failure)
        if self.publish_early and on_commit is not None and finalize is None and self.rank == 0:
            if self._publisher is None:
                self._publisher = ThreadPoolExecutor(1, thread_name_prefix="dcp-tiered-publish")
            record.published = self._publisher.submit(_after, future, on_commit)
        self._inflight = record

    @property
    def in_flight(self) -> str | None:
        return self._inflight.step if self._inflight is not None else None

    def written(self) -> bool:
        """Collective: whether every rank's part of the save in flight is written."""
        record = self._inflight
        return self.agree.all(record is None or record.future.done())

    def finish(self) -> str | None:
        """Collective: finishes the save in flight; returns its step, or None if there was
        none. Raises SaveFailedError on every rank if it failed on any."""
        record, self._inflight = self._inflight, None
        if not self.agree.any(record is not None):
            return None
        assert record is not None  # every rank has the same save in flight
        error: BaseException | None = None
        try:
            record.future.result()
            if record.finalize is not None:
                record.finalize()
            if self.rank == 0 and record.on_commit is not None:
                (record.published.result() if record.published is not None else record.on_commit())
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
            error = e
        if self.agree.any(error is not None):
            if record.on_failure is not None:
                try:
                    record.on_failure()
                except Exception as e:  # noqa: BLE001 - the save's own error matters more
                    logger.warning("cleaning up after the failed save of %s: %s", record.step, e)
            self._fail(record, error)
        self.prune(record.root)
        return record.step

    def _fail(self, record: _Save, error: BaseException | None) -> None:
        mine = (
            []
            if error is None
            else [
                failure(
                    self.rank, record.step, "local", os.path.join(record.root, record.step), error
                )
            ]
        )
        todo = (
            f"{self.conventions.kept}; "
            f"{advice([error] if error is not None else [], self.conventions)}"
        )
        # The advice of the rank that failed, on every rank.
        todo = next((t for t in self.agree.gather(todo if error is not None else None) if t), todo)
        raise_failures(
            self.agree,
            mine,
            f"{self.conventions.framework} checkpoint {record.step!r} in "
            f"{record.root} was not saved",
            todo,
        )

    # ------------------------------------------------------------ retention and the end

    def prune(self, root: str) -> list[str]:
        """Retention of ``root`` by the one process holding its lock (one a node root), and of
        the remote tier by rank 0 when it has a policy. Failures are logged, not raised."""
        deleted: list[str] = []
        if self.retention is None:
            return deleted
        writer = self.writers.get(root)
        backend = writer.local_tier.backend
        if root not in self._keepers:
            self._keepers[root] = (backend, backend.try_lock_exclusive(layout.RETENTION_LOCK_NAME))
        try:
            if self._keepers[root][1] is not None:
                deleted = prune_local(
                    writer.local_tier,
                    self.retention,
                    writer.remote_backend,
                    label=self.conventions.local_tier,
                )
            if self.rank == 0 and self.remote_retention is not None and writer.remote_backend:
                deleted += prune_remote(writer.remote_backend, self.remote_retention, writer.run_id)
        except Exception as e:  # noqa: BLE001 - retried after the next save
            logger.warning("retention pass of %s failed (retried after the next save): %s", root, e)
        return deleted

    def wait_durable(self, timeout_secs: float | None = None) -> None:
        """Collective: finishes the save in flight, then waits until every step saved here is
        on the remote tier (no-op without one); raises on every rank if one is not."""
        self.finish()
        error: UploadFailedError | None = None
        for writer in self.writers:
            if writer.remote_backend is not None and writer.local_tier.steps():
                try:
                    writer.wait_durable(timeout_secs=timeout_secs)
                except UploadFailedError as e:
                    error = error or e
        self._raise_upload_failure(error)

    def close(self, timeout_secs: float | None = None) -> None:
        """Collective, at the end of the job: finishes the last save and waits (bounded by
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
        """Frees threads, buffers and locks without waiting for anything."""
        if self._publisher is not None:
            self._publisher.shutdown(wait=False)
            self._publisher = None
        self.writers.close(wait_durable=False)
        keepers, self._keepers = list(self._keepers.values()), {}
        for backend, lock in keepers:
            if lock is not None:
                backend.unlock(lock)

    def _raise_upload_failure(self, error: UploadFailedError | None) -> None:
        if self.agree.any(error is not None):
            mine = (
                []
                if error is None
                else [failure(self.rank, "-", "remote", str(self.writers.remote), error)]
            )
            raise_failures(
                self.agree,
                mine,
                f"{self.conventions.framework}: not every step became durable on the remote tier",
                "the steps are committed locally; the next job on this root resumes their upload",
            )

    # ------------------------------------------------------------ restore

    def restore(
        self,
        candidates: Callable[[bool], list[C]],
        load: Callable[[C], str | None],
        *,
        on_unreadable_tier: str,
        retry: str,
        name: Callable[[C], str] = str,
        abandon: Callable[[list[C], C], None] | None = None,
    ) -> C | None:
        """Collective: the first candidate ``load`` loads on every rank, or None if there
        are none.

        ``candidates(with_remote)`` lists them newest first (rank 0 alone; every rank tries
        the same ones); it raises TierUnavailableError when the remote cannot be read, which
        is raised on every rank unless ``on_unreadable_tier="skip"``. ``load`` returns
        None or why it failed (a :class:`LoadFailure`, as :func:`attempt` makes, says what
        kind of failure); ranks agree, so one rank's failure moves all to the next. A candidate
        a tier could not be read for (a transient error, a timeout) raises TierUnavailableError
        on every rank, like an unreadable listing, unless ``on_unreadable_tier="skip"``: a
        newer step may be fine. ``retry`` is the call that skips an unreadable tier, for the
        message. After falling back, ``abandon(proven, chosen)`` runs on every rank with the
        candidates some rank proved bad (``IntegrityError.proves_bad``), and only those (see
        :meth:`quarantine`).
        """
        if on_unreadable_tier not in ("raise", "skip"):
            raise ConfigError(
                f"on_unreadable_tier must be 'raise' or 'skip', not {on_unreadable_tier!r}"
            )

        def listing() -> tuple[list[C], str | None]:
            try:
                return candidates(True), None
            except TierUnavailableError as e:
                return (candidates(False) if on_unreadable_tier == "skip" else []), str(e)

        found, unreadable = self.agree.from_rank0(listing)
        self.listed = found
        if unreadable is not None:
            if on_unreadable_tier == "raise":
                raise TierUnavailableError(
                    f"{unreadable}. To restore from the tiers that can be read instead, call "
                    f"{retry}(..., on_unreadable_tier='skip')."
                )
            logger.error(
                "%s; restoring from the other tiers (on_unreadable_tier='skip')", unreadable
            )
        reasons: list[str] = []
        proven: list[C] = []
        for candidate in found:
            problem = load(candidate)
            if not self.agree.any(problem is not None):
                if proven and abandon is not None:
                    abandon(proven, candidate)
                return candidate
            kinds = {k for k in self.agree.gather(failure_kind(problem)) if k}
            problem = problem or "failed on another rank"
            reasons.append(f"{name(candidate)}: {problem}")
            if UNREADABLE in kinds and on_unreadable_tier == "raise":
                raise TierUnavailableError(
                    f"{name(candidate)} could not be read now ({problem}); an older step is not "
                    f"restored in its place while it may be fine. Restore again once the tier "
                    f"answers, or call {retry}(..., on_unreadable_tier='skip') to restore an "
                    "older step instead (nothing is quarantined for it)."
                )
            if CORRUPT in kinds:
                proven.append(candidate)
            logger.warning(
                "cannot restore %s, trying an older step (%s): %s",
                name(candidate),
                "proven bad" if CORRUPT in kinds else "kept as it is: not proven bad",
                problem,
            )
        if reasons:
            raise CheckpointNotFoundError(
                "no step could be restored; every candidate failed:\n  " + "\n  ".join(reasons)
            )
        return None

    def quarantine(self, root: str, steps: list[str], *, reason: str) -> None:
        """Collective: move ``steps`` (proven bad) aside on every node's ``root`` (one process a
        node) and on the remote tier (rank 0), under names of ours, logged, never deleted, and
        only where they are this run's (another run's step is left as it is, with a WARNING).
        Training that restored an older step saves those step names again; ``latest``,
        retention and the remote's never-overwrite rule then see only the new saves.
        ``dcp-tiered quarantine --release`` undoes it."""
        if not steps:
            return
        tier, run_id = LocalTier(LocalBackend(root)), self.run_id

        def each(act: Callable[[str], Any]) -> None:
            for step in steps:
                try:
                    act(step)
                except ForeignPathError as e:
                    logger.warning("not quarantining %s: %s", step, e)

        self.agree.by_node_leaders(
            lambda: each(lambda step: tier.quarantine(step, reason=reason, run_id=run_id)),
            f"quarantining {', '.join(steps)} in {root}",
        )
        remote = remote_backend(self.writers.remote, self.writers.storage_options)
        if remote is not None:
            self.agree.from_rank0(
                lambda: each(
                    lambda step: quarantine_remote_step(remote, step, reason=reason, run_id=run_id)
                )
            )


CORRUPT, UNREADABLE, OTHER = "corrupt", "unreadable", "other"


class LoadFailure(str):
    """Why a candidate failed to load (the text), and what kind of failure it was: ``corrupt``
    (proof the step is bad: ``IntegrityError.proves_bad``), ``unreadable`` (a tier could not be
    read now) or ``other`` (the state does not fit it, ...)."""

    kind: str = OTHER

    @classmethod
    def of(cls, error: BaseException, why: str) -> LoadFailure:
        failure = cls(why)
        failure.kind = kind_of(error)
        return failure


def kind_of(error: BaseException) -> str:
    """The kind of a load's failure (see :class:`LoadFailure`), from every rank's cause."""
    found = causes(error)
    if any(isinstance(c, (TierError, TimeoutError, ConnectionError)) for c in found):
        return UNREADABLE
    if any(isinstance(c, IntegrityError) and c.proves_bad for c in found):
        return CORRUPT
    return OTHER


def failure_kind(problem: str | None) -> str | None:
    return None if problem is None else getattr(problem, "kind", OTHER)


def attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
    """``(fn(...), None)``, or ``(None, why)`` if it raised (a :class:`LoadFailure`): ranks
    then agree on moving on."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        return fn(*args, **kwargs), None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
        why = describe(e) if isinstance(e, CheckpointException) else f"rank {rank}: {describe(e)}"
        return None, LoadFailure.of(e, why)


def _after(future: Future[Any], then: Callable[[], Any]) -> Any:
    future.result()
    return then()


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Without a process group, DCP warns on every call that it runs in one process: yes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield


def settled(value: Any = None, error: BaseException | None = None) -> Future[Any]:
    """A future that has already ended, with ``value`` or ``error``."""
    future: Future[Any] = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future
