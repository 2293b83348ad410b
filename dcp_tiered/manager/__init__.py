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

import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
from typing_extensions import Self  # a dependency of torch itself

from .._priority import background_threads
from .._torch_compat import global_rank
from ..errors import ConfigError
from ..events import EventLog
from ..lifecycle import Conventions, Lifecycle
from ..lifecycle.memory import MemorySnapshots
from ..lifecycle.save_thread import SaveThread
from ..policy import layout, records
from ..policy.admission import Admission
from ..policy.cadence import SavePolicy
from ..policy.outcomes import SaveOutcome
from ..policy.replication import Replication
from ..policy.retention import Retention
from . import _restore
from ._events import step_name
from ._gate import Gate, Room
from ._reports import Reports
from ._restore import Restoring
from ._saving import Saving

__all__ = ["CONVENTIONS", "CheckpointManager", "step_name"]

logger = logging.getLogger(__name__)


CONVENTIONS = Conventions("CheckpointManager")


class CheckpointManager(Saving, Restoring):
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
            (``sync_files``, ``thread_count``, ``commit_timeout_secs`` ...). ``thread_count``
            defaults to 1 on a machine of fewer than four usable cores (the saves run beside
            training), else 2.
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
        async_snapshots: a save copies the state's tensors while training goes on (a memory
            snapshot's copy, a disk save's staging copy): ``save`` returns once the save is
            decided and everything but the tensors' bytes is taken, and the copy runs on one
            background thread. Call :meth:`wait_staged` before changing the state (right
            before ``optimizer.step()``): a save during whose copy a tensor changed is not
            committed (a disk save fails on every rank before it writes), and the next
            ``save`` raises SaveFailedError (StateChangedError).
    """

    # The save and restore paths live in base classes of their own (_saving, _restore);
    # named here, the API reference documents them as the manager's (it leaves out what a
    # class inherits from a private module's).
    save = Saving.save
    wait_staged = Saving.wait_staged
    restore = Restoring.restore
    copies = Restoring.copies

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
        async_snapshots: bool = False,
    ) -> None:
        if replication is not None and memory is None:
            raise ConfigError("replication copies memory snapshots: it needs memory=...")
        self.async_snapshots = async_snapshots
        self._staging: Future[None] | None = None  # the copy going on beside training
        self.policy = policy or SavePolicy()
        self.retention = retention or Retention()
        self.admission = admission or Admission()
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = global_rank()
        options = dict(writer_options or {})
        options.setdefault("overwrite", True)  # a replayed step replaces its abandoned twin
        options.setdefault("thread_count", background_threads())  # leave training a core
        # The save core: saves in flight (the cap is on disk saves, which hold staging
        # buffers), their failures, retention and restore's agreement.
        self._lifecycle = Lifecycle(
            CONVENTIONS,
            remote=remote,
            storage_options=storage_options,
            retention=self.retention.local,
            remote_retention=self.retention.remote,
            writer_options=options,
            collective_timeout_secs=collective_timeout_secs,
            run_id=run_id,
            max_in_flight=self.admission.max_in_flight,
        )
        # Saves run their collectives on one group, the manager's votes on another: a vote on
        # the training thread never interleaves with a background save's collectives.
        self._save_pg, self._agree = self._lifecycle.group, self._lifecycle.agree
        if memory is not None and os.path.realpath(memory) == os.path.realpath(local):
            raise ConfigError("memory and local must be different directories")
        # Recovered (crashes swept, uploads on, the remote checked) and the run agreed;
        # fails on every rank.
        self._local = self._lifecycle.start(local, memory=memory)
        # The root as the lifecycle keys its writer (the writer may spell it otherwise: "~").
        self._home = os.path.abspath(local)
        self.run_id = self._lifecycle.run_id
        self.allow_pickle = allow_pickle
        self._tiers = self._lifecycle.writers.tiers(self._home)  # the lifecycle's, per root
        self._remote = self._tiers.remote
        # One process per directory applies retention: whoever holds its lock from now on.
        self._lifecycle.keep(self._home)
        self._events = EventLog(
            os.path.join(self._local.root, layout.EVENTS_LOG) if events == "default" else events
        )
        # The memory tier and its replication, wired as for every entry point (collective).
        self._snapshots = (
            MemorySnapshots(
                memory,
                self.rank,
                world_size=dist.get_world_size() if self._distributed else 1,
                run_id=self.run_id,
                allow_pickle=allow_pickle,
                replication=replication,
                timeout_secs=collective_timeout_secs,
                emit=self._events.emit,
            )
            if memory is not None
            else None
        )
        self._memory = self._snapshots.tier if self._snapshots is not None else None
        self._replica = self._snapshots.replica if self._snapshots is not None else None
        self._sources = _restore.Sources(
            self._local.root,
            self._tiers.local,
            self._memory,
            self._replica,
            self._remote,
            allow_pickle=allow_pickle,
            group=self._save_pg,
            rank=self.rank,
            emit=self._events.emit,
        )
        self._room = Room(
            self.admission, self._local, self._tiers.local, self._memory, self._replica
        )
        time_based = any(
            e is not None and e.secs is not None
            for e in (self.policy.memory, self.policy.local, self.policy.remote)
        )
        self._gate = Gate(self._room, self._agree, time_based=time_based, allow_pickle=allow_pickle)
        self._last: dict[str, float] = {t: time.time() for t in ("memory", "local", "remote")}
        local_root = self._local.root
        self._reports = Reports(
            self._lifecycle,
            self._events,
            self.admission,
            rank=self.rank,
            where={
                "local": local_root,
                "memory": str(self._memory.root) if self._memory is not None else local_root,
                "remote": self._remote.config.url if self._remote is not None else local_root,
            },
            has_remote=self._remote is not None,
        )
        self.restored_step: int | None = None
        self.last_stall_secs = 0.0
        self._save_thread = SaveThread()
        self._closed = False
        if self.rank == 0:
            self._record_tiers(memory)

    def _record_tiers(self, memory: Any) -> None:
        self._tiers.remember(
            {
                "memory": os.path.abspath(memory) if memory is not None else None,
                "remote": self._remote.config.url if self._remote is not None else None,
                # for `dcp-tiered status`: a local step the remote's policy dropped is not
                # waiting for an upload
                "remote_retention": records.retention_record(
                    self.retention.remote if self._remote is not None else None
                ),
            }
        )

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
        self.wait_staged()
        self._lifecycle.wait_written()
        if self._replica is not None:
            self._replica.drain()
        self._lifecycle.reap()
        return self._reports.final()

    def outcome(self, step: int) -> dict[str, SaveOutcome]:
        """What the save of ``step`` achieved on each tier so far (empty: never saved by this
        manager, or too long ago: the newest 1,024 steps are kept). Non-blocking (but for a
        snapshot copying beside training: ``async_snapshots``); call :meth:`wait` or
        :meth:`close` first for final answers."""
        self.wait_staged()  # the copy's save is tracked once it is copied
        self._lifecycle.reap()
        return self._reports.outcomes.of(step)

    def outcomes(self) -> dict[int, dict[str, SaveOutcome]]:
        """:meth:`outcome` of every step this manager saved or skipped, oldest first."""
        self.wait_staged()
        self._lifecycle.reap()
        return self._reports.outcomes.steps()

    @property
    def skipped_saves(self) -> int:
        """Saves skipped so far: no room on a tier, or at the in-flight cap."""
        return self._reports.skipped

    def _raise_failures(self) -> None:
        self._lifecycle.raise_recorded(
            "checkpoint failure(s) since the last save",
            "Earlier committed steps are intact; fix the cause and keep training, or restore",
        )

    def _memory_root(self) -> str:
        assert self._memory is not None
        return str(self._memory.root)

    # ------------------------------------------------------------ shutdown

    def close(self, timeout_secs: float | None = None) -> None:
        """Wait for in-flight saves, uploads (earlier jobs' steps this start resumed too) and
        retention; raise SaveFailedError on every rank if any of this job's failed on any
        rank (an earlier job's step not durable is logged: it stays committed locally, and the
        next job resumes it).

        Ranks poll together (:meth:`~dcp_tiered.lifecycle.reaping.Reaping.drain`): as soon as any
        rank's save or upload fails, every rank raises. ``timeout_secs`` bounds
        the wait for uploads; uploads still running then are reported as failures.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_staged()
        except BaseException:
            self._release()
            raise
        deadline = None if timeout_secs is None else time.monotonic() + timeout_secs
        self._lifecycle.wait_written()
        if self._replica is not None:
            self._replica.drain(timeout_secs)
        try:
            late = f"not durable after close(timeout_secs={timeout_secs})"
            self._lifecycle.drain(deadline, self._raise_failures, late=late)
            self._lifecycle.wait_resumed_uploads(deadline)
            self._lifecycle.settle_retention()
        finally:
            self._release()

    def _release(self) -> None:
        self._save_thread.close()
        if self._snapshots is not None:
            self._snapshots.close()
        self._lifecycle.release()  # close() above waited (bounded) already; retention's pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
