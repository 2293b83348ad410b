"""Promotion of committed local steps to the remote tier, in the background.

Durability of a step moves staged → committed-local → durable-remote. On the remote tier a
step is committed by this protocol, so partial uploads are never visible:

1. every node uploads its own data files (skipping objects already there with the right size
   and checksum), then writes its completion record ``STEP/_nodes/node-K.json``;
2. the coordinator's node (the one holding rank 0's files) waits for every node's record, then
   writes ``STEP/manifest.json`` and ``STEP/.metadata``;
3. last, it creates the commit marker ``STEP/_COMMITTED.json`` exclusively (If-None-Match).
Readers trust only steps with a marker.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # before the exit hook below is registered: see there
import enum
import json
import logging
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

from . import _retry, commit, integrity, layout, manifest
from ._daemon_pool import DaemonPool
from ._priority import lower_this_thread
from .backends.remote import RemoteBackend
from .errors import (
    CheckpointNotFoundError,
    IntegrityError,
    ManifestError,
    TierError,
    UploadFailedError,
)
from .local_tier import LocalTier
from .manifest import Manifest

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 16 * 2**20


class Durability(str, enum.Enum):
    STAGED = "staged"  # being written on the local tier
    COMMITTED_LOCAL = "committed-local"
    DURABLE_REMOTE = "durable-remote"


def node_of_local_files(m: Manifest, present: set[str]) -> int:
    """Which node's shards this local step directory holds (the lowest, if several)."""
    ranks = {int(info["rank"]) for name, info in m.files.items() if name in present}
    for node, node_ranks in enumerate(m.nodes):
        if ranks & set(node_ranks):
            return node
    return 0


def read_marker(remote: RemoteBackend, step: str) -> dict[str, Any] | None:
    try:
        return json.loads(remote.get_bytes(f"{step}/{layout.REMOTE_MARKER}"))
    except FileNotFoundError:
        return None


def is_durable(remote: RemoteBackend, m: Manifest) -> bool:
    marker = read_marker(remote, m.step)
    return marker is not None and marker.get("save_id") == m.save_id


class Promotion:
    """Uploads one node's part of one committed step; the coordinator's node also commits."""

    def __init__(self, tier: LocalTier, remote: RemoteBackend, step: str,
                 files_pool: DaemonPool) -> None:
        self.tier, self.remote, self.step, self._pool = tier, remote, step, files_pool

    def run(self) -> None:
        m = self.tier.read_manifest(self.step)
        marker = read_marker(self.remote, self.step)
        area = layout.upload_area_name(self.step, m.save_id)
        if marker is not None:
            if marker.get("save_id") == m.save_id:  # already durable
                if self.tier.backend.is_dir(area):
                    self.tier.backend.remove_tree(area, reason="upload records of a durable step")
                return
            # Remote steps are immutable: uploading would overwrite objects a committed step
            # points at. Leave that copy whole and say so.
            raise UploadFailedError(
                f"step {self.step!r} is already committed on {self.remote.config.url} by another "
                f"save ({marker.get('save_id')}); remote steps are never overwritten. Delete it "
                "there first, or save under a new step name."
            )
        present = set(self.tier.backend.list_files(self.step)) & set(m.files)
        node = node_of_local_files(m, present)
        mine = sorted(n for n in present if int(m.files[n]["rank"]) in m.nodes[node])
        keys = {name: self._key(name) for name in mine}
        # One listing tells what an earlier, interrupted attempt already uploaded.
        existing = self.remote.sizes(layout.remote_step_prefixes(self.step)[0])
        if self.remote.config.prefix_strategy == "hash":
            for prefix in layout.remote_step_prefixes(self.step)[1:]:
                existing.update(self.remote.sizes(prefix))
        jobs = [self._pool.submit(self._upload, m, n, keys[n], existing.get(keys[n])) for n in mine]
        for fut in jobs:
            fut.result()
        record = {"save_id": m.save_id, "files": {n: m.files[n] for n in mine}}
        self.remote.put_bytes(layout.node_record_key(self.step, node), json.dumps(record).encode())
        if self.tier.backend.is_dir(area):
            self.tier.backend.remove_tree(area, reason="upload records of a node copy now uploaded")
        logger.info("uploaded step=%s node=%d files=%d to %s", self.step, node, len(mine),
                    self.remote.config.url)
        if node == 0:
            self._commit(m)

    def _key(self, name: str) -> str:
        return layout.remote_file_key(self.step, name, self.remote.config.prefix_strategy)

    def _upload(self, m: Manifest, name: str, key: str, remote_size: int | None) -> None:
        size, checksum = int(m.files[name]["size"]), str(m.files[name]["checksum"])
        backend, area = self.tier.backend, layout.upload_area_name(self.step, m.save_id)
        # An upload started before the commit (by any rank of this node) holds this lock.
        lock = backend.lock_exclusive(area, f"{name}.lock") if backend.is_dir(area) else None
        try:
            if lock is not None and backend.exists(area, f"{name}.done"):
                return
            if remote_size == size and self._remote_checksum_matches(key, size, checksum):
                logger.debug("skip %s: already uploaded", key)
                return
            # Holding the lock, no upload of this key from this node is in flight: any
            # incomplete multipart upload of it is a leftover of an interrupted attempt.
            self.remote.abort_multipart_uploads(key, only={key})
            upload_verified(self.tier, self.remote, (self.step,), name, key, checksum)
        finally:
            if lock is not None:
                backend.unlock(lock)

    def _remote_checksum_matches(self, key: str, size: int, checksum: str) -> bool:
        stat = self.remote.stat(key)
        if stat is not None and stat[1] is not None:
            return stat[1] == checksum
        crc = 0  # stores without object metadata: read it back
        for start in range(0, size, _CHUNK_BYTES):
            end = min(size, start + _CHUNK_BYTES)
            crc = integrity.checksum(self.remote.get_range(key, start, end), crc)
        return integrity.format_checksum(crc) == checksum

    def _commit(self, m: Manifest) -> None:
        deadline = time.monotonic() + self.remote.config.durable_timeout_secs
        pending = set(range(1, len(m.nodes)))
        delay = 0.05
        while pending:
            for node in sorted(pending):
                try:
                    rec = json.loads(self.remote.get_bytes(layout.node_record_key(self.step, node)))
                except FileNotFoundError:
                    continue
                if rec.get("save_id") == m.save_id:
                    pending.discard(node)
            if pending:
                if time.monotonic() > deadline:
                    raise UploadFailedError(
                        f"step {self.step!r}: nodes {sorted(pending)} did not finish uploading "
                        f"within {self.remote.config.durable_timeout_secs:.0f} s; the step stays "
                        "committed locally and is retried at the next start"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        backend = self.tier.backend
        self.remote.put_bytes(f"{self.step}/{layout.MANIFEST_NAME}",
                              backend.read_file(self.step, layout.MANIFEST_NAME))
        self.remote.put_bytes(f"{self.step}/{layout.DCP_METADATA_NAME}",
                              backend.read_file(self.step, layout.DCP_METADATA_NAME))
        marker = {"step": self.step, "save_id": m.save_id, "committed_at_ns": m.committed_at_ns,
                  "prefix_strategy": self.remote.config.prefix_strategy}
        if not self.remote.create_exclusive(f"{self.step}/{layout.REMOTE_MARKER}",
                                            json.dumps(marker).encode()):
            existing = read_marker(self.remote, self.step) or {}
            if existing.get("save_id") != m.save_id:
                raise UploadFailedError(
                    f"step {self.step!r} is already committed remotely by another save "
                    f"({existing.get('save_id')}); the remote copy was left untouched"
                )
        self._remove_orphans(m)
        logger.info("durable-remote step=%s url=%s", self.step, self.remote.config.url)

    def _remove_orphans(self, m: Manifest) -> None:
        expected = {self._key(n) for n in m.files} | {
            f"{self.step}/{n}" for n in (layout.MANIFEST_NAME, layout.DCP_METADATA_NAME,
                                         layout.REMOTE_MARKER)
        } | {layout.node_record_key(self.step, k) for k in range(len(m.nodes))}
        for prefix in layout.remote_step_prefixes(self.step):
            if prefix != f"{self.step}/" and self.remote.config.prefix_strategy != "hash":
                continue
            for key in self.remote.sizes(prefix):
                if key not in expected:
                    self.remote.remove(key, reason=f"orphan of step {self.step}")




def upload_verified(tier: LocalTier, remote: RemoteBackend, directory: tuple[str, ...], name: str,
                    key: str, checksum: str) -> None:
    """Upload a local file after checking it against its manifest checksum, so promotion
    never copies corruption. A PUT (or completed multipart upload) that returns is whole."""
    actual = tier.backend.file_checksum(*directory, name)
    path = tier.backend.path_of(*directory, name)
    if actual != checksum:
        raise IntegrityError(
            f"local file {path} fails its checksum ({actual} != manifest {checksum}); it was "
            "not uploaded. Re-save the step."
        )
    remote.put_file(path, key, checksum)


class Uploader:
    """One per (local root, remote) in a process: promotes steps in commit order."""

    def __init__(self, tier: LocalTier, remote: RemoteBackend) -> None:
        self.tier, self.remote = tier, remote
        self._steps = DaemonPool(1, "dcp-tiered-upload", lower_this_thread)
        self._files = DaemonPool(remote.config.max_concurrency, "dcp-tiered-upload-file",
                                 lower_this_thread)
        self._users = 0  # writers holding this uploader (acquire/release)
        self._futures: dict[str, Future[None]] = {}
        self._lock = threading.Lock()
        self._resume_lock: int | None = None
        self._times: dict[str, tuple[float, float]] = {}  # step -> (started, durable) epoch s
        self._remote_step_free: dict[tuple[str, str], bool] = {}

    def submit(self, step: str, *, new_commit: bool = True) -> Future[None]:
        """Enqueue the promotion of ``step``. A new commit always gets its own promotion (it
        runs after any earlier one and reads the manifest then); a resume reuses a pending one."""
        with self._lock:
            fut = self._futures.get(step)
            if new_commit or fut is None or fut.done():
                fut = self._steps.submit(self._promote, step)
                self._futures[step] = fut
            return fut

    def upload_early(self, step: str, save_id: str, name: str, checksum: str) -> None:
        """Start uploading a data file as soon as it is written, before the local commit.

        Data objects are invisible until the step's marker exists, so this only overlaps the
        upload with the rest of the save. Best effort: whatever does not finish here is
        uploaded by the promotion after the commit.
        """
        self._files.submit(self._upload_early, step, save_id, name, checksum)

    def _upload_early(self, step: str, save_id: str, name: str, checksum: str) -> None:
        backend, area = self.tier.backend, layout.upload_area_name(step, save_id)
        try:
            with self._lock:
                free = self._remote_step_free.get((step, save_id))
            if free is None:  # remote steps are immutable: never write under a committed one
                free = read_marker(self.remote, step) is None
                with self._lock:
                    self._remote_step_free[(step, save_id)] = free
            if not free:
                return
            backend.make_dir(area)
            lock = backend.lock_exclusive(area, f"{name}.lock")
            try:
                tmp = layout.tmp_dir_name(step, save_id)
                where = (tmp,) if backend.exists(tmp, name) else (step,)  # committed meanwhile
                key = layout.remote_file_key(step, name, self.remote.config.prefix_strategy)
                upload_verified(self.tier, self.remote, where, name, key, checksum)
                backend.write_file(area, f"{name}.done", b"", sync=False)
            finally:
                backend.unlock(lock)
        except Exception as e:  # noqa: BLE001 - the promotion uploads it instead
            logger.debug("early upload of %s/%s deferred to the promotion: %s", step, name, e)

    def _promote(self, step: str) -> None:
        started = time.time()
        try:
            Promotion(self.tier, self.remote, step, self._files).run()
        except BaseException as e:
            if not _retry.EXITING.is_set():  # at exit, _abandon_at_exit says it once
                logger.error("step %s is not durable on %s: %s", step, self.remote.config.url, e)
            raise
        with self._lock:
            self._times[step] = (started, time.time())

    def times(self, step: str) -> tuple[float, float] | None:
        """When this process's last promotion of ``step`` started and made it durable."""
        with self._lock:
            return self._times.get(step)

    def future(self, step: str) -> Future[None] | None:
        with self._lock:
            return self._futures.get(step)

    def futures(self) -> list[Future[None]]:
        with self._lock:
            return list(self._futures.values())

    def steps(self) -> list[str]:
        with self._lock:
            return list(self._futures)

    def not_durable(self) -> dict[str, str]:
        """Steps this process enqueued that are not durable, each with why (now)."""
        out = {}
        with self._lock:
            futures = dict(self._futures)
        for step, fut in futures.items():
            if not fut.done():
                out[step] = "still uploading"
            elif fut.cancelled():
                out[step] = "upload cancelled"
            elif fut.exception() is not None:
                out[step] = f"{type(fut.exception()).__name__}: {fut.exception()}"
        return out

    def wait(self, timeout_secs: float | None) -> dict[str, str]:
        """Wait (at most ``timeout_secs`` in all) for every enqueued promotion; return the steps
        that are not durable then, each with why."""
        concurrent.futures.wait(self.futures(), timeout=timeout_secs)
        problems = self.not_durable()
        return {s: (f"still uploading after {timeout_secs} s" if why == "still uploading" else why)
                for s, why in problems.items()}

    def shutdown(self, *, cancel: bool = False) -> None:
        self._steps.shutdown(wait=not cancel, cancel_futures=cancel)
        self._files.shutdown(wait=not cancel, cancel_futures=cancel)

    def resume(self) -> None:
        """Re-enqueue committed local steps that are not durable yet (one process per root)."""
        if self._resume_lock is None:
            self._resume_lock = self.tier.backend.try_lock_exclusive(layout.UPLOADER_LOCK_NAME)
            if self._resume_lock is None:
                return  # another process on this node resumes them
        for info in sorted(self.tier.steps(), key=lambda s: s.committed_at_ns):
            if info.verified_format and self._wants_promotion(info.name):
                self.submit(info.name, new_commit=False)

    def _wants_promotion(self, step: str) -> bool:
        try:
            return self.tier.read_manifest(step).promote
        except (ManifestError, OSError):
            return True  # the promotion reports what is wrong with it


_UPLOADERS: dict[tuple[int, str, str], Uploader] = {}
_UPLOADERS_LOCK = threading.RLock()


def uploader_for(tier: LocalTier, remote: RemoteBackend) -> Uploader:
    key = (os.getpid(), tier.root, remote.config.url)
    with _UPLOADERS_LOCK:
        if key not in _UPLOADERS:
            _UPLOADERS[key] = Uploader(tier, remote)
        return _UPLOADERS[key]


def acquire_uploader(tier: LocalTier, remote: RemoteBackend) -> Uploader:
    """The uploader of (root, remote), held until :func:`release_uploader`."""
    with _UPLOADERS_LOCK:
        up = uploader_for(tier, remote)
        up._users += 1
        return up


def release_uploader(up: Uploader) -> None:
    """Drop a hold; the last one stops the uploader's threads once nothing is pending (what
    is still pending keeps running, and at exit is abandoned with a warning)."""
    with _UPLOADERS_LOCK:
        up._users -= 1
        if up._users > 0 or any(not f.done() for f in up.futures()):
            return
        for key, value in list(_UPLOADERS.items()):
            if value is up:
                del _UPLOADERS[key]
    up.shutdown()


def _abandon_at_exit() -> None:
    """The interpreter is exiting: stop retrying, drop queued promotions, and say once which
    steps are left committed-local (they are safe on disk and resumed by the next writer)."""
    _retry.EXITING.set()
    with _UPLOADERS_LOCK:
        mine = [(k, up) for k, up in _UPLOADERS.items() if k[0] == os.getpid()]
    for (_, root, url), up in mine:
        up.shutdown(cancel=True)
        left = up.not_durable()
        if left:
            logger.warning(
                "dcp_tiered: exiting with step(s) %s of %s committed locally but not durable on "
                "%s. They are safe on the local disk, and the next TieredStorageWriter on that "
                "root with this remote resumes their upload. To wait for them before exiting, "
                "call close() on the writer (CheckpointManager.close(), the shims' flush/close).",
                ", ".join(sorted(left)), root, url)


# Runs before concurrent.futures and asyncio shut their executors down at exit (threading's
# exit hooks run in reverse order of registration), so no upload retries against them.
threading._register_atexit(_abandon_at_exit)  # type: ignore[attr-defined]


def durability(tier: LocalTier, remote: RemoteBackend | None, step: str) -> Durability:
    local = {s.name for s in tier.steps()}
    try:
        if step in local:
            if remote is not None and is_durable(remote, tier.read_manifest(step)):
                return Durability.DURABLE_REMOTE
            return Durability.COMMITTED_LOCAL
        if remote is not None and read_marker(remote, step) is not None:
            return Durability.DURABLE_REMOTE
    except TierError as e:  # an unreachable remote holds nothing we can count on
        logger.warning("cannot query %s: %s", remote, e)
        if step in local:
            return Durability.COMMITTED_LOCAL
    if any((p := layout.parse_hidden_dir(n)) and p[0] == step and p[2] == layout.TMP_SUFFIX
           for n in tier.backend.list_names()):
        return Durability.STAGED
    raise CheckpointNotFoundError(f"step {step!r} is neither in {tier.root} nor remote")


def adopt_remote_step(tier: LocalTier, remote: RemoteBackend, step: str) -> None:
    """Commit a durable remote step on the local tier as its manifest and ``.metadata`` alone.

    Its data stays remote: readers fetch each file from there, verified, so a fresh node can
    restore a step through tools that look for it on local disk (DeepSpeed's loader) without
    first downloading all of it. Committed like a save: temporary directory, rename.
    """
    if tier.has_step(step):
        return
    if read_marker(remote, step) is None:
        raise CheckpointNotFoundError(f"step {step!r} is not committed on {remote.config.url}")
    manifest_bytes = remote.get_bytes(f"{step}/{layout.MANIFEST_NAME}")
    m = manifest.parse(manifest_bytes, where=remote.url(f"{step}/{layout.MANIFEST_NAME}"))
    backend, tmp = tier.backend, layout.tmp_dir_name(step, m.save_id)
    backend.ensure_root()
    backend.make_dir(tmp)
    lock = backend.lock_shared(tmp)  # never swept as abandoned while we fill it
    try:
        commit.write_step_files(backend, tmp, manifest_bytes,
                                remote.get_bytes(f"{step}/{layout.DCP_METADATA_NAME}"), sync=True)
        commit.publish_step(backend, step, m.save_id, tmp)
    except BaseException:
        commit.discard_tmp(backend, tmp, reason=f"adoption of remote step {step} failed")
        raise
    finally:
        backend.unlock(lock)
    logger.info("adopted step=%s from %s into %s (data stays remote)", step,
                remote.config.url, tier.root)


def delete_remote_step(remote: RemoteBackend, step: str, *, reason: str) -> None:
    """Remove a committed remote step: its marker first, so readers stop trusting it before
    any of its objects go; then everything under its prefixes (and nothing else)."""
    remote.remove(f"{step}/{layout.REMOTE_MARKER}", reason=reason)
    for prefix in layout.remote_step_prefixes(step):
        if prefix != f"{step}/" and remote.config.prefix_strategy != "hash":
            continue
        for key in sorted(remote.sizes(prefix)):
            remote.remove(key, reason=reason)
    remote.remove_empty_dirs(f"{step}/")


def wait_durable(tier: LocalTier, remote: RemoteBackend, steps: list[str],
                 timeout_secs: float | None) -> None:
    deadline = None if timeout_secs is None else time.monotonic() + timeout_secs
    up = uploader_for(tier, remote)
    for step in steps:
        fut = up.future(step)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if fut is not None:
            try:
                fut.result(timeout=left)
            except FutureTimeoutError:
                raise TimeoutError(f"step {step!r} is not durable after {timeout_secs} s") from None
            except Exception as e:
                raise UploadFailedError(f"step {step!r} could not be made durable: {e}") from e
            continue
        while durability(tier, remote, step) != Durability.DURABLE_REMOTE:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"step {step!r} is not durable after {timeout_secs} s")
            time.sleep(0.2)
