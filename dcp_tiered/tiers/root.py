"""One local root's tiers, built once and owned by whoever saves there: the root's
:class:`~dcp_tiered.tiers.local.LocalTier`, its remote (None: none), the queue of uploads to it,
and the :class:`SaveReport` of each save the writer ran on them.

The owner is the :class:`~dcp_tiered.lifecycle.Lifecycle` (one :class:`Tiers` per root it saves
to) or, used alone, the :class:`~dcp_tiered.writer.TieredStorageWriter` that built them. The
owner closes them: nothing else finds an upload queue, so no save outlives its owner unseen.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..backends.local import LocalBackend
from ..backends.remote import RemoteBackend, remote_backend
from ..config import RemoteConfig
from ..errors import DcpTieredError, ManifestError, TransientTierError, UploadFailedError
from ..policy import layout, records
from ..policy.retention import RetentionPolicy
from . import catalog, uploads
from .local import LocalTier
from .remote import Durability, RemoteTier, durability

logger = logging.getLogger("dcp_tiered.writer")  # the name these records always had


@dataclasses.dataclass
class SaveReport:
    """What one save of a step did on this process, for the owner of its tiers.

    ``write_s``: seconds this rank spent writing its files; ``commit_s``: seconds the coordinator
    spent committing (None on other ranks); ``uploads``: whether this process promotes its
    node's copy to the remote; ``upload``: that promotion, once the node published the step (a
    node other than the coordinator's publishes in the background, just after the save ends);
    its result is when it started and made the step durable (epoch seconds)."""

    step: str
    write_s: float
    uploads: bool
    commit_s: float | None = None
    upload: Future[tuple[float, float]] | None = None


def _no_policy() -> RetentionPolicy | None:
    return None


class Tiers:
    """The tiers of the local root ``local`` (and of ``remote``, if any), built once per root."""

    def __init__(self, local: LocalTier, remote: RemoteBackend | None) -> None:
        self.local, self.remote = local, remote
        self._queue: uploads.Uploader | None = None  # made by the first process that uploads
        self._remote_checked = False  # the probe runs once
        self._reports: dict[str, SaveReport] = {}
        self._lock = threading.Lock()
        # The remote tier's retention policy, if an owner applies one (asked at each resume):
        # steps it would drop are not uploaded again (uploads.Uploader.resume).
        self.remote_retention: Callable[[], RetentionPolicy | None] = _no_policy

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        remote: str | RemoteConfig | None = None,
        storage_options: Any = None,
    ) -> Tiers:
        """The tiers of ``root``, with the remote ``remote`` names (an fsspec URL or a
        RemoteConfig; ``storage_options`` for the URL's filesystem)."""
        return cls(LocalTier(LocalBackend(root)), remote_backend(remote, storage_options))

    @property
    def root(self) -> str:
        return self.local.root

    def __getstate__(self) -> dict[str, Any]:
        # A copy in DCP's checkpoint process uploads on its own queue, made there when needed;
        # its reports stay there too (their futures are this process's).
        state = self.__dict__.copy()
        state["_queue"], state["_lock"], state["_reports"] = None, None, {}
        state["remote_retention"] = _no_policy  # the owner's (a closure); the copy resumes none
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ------------------------------------------------------------ the remote, outside a save

    def check_remote(self) -> bool:
        """Probe the remote once; whether this call reached it. A store that cannot be reached
        now is only logged (uploads retry later; a job must not die because the store
        blinked); a wrong bucket or bad credentials raise PermanentTierError."""
        if self.remote is None or self._remote_checked:
            return False
        self._remote_checked = True
        try:
            self.remote.probe()
        except TransientTierError as e:
            logger.warning(
                "remote tier %s cannot be reached now (%s); saves go on and their "
                "uploads are retried later",
                self.remote.config.url,
                e,
            )
            return False
        return True

    def sweep_orphans(self, run_id: str | None) -> None:
        """Best effort, one attempt per request: housekeeping must never hold a job's start
        for the upload retry policy's minute. This root decides: a save it does not hold
        committed can never be committed remotely (its promotion writes the marker)."""
        assert self.remote is not None
        if run_id is None:
            return  # no run recorded yet: nothing on the remote can be proven this run's
        once = self.remote.with_one_attempt()
        try:
            pending = {
                (s.name, s.save_id) for s in self.local.steps() if s.verified_format and s.save_id
            }
            RemoteTier(once).sweep_orphans(pending, run_id)
        except (DcpTieredError, OSError) as e:  # an unreachable store, a record not ours
            logger.warning(
                "could not look for orphaned uploads on %s: %s", self.remote.config.url, e
            )

    # ------------------------------------------------------------ uploads

    def hold_uploads(self) -> None:
        """The process that owns these tiers takes the uploads on: the root records its remote,
        and committed steps that are not durable yet are enqueued again."""
        if self.remote is not None and self._queue is None:
            self.remember({"remote": self.remote.config.url})
            self.upload_queue().resume()

    def upload_queue(self) -> uploads.Uploader:
        """The queue of uploads to the remote, made on first use."""
        assert self.remote is not None
        with self._lock:
            if self._queue is None:
                self._queue = uploads.Uploader(
                    self.local, self.remote, lambda: self.remote_retention()
                )
            return self._queue

    def upload_early(
        self, step: str, save_id: str, name: str, checksum: str, node: int, run_id: str
    ) -> None:
        """Start uploading a data file of a save that promotes, before its local commit."""
        self.upload_queue().upload_early(step, save_id, name, checksum, node, run_id)

    def promote(self, step: str) -> Future[tuple[float, float]]:
        """Enqueue the promotion of ``step``, just committed here."""
        return self.upload_queue().submit(step)

    def remember(self, tiers: dict[str, Any]) -> None:
        """The root records where its other tiers are (the remote's URL, never its credentials;
        the memory tier's directory), so that ``dcp-tiered status ROOT`` finds them without
        being told: ``tiers`` replaces those entries of the record, whose other entries stay.
        The one writer of the record."""
        backend = self.local.backend
        record: dict[str, Any] = {}
        try:
            record = records.tiers_record(
                backend.read_file(layout.TIERS_RECORD), where=backend.path_of(layout.TIERS_RECORD)
            )
        except FileNotFoundError:
            pass
        except (OSError, ManifestError) as e:  # our own file, unreadable: written anew
            logger.warning("replacing %s: %s", backend.path_of(layout.TIERS_RECORD), e)
        record["remote_retention"] = records.retention_record(record.get("remote_retention"))
        if any(record.get(k) != v for k, v in tiers.items()):
            backend.replace_root_file(layout.TIERS_RECORD, json.dumps({**record, **tiers}).encode())

    def wait_uploads(self, timeout_secs: float | None) -> dict[str, str]:
        """Wait at most ``timeout_secs`` for every upload enqueued here (this process's saves
        and the steps its start resumed); the steps not durable then, each with why."""
        with self._lock:
            up = self._queue
        return {} if up is None else up.wait(timeout_secs)

    def close(self, timeout_secs: float | None = None, *, wait_durable: bool = True) -> None:
        """Wait (unless ``wait_durable`` is False) at most ``timeout_secs`` (default: the
        remote's ``durable_timeout_secs``) for the uploads enqueued here, then stop the queue
        once nothing is pending (what still is goes on, its threads ending after it, and is
        abandoned with a warning at exit). UploadFailedError names each step that is not
        durable. Closing twice is harmless."""
        with self._lock:
            up, self._queue = self._queue, None
        if up is None:
            return
        assert self.remote is not None
        if timeout_secs is None:
            timeout_secs = self.remote.config.durable_timeout_secs
        try:
            problems = up.wait(timeout_secs) if wait_durable else {}
        finally:
            up.shutdown_when_idle()
        if problems:
            raise UploadFailedError(
                f"not durable on {self.remote.config.url}: "
                + "; ".join(f"{step} ({why})" for step, why in sorted(problems.items()))
                + f". Each stays committed locally in {self.root}; the next writer on "
                "that root with this remote resumes its upload."
            )

    # ------------------------------------------------------------ durability

    def durability(self, step: str) -> Durability:
        """Where ``step`` stands: staged, committed-local or durable-remote."""
        return durability(self.local, self.remote, layout.validate_step_name(step))

    def wait_durable(self, step: str | None, timeout_secs: float | None) -> list[str]:
        """Block until ``step`` (default: every step enqueued here, else the newest committed
        one) is durable on the remote; the steps waited for."""
        assert self.remote is not None
        self.hold_uploads()
        up = self.upload_queue()
        if step is not None:
            steps = [layout.validate_step_name(step)]
        else:
            steps = sorted(up.steps()) or [catalog.resolve(self.local, None, None).name]
        uploads.wait_durable(
            up, steps, timeout_secs, lambda s: self.durability(s) == Durability.DURABLE_REMOTE
        )
        return steps

    # ------------------------------------------------------------ save reports

    def report(self, report: SaveReport) -> None:
        """The writer's report of a save; kept for the owner to take (the newest 64: a writer
        used alone has nobody who takes them)."""
        with self._lock:
            self._reports.pop(report.step, None)
            self._reports[report.step] = report
            while len(self._reports) > 64:
                self._reports.pop(next(iter(self._reports)))

    def take_report(self, step: str) -> SaveReport | None:
        """The report of this process's last save of ``step`` (None: none, or the save ran in
        DCP's checkpoint process)."""
        with self._lock:
            return self._reports.pop(step, None)
