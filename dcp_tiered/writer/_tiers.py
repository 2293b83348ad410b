"""The writer's tiers beyond one save, which the lifecycle and the manager ask for: recovery of
the root, its run, the remote tier's first probe and orphan sweep, this process's hold on the
background uploads, and where a step stands (durability).

:class:`TiersRole` is a role :class:`~dcp_tiered.writer.TieredStorageWriter` inherits (as DCP's
``FileSystemWriter`` inherits ``BlockingAsyncStager``): its methods use the writer's own state,
which the writer's ``__init__`` sets.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from ..backends.remote import RemoteBackend
from ..config import RetryConfig
from ..distributed import is_job_leader
from ..errors import (
    ConfigError,
    DcpTieredError,
    ManifestError,
    TransientTierError,
    UploadFailedError,
)
from ..policy import layout, records
from ..staging import DoubleBufferStager
from ..tiers import catalog, ownership, uploads
from ..tiers import remote as remote_tier
from ..tiers.local import LocalTier

logger = logging.getLogger("dcp_tiered.writer")  # the writer's one logger, whichever module


class TiersRole:
    """Recovery, the run, the remote tier outside a save, the uploads, durability."""

    # The writer's state this role reads and sets (TieredStorageWriter.__init__ makes it).
    _tier: LocalTier
    _remote: RemoteBackend | None
    _run: ownership.RootRun
    _stager: DoubleBufferStager | None
    _uploader: uploads.Uploader | None
    _remote_checked: bool
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
        self._tier.recover_and_sweep()
        reached = self._check_remote()
        if reached:
            self._run.join_remote()
        self._hold_uploads()
        if reached and is_job_leader():
            self._sweep_orphans()

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

    def _check_remote(self) -> bool:
        """Probe the remote once per writer; whether this call reached it."""
        if self._remote is None or self._remote_checked:
            return False
        self._remote_checked = True
        try:
            self._remote.probe()
        except TransientTierError as e:
            logger.warning(
                "remote tier %s cannot be reached now (%s); saves go on and their "
                "uploads are retried later",
                self._remote.config.url,
                e,
            )
            return False
        return True

    def _sweep_orphans(self) -> None:
        """Best effort, one attempt per request: housekeeping must never hold a job's start
        for the upload retry policy's minute. The coordinator's root decides: a save it does
        not hold committed can never be committed remotely (its promotion writes the marker)."""
        assert self._remote is not None
        if self._run.run_id is None:
            return  # no run recorded yet: nothing on the remote can be proven this run's
        once = RemoteBackend(
            dataclasses.replace(self._remote.config, retry=RetryConfig(max_attempts=1))
        )
        try:
            pending = {
                (s.name, s.save_id) for s in self._tier.steps() if s.verified_format and s.save_id
            }
            remote_tier.RemoteTier(once).sweep_orphans(pending, self._run.run_id)
        except (DcpTieredError, OSError) as e:  # an unreachable store, a record not ours
            logger.warning(
                "could not look for orphaned uploads on %s: %s", self._remote.config.url, e
            )

    def _hold_uploads(self) -> None:
        if self._remote is not None and self._uploader is None:
            self._remember_remote(self._remote.config.url)
            self._uploader = uploads.acquire_uploader(self._tier, self._remote)
            self._uploader.resume()

    def _remember_remote(self, url: str) -> None:
        """The root records its remote's URL (never its credentials), so that ``dcp-tiered
        status ROOT`` finds the remote without being told."""
        backend = self._tier.backend
        record: dict[str, Any] = {}
        try:
            record = records.tiers_record(
                backend.read_file(layout.TIERS_RECORD), where=backend.path_of(layout.TIERS_RECORD)
            )
        except FileNotFoundError:
            pass
        except (OSError, ManifestError) as e:  # our own file, unreadable: written anew
            logger.warning("replacing %s: %s", backend.path_of(layout.TIERS_RECORD), e)
        if record.get("remote") != url:
            backend.replace_root_file(
                layout.TIERS_RECORD, json.dumps({**record, "remote": url}).encode()
            )

    def _release_uploads(self, timeout_secs: float | None, wait_durable: bool) -> None:
        """``close``'s part: wait for this process's uploads (unless told not to), then let go
        of them; UploadFailedError naming each step that is not durable."""
        up, self._uploader = self._uploader, None
        if up is None:
            return
        assert self._remote is not None
        if timeout_secs is None:
            timeout_secs = self._remote.config.durable_timeout_secs
        try:
            problems = up.wait(timeout_secs) if wait_durable else {}
        finally:
            uploads.release_uploader(up)
        if problems:
            raise UploadFailedError(
                f"not durable on {self._remote.config.url}: "
                + "; ".join(f"{step} ({why})" for step, why in sorted(problems.items()))
                + f". Each stays committed locally in {self._tier.root}; the next writer on "
                "that root with this remote resumes its upload."
            )

    # ------------------------------------------------------------ durability

    def durability(self, step: str) -> remote_tier.Durability:
        """Where ``step`` stands: staged, committed-local or durable-remote."""
        return remote_tier.durability(self._tier, self._remote, layout.validate_step_name(step))

    def wait_durable(self, step: str | None = None, timeout_secs: float | None = None) -> None:
        """Block until ``step`` (default: every step enqueued by this process, else the newest
        committed one) is durable on the remote tier; raise UploadFailedError if it cannot be."""
        if self._remote is None:
            raise ConfigError("this writer has no remote tier; pass remote= to wait for one")
        self._hold_uploads()
        if step is not None:
            steps = [layout.validate_step_name(step)]
        else:
            up = uploads.uploader_for(self._tier, self._remote)
            steps = sorted(up.steps()) or [catalog.resolve(self._tier, None, None).name]
        uploads.wait_durable(self._tier, self._remote, steps, timeout_secs)
        for name in steps:
            self._check_still_ours(name)

    def _check_still_ours(self, step: str) -> None:
        """The remote's step must be this writer's save: with ``overwrite=True`` another job
        on the same root may have replaced the local copy before it was uploaded."""
        assert self._remote is not None  # only asked after uploads to it
        mine = self._save_ids.get(step)
        marker = None if mine is None else remote_tier.RemoteTier(self._remote).marker(step)
        if marker is not None and marker.get("save_id") != mine:
            raise UploadFailedError(
                f"step {step!r} is durable on {self._remote.config.url} as another save "
                f"({marker.get('save_id')}) than this writer's ({mine}): another job (or "
                f"writer) replaced it in {self._tier.root} (overwrite=True) before it was "
                "uploaded. This writer's data is not durable; give each job its own root."
            )
