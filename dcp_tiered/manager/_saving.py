"""The manager's save path: the vote on each step, the tier it starts, and (with
``async_snapshots``) the caller let go before the copy of a memory snapshot or of a disk
save's staging."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..errors import ConfigError, DcpTieredError
from ..lifecycle import Lifecycle
from ..lifecycle.save_thread import SaveThread
from ..policy import cadence
from ..policy.admission import Admission
from ..policy.cadence import Decision, SavePolicy
from ..policy.outcomes import PENDING
from ..tiers.memory import MemoryTier
from ..tiers.replica import Replicator
from ..writer import TieredStorageWriter
from ._events import SaveFacts, step_name
from ._gate import Gate, Room, admitted, resolve
from ._reports import Reports


class _LetGo:
    """Lets the caller of ``save`` go on before a snapshot's or a disk save's staging copy
    (``async_snapshots``): its stall ends there. ``stall`` is None until it has."""

    def __init__(self, t0: float, release: Callable[[], None], record: Callable[[float], None]):
        self._t0, self._release, self._record = t0, release, record
        self.stall: float | None = None

    def __call__(self) -> None:
        self.stall = time.perf_counter() - self._t0
        self._record(self.stall)  # before the caller reads it
        self._release()


class Saving:
    """Save: the part of :class:`~dcp_tiered.manager.CheckpointManager` (a base class of it)
    that takes a step's state to its tiers."""

    async_snapshots: bool
    policy: SavePolicy
    admission: Admission
    last_stall_secs: float
    _closed: bool
    _staging: Future[None] | None
    _save_thread: SaveThread
    _lifecycle: Lifecycle
    _gate: Gate
    _room: Room
    _reports: Reports
    _last: dict[str, float]
    _local: TieredStorageWriter  # the disk tier's writer
    _home: str
    _memory: MemoryTier | None
    _replica: Replicator | None
    _remote: Any

    _raise_failures: Callable[[], None]  # the manager's
    _memory_root: Callable[[], str]

    def save(self, step: int, app_state: dict[str, Any], *, force: bool = False) -> Decision:
        """Save ``app_state`` as ``step-<step>`` to the tiers due now; returns once staged
        (with ``async_snapshots``: once decided, the copy of its tensors going on).

        ``force=True`` saves to the local and remote tiers whatever the cadence (end of an
        epoch, a pre-emption notice). Raises SaveFailedError on every rank if an earlier
        background save or upload failed on any rank. Returns where this save went.
        """
        if self._closed:
            raise ConfigError("this CheckpointManager is closed")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        t0 = time.perf_counter()  # the wait for the copy before counts in the stall
        self.wait_staged()  # one copy beside training at a time
        # Off the caller's thread, which waits: its heap stays the training step's (see there).
        if not self.async_snapshots:
            return self._save_thread.run(self._save, step, app_state, force, t0)
        # ... until the copy of its tensors, which goes on beside training (wait_staged)
        decision, self._staging = self._save_thread.start(self._save, step, app_state, force, t0)
        return decision

    def wait_staged(self) -> None:
        """Block until the state handed to the last ``save`` is copied: with
        ``async_snapshots=True``, call it before changing the state (before
        ``optimizer.step()``). Raises what that save raised once it had returned (a tier's
        failure is reported by the next ``save``, as always). Without ``async_snapshots``,
        ``save`` has copied the state by the time it returns and this returns at once."""
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.result()

    def _save(
        self,
        step: int,
        app_state: dict[str, Any],
        force: bool,
        t0: float,
        release: Callable[[Decision], None] | None = None,
    ) -> Decision:
        now = time.time()
        self._lifecycle.reap()
        wanted = cadence.decide(
            self.policy,
            step,
            now,
            self._last,
            force=force,
            has_memory=self._memory is not None,
            has_remote=self._remote is not None,
        )
        vote, short = self._gate.vote(
            step,
            app_state,
            wanted,
            failed=bool(self._lifecycle.failures),
            busy=self._lifecycle.saves.full(),
        )
        if vote.failed:
            self._raise_failures()
        decision = admitted(step, vote, short, self.admission, self._reports)
        if not decision.any:
            self.last_stall_secs = time.perf_counter() - t0
            return decision
        if decision.local:  # the cap is on disk saves, which hold staging buffers
            self._lifecycle.make_room()
        let_go = None if release is None else functools.partial(release, decision)
        self._start(step, app_state, decision, t0, let_go)
        for t in ("memory", "local", "remote"):
            if getattr(decision, t):
                self._last[t] = now
        return decision

    def _start(
        self,
        step: int,
        app_state: dict[str, Any],
        decision: Decision,
        t0: float,
        let_go: Callable[[], None] | None = None,
    ) -> None:
        """Start the save; ``let_go``: the caller goes on before the copy of the state's
        tensors (``async_snapshots``), its stall then the time until then."""
        name = step_name(step)
        started = time.time()
        release = None if let_go is None else _LetGo(t0, let_go, self._record_stall)
        self._reports.planned(step, decision, PENDING)
        if decision.local:
            future = self._lifecycle.start_async(
                app_state, name, self._local, promote=decision.remote, let_go=release
            )
            stage_s, nbytes = self._local.staged()
            self._room.staged_bytes = nbytes
        else:
            assert self._memory is not None
            future = self._start_memory(name, app_state, release)
            if self._replica is not None:  # in the background, once committed
                self._replica.offer(step, name, future)
            stage_s, nbytes = self._memory.last_copy_secs, self._memory.last_bytes
        stall = time.perf_counter() - t0
        if release is not None and release.stall is not None:
            stall = release.stall
        self.last_stall_secs = stall
        tier = "local" if decision.local else "memory"
        facts = SaveFacts(
            step=step,
            tier=tier,
            remote=decision.remote and self._remote is not None,
            started=started,
            stall_s=stall,
            stage_s=stage_s,
            nbytes=nbytes,
        )
        root = self._home if decision.local else self._memory_root()
        facts.save = self._lifecycle.track(
            root,
            name,
            future,
            on_written=lambda written: self._reports.written(facts, written),
            on_durable=lambda error: self._reports.durable(facts, error),
            tier=tier,
        )
        facts.save.started = started  # the node's publication is timed from here

    def _record_stall(self, secs: float) -> None:
        self.last_stall_secs = secs

    def _start_memory(
        self, name: str, app_state: dict[str, Any], release: _LetGo | None
    ) -> Future[dict[str, float]]:
        """The snapshot's commit; ``release``: called once the snapshot needs no more of the
        state than its tensors' bytes (Stateful objects' ``state_dict()`` called, other
        values encoded, tensors checked), the copy then beside training."""
        assert self._memory is not None
        try:
            return self._memory.save(name, resolve(app_state), let_go=release)
        except Exception as e:
            # This rank only: reported to all at the next save. Any error once the caller has
            # gone on, where it can no longer be raised to it in step with the other ranks.
            let_go = release is not None and release.stall is not None
            if not let_go and not isinstance(e, (DcpTieredError, OSError)):
                raise
            failed: Future[dict[str, float]] = Future()
            failed.set_exception(e)
            return failed
