"""The writer beyond one save, which the lifecycle and the shims ask for: recovery of its root,
its run, and where a step stands (durability). The tiers themselves (the remote's probe and
orphan sweep, the uploads) are the root's :class:`~dcp_tiered.tiers.root.Tiers`.

:class:`TiersRole` is a role :class:`~dcp_tiered.writer.TieredStorageWriter` inherits (as DCP's
``FileSystemWriter`` inherits ``BlockingAsyncStager``): its methods use the writer's own state,
which the writer's ``__init__`` sets.
"""

from __future__ import annotations

from ..distributed import is_job_leader
from ..errors import ConfigError, UploadFailedError
from ..staging import DoubleBufferStager
from ..tiers import ownership
from ..tiers import remote as remote_tier
from ..tiers.root import Tiers


class TiersRole:
    """Recovery, the run, durability."""

    # The writer's state this role reads and sets (TieredStorageWriter.__init__ makes it).
    _tiers: Tiers
    _run: ownership.RootRun
    _stager: DoubleBufferStager | None
    _save_ids: dict[str, str]

    def recover(self) -> None:
        """Finish what a crash left under ``root`` (interrupted overwrites and deletes, temporary
        directories of dead saves) and re-enqueue the upload of every committed step that is
        not durable yet. Building a writer does neither; the first save does both, and
        :class:`~dcp_tiered.manager.CheckpointManager` and the shims call this when they start.
        Safe to call again, and on every rank of a node at once.

        With a remote tier it first checks the remote with one cheap request: a wrong bucket,
        missing or bad credentials or denied access raise PermanentTierError saying what to
        fix; a store that cannot be reached now is logged at WARNING only (uploads retry later;
        a job must not die because the store blinked).

        ForeignRunError if ``root`` records another run than ``run_id=``, or another job
        uses it now."""
        self._run.start(hold=self._stager is not None)  # not a copy in DCP's worker
        self._tiers.local.recover_and_sweep()
        reached = self._tiers.check_remote()
        if reached:
            self._run.join_remote()
        self._tiers.hold_uploads()
        if reached and is_job_leader():
            self._tiers.sweep_orphans(self._run.run_id)

    @property
    def run_id(self) -> str | None:
        """This writer's run (None until ``root`` records one, or the first save decides)."""
        return self._run.run_id

    @property
    def explicit_run(self) -> str | None:
        """The run this writer was told to be (``run_id=`` or ``$DCP_TIERED_RUN_ID``)."""
        return self._run.explicit

    def join_run(self, run_id: str) -> None:
        """Make ``run_id`` this writer's run and record it in ``root`` (ForeignRunError if the
        root records another). Every rank calls it once the ranks agreed on the run."""
        self._run.join(run_id)

    # ------------------------------------------------------------ durability

    def durability(self, step: str) -> remote_tier.Durability:
        """Where ``step`` stands: staged, committed-local or durable-remote."""
        return self._tiers.durability(step)

    def wait_durable(self, step: str | None = None, timeout_secs: float | None = None) -> None:
        """Block until ``step`` (default: every step enqueued by this process, else the newest
        committed one) is durable on the remote tier; raise UploadFailedError if it cannot be.
        A step this process's ``dcp.async_save`` is still writing is waited for too."""
        if self._tiers.remote is None:
            raise ConfigError("this writer has no remote tier; pass remote= to wait for one")
        if step is not None and self._stager is not None and not self._tiers.local.has_step(step):
            # a step of this process's async_save, still being written: committed first
            self._stager.wait_for_saves()
        for name in self._tiers.wait_durable(step, timeout_secs):
            self._check_still_ours(name)

    def _check_still_ours(self, step: str) -> None:
        """The remote's step must be this writer's save: with ``overwrite=True`` another job
        on the same root may have replaced the local copy before it was uploaded."""
        remote = self._tiers.remote
        assert remote is not None  # only asked after uploads to it
        mine = self._save_ids.get(step)
        marker = None if mine is None else remote_tier.RemoteTier(remote).marker(step)
        if marker is not None and marker.get("save_id") != mine:
            raise UploadFailedError(
                f"step {step!r} is durable on {remote.config.url} as another save "
                f"({marker.get('save_id')}) than this writer's ({mine}): another job (or "
                f"writer) replaced it in {self._tiers.root} (overwrite=True) before it was "
                "uploaded. This writer's data is not durable; give each job its own root."
            )
