"""The remote tier's commit protocol: promoting one committed local step, and what it means.

Which steps are promoted, when and on which threads is :mod:`dcp_tiered.tiers.uploads`'s job.
Durability of a step moves staged → committed-local → durable-remote. On the remote tier a
step is committed by this protocol, so partial uploads are never visible:

1. every node uploads its own data files (skipping objects already there with the right size
   and checksum), then writes its completion record ``STEP/_nodes/node-K.json``;
2. the coordinator's node (the one holding rank 0's files and every manifest section) waits
   for every node's record, then writes the sections, ``.metadata`` and the manifest's index;
3. it moves the root's ``latest`` pointer forward to this step (compare-and-set), then, last,
   creates the commit marker ``STEP/_COMMITTED.json`` exclusively (If-None-Match).
Readers trust only steps with a marker. The pointer is written before the marker so that no
step is ever committed while the pointer names an older one: a pointer whose step has no
marker of the save it names is stale, and readers then list the root instead.

Requests: a node HEADs only its own keys (none for files its early uploads recorded done),
never lists the save; the coordinator polls the node records with one LIST per round.
"""

from __future__ import annotations

import enum
import errno
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from .._daemon_pool import DaemonPool
from ..backends.remote import RemoteBackend
from ..errors import (
    CheckpointNotFoundError,
    InsufficientSpaceError,
    IntegrityError,
    ManifestError,
    TierError,
    UploadFailedError,
)
from ..policy import integrity, layout, manifest, records
from ..policy.manifest import Manifest
from . import commit
from .local import LocalTier

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 16 * 2**20
_MAX_CHUNK_BYTES = 64 * 2**20  # memory a read-back or a download holds at once


def _chunk_bytes(remote: RemoteBackend) -> int:
    """Ranged GETs as large as the upload's parts (fewer requests), within a memory bound."""
    return min(max(_CHUNK_BYTES, remote.config.part_size_bytes), _MAX_CHUNK_BYTES)


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
    """The commit marker of ``step``, checked field by field (:func:`records.marker`); None if
    there is none. ManifestError if it is not a marker dcp_tiered wrote (truncated, replaced,
    nested deep, naming a save id that is not one of ours): the step is then unreadable, and
    callers that look at many steps skip it with a warning."""
    key = f"{step}/{layout.REMOTE_MARKER}"
    try:
        data = remote.get_bytes(key)
    except FileNotFoundError:
        return None
    return records.marker(data, step=step, where=remote.url(key))


def is_durable(remote: RemoteBackend, m: Manifest) -> bool:
    marker = read_marker(remote, m.step)
    return marker is not None and marker.get("save_id") == m.save_id


class Promotion:
    """Uploads one node's part of one committed step; the coordinator's node also commits."""

    def __init__(
        self, tier: LocalTier, remote: RemoteBackend, step: str, files_pool: DaemonPool
    ) -> None:
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
            # Remote steps are immutable: the step is another save's. Leave that copy whole.
            raise UploadFailedError(
                f"step {self.step!r} is already committed on {self.remote.config.url} by another "
                f"save ({marker.get('save_id')}, not this one's {m.save_id}): two jobs save "
                "into this prefix, or the step was saved again after it became durable. Remote "
                "steps are never overwritten: give each job its own remote prefix, or save "
                "under a new step name."
            )
        keys = self.keys(m)
        present = set(self.tier.backend.list_files(self.step)) & set(m.files)
        node = node_of_local_files(m, present)
        mine = sorted(n for n in present if int(m.files[n]["rank"]) in m.nodes[node])
        # What an earlier, interrupted attempt already uploaded: each file's own HEAD (no
        # listing of the whole save, whose pages grow with every node's objects).
        jobs = [self._pool.submit(self._upload, m, n, keys.file(n)) for n in mine]
        for fut in jobs:
            fut.result()
        record = {"save_id": m.save_id, "files": {n: m.files[n] for n in mine}}
        self.remote.put_bytes(keys.node_record(node), json.dumps(record).encode())
        if self.tier.backend.is_dir(area):
            self.tier.backend.remove_tree(area, reason="upload records of a node copy now uploaded")
        logger.info(
            "uploaded step=%s node=%d files=%d to %s",
            self.step,
            node,
            len(mine),
            self.remote.config.url,
        )
        if node == 0:
            self._commit(m, keys)

    def keys(self, m: Manifest) -> layout.RemoteKeys:
        cfg = self.remote.config
        return layout.RemoteKeys(self.step, m.save_id, cfg.prefix_strategy, cfg.hash_prefixes)

    def _upload(self, m: Manifest, name: str, key: str) -> None:
        size, checksum = int(m.files[name]["size"]), str(m.files[name]["checksum"])
        backend, area = self.tier.backend, layout.upload_area_name(self.step, m.save_id)
        # An upload started before the commit (by any rank of this node) holds this lock.
        lock = backend.lock_exclusive(area, f"{name}.lock") if backend.is_dir(area) else None
        try:
            if lock is not None and backend.exists(area, f"{name}.done"):
                return
            if remote_checksum(self.remote, key, size) == checksum:
                logger.debug("skip %s: already uploaded", key)
                return
            # Holding the lock, no upload of this key from this node is in flight: any
            # incomplete multipart upload of it is a leftover of an interrupted attempt.
            self.remote.abort_multipart_uploads(key, only={key})
            upload_verified(self.tier, self.remote, (self.step,), name, key, checksum)
            if lock is not None:  # an early upload of it still queued skips it
                backend.write_file(area, f"{name}.done", b"", sync=False)
        finally:
            if lock is not None:
                backend.unlock(lock)

    def _commit(self, m: Manifest, keys: layout.RemoteKeys) -> None:
        deadline = time.monotonic() + self.remote.config.durable_timeout_secs
        pending = set(range(1, len(m.nodes)))
        delay = 0.05
        while pending:
            # One listing per round (a page per 1,000 nodes), not a GET per node: the records
            # sit under this save's own prefix STEP/<save id>/, so one there is this save's.
            listed = set(self.remote.sizes(keys.node_records_prefix))
            pending -= {n for n in pending if keys.node_record(n) in listed}
            if pending:
                if time.monotonic() > deadline:
                    raise UploadFailedError(
                        f"step {self.step!r}: nodes {sorted(pending)} did not finish uploading "
                        f"within {self.remote.config.durable_timeout_secs:.0f} s; the step stays "
                        "committed locally and is retried at the next start"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        if not m.complete:
            raise UploadFailedError(
                f"step {self.step!r} in {self.tier.root} lacks manifest sections "
                f"{m.missing(m.sections)}, so it cannot be committed on the remote; it stays "
                "committed locally"
            )
        backend = self.tier.backend
        for node in m.sections:
            name = layout.manifest_section_name(node)
            self.remote.put_bytes(keys.section(node), backend.read_file(self.step, name))
        self.remote.put_bytes(keys.metadata, backend.read_file(self.step, layout.DCP_METADATA_NAME))
        self.remote.put_bytes(keys.manifest, backend.read_file(self.step, layout.MANIFEST_NAME))
        cfg = self.remote.config
        marker = layout.marker_body(
            self.step, m.save_id, m.committed_at_ns, cfg.prefix_strategy, cfg.hash_prefixes
        )
        advance_latest(self.remote, self.step, marker)
        if not self.remote.create_exclusive(
            f"{self.step}/{layout.REMOTE_MARKER}", json.dumps(marker).encode()
        ):
            existing = read_marker(self.remote, self.step) or {}
            if existing.get("save_id") != m.save_id:
                # Another save won the marker: ours is an orphan, and nobody else removes it.
                remove_save(
                    self.remote,
                    keys,
                    reason=f"save {m.save_id} of step {self.step} "
                    f"lost its commit to save {existing.get('save_id')}",
                )
                raise UploadFailedError(
                    f"step {self.step!r} was committed on {self.remote.config.url} by another "
                    f"save ({existing.get('save_id')}) while this one ({m.save_id}) uploaded: two "
                    "jobs save into this prefix. The other copy was left untouched and this "
                    "one's objects were removed; give each job its own remote prefix."
                )
        remove_orphan_saves(self.remote, self.step, keep={m.save_id})
        logger.info("durable-remote step=%s url=%s", self.step, self.remote.config.url)


def upload_verified(
    tier: LocalTier,
    remote: RemoteBackend,
    directory: tuple[str, ...],
    name: str,
    key: str,
    checksum: str,
) -> None:
    """Upload a local file after checking it against its manifest checksum, so promotion
    never copies corruption; then, with ``verify_uploads``, read the stored object back and
    check it too, so what the store holds is what was written (a store or proxy that
    corrupts a body gets it again, a few times, before the promotion fails)."""
    actual = tier.backend.file_checksum(*directory, name)
    path = tier.backend.path_of(*directory, name)
    if actual != checksum:
        raise IntegrityError(
            f"local file {path} fails its checksum ({actual} != manifest {checksum}); it was "
            "not uploaded. Re-save the step."
        )
    size = tier.backend.file_size(*directory, name)
    attempts = min(3, remote.config.retry.max_attempts)  # each one is a whole upload
    for attempt in range(1, attempts + 1):
        remote.put_file(path, key, checksum)
        if not remote.config.verify_uploads:
            return
        stored = remote_checksum(remote, key, size, read_back=True)
        if stored == checksum:
            return
        logger.warning(
            "%s holds other bytes than were uploaded (%s, manifest %s; attempt "
            "%d of %d): uploading it again",
            remote.url(key),
            stored,
            checksum,
            attempt,
            attempts,
        )
    remote.remove(key, reason="its stored bytes fail the manifest checksum")
    raise UploadFailedError(
        f"{remote.url(key)}: the store kept other bytes than were uploaded ({attempts} "
        f"attempts; CRC32C of the stored object != manifest {checksum}). Something between "
        "here and the store corrupts uploads (a proxy, a gateway, the store itself); the step "
        "stays committed locally and is retried at the next start."
    )


def remote_checksum(
    remote: RemoteBackend, key: str, size: int, *, read_back: bool | None = None
) -> str | None:
    """CRC32C of the object at ``key`` if it has ``size`` bytes and is whole, else None. Unless told
    otherwise, reads it back only where ``verify_uploads`` asks (or the store keeps no
    metadata); otherwise trusts the checksum recorded with it at upload (one HEAD)."""
    if read_back is None:
        read_back = remote.config.verify_uploads
    if not read_back:
        stat = remote.stat(key)
        if stat is None or stat[0] != size:
            return None
        if stat[1] is not None:
            return stat[1]
    # One GET for the whole object (a ranged GET per part would double the requests), no
    # HEAD before it: its length is counted as it streams, and an object longer than
    # ``size`` (not the one sought) is not read to its end.

    def fold(acc: tuple[int, int], chunk: bytes) -> tuple[int, int]:
        length = acc[1] + len(chunk)
        if length > size:
            raise _OtherObject
        return integrity.checksum(chunk, acc[0]), length

    try:
        crc, length = remote.fold_object(key, _chunk_bytes(remote), fold, (0, 0))
    except (FileNotFoundError, _OtherObject):
        return None
    except IntegrityError as e:  # the store's own checksum of it disagrees with its bytes
        logger.warning("%s", e)
        return None
    return integrity.format_checksum(crc) if length == size else None


class _OtherObject(Exception):
    """Ends a read-back early: the object is longer than the one sought."""


def keys_of_step(remote: RemoteBackend, step: str) -> layout.RemoteKeys | None:
    """The keys of the save committed as ``step`` on the remote, or None if none is."""
    marker = read_marker(remote, step)
    if marker is None:
        return None
    try:
        return layout.keys_of_marker(step, marker)
    except ValueError as e:
        raise IntegrityError(
            f"{remote.url(f'{step}/{layout.REMOTE_MARKER}')}: {e}; this is "
            "not a marker dcp_tiered wrote. Restore another step."
        ) from e


def remove_save(remote: RemoteBackend, keys: layout.RemoteKeys, *, reason: str) -> None:
    """Delete every object of one save (never a marker, nor another save's objects)."""
    for prefix in keys.prefixes():
        if (
            prefix.startswith(layout.HASHED_DATA)
            and remote.config.prefix_strategy != "hash"
            and keys.prefix_strategy != "hash"
        ):
            continue
        for key in sorted(remote.sizes(prefix)):
            if keys.owns(key):
                remote.remove(key, reason=reason)


def quarantined_saves(remote: RemoteBackend, step: str) -> set[str]:
    prefix = f"{step}/{layout.REMOTE_QUARANTINE}/"
    return {k[len(prefix) :].removesuffix(".json") for k in remote.sizes(prefix)}


def remove_orphan_saves(
    remote: RemoteBackend, step: str, *, keep: set[str], older_than: float | None = None
) -> None:
    """Delete the objects of saves of ``step`` that no marker or quarantine record names
    (killed or lost uploads), except the saves in ``keep``; with ``older_than`` (epoch s),
    only saves whose newest object is older than that (younger ones may still be uploading).
    Layout-1 objects (directly under the step) are left alone: they may be a quarantined step's."""
    prefixes = [f"{step}/"]
    if remote.config.prefix_strategy == "hash":  # every bucket there is, whatever the count
        buckets = remote.children(f"{layout.HASHED_DATA}/")
        prefixes += [f"{layout.HASHED_DATA}/{b}/{step}/" for b in buckets]
    # The save ids under each prefix (one delimited listing each), then only the orphans' own
    # objects: never a listing of the kept saves' objects, which grow with the job.
    candidates = {
        prefix: [
            sid for sid in remote.children(prefix) if layout.is_save_id(sid) and sid not in keep
        ]
        for prefix in prefixes
    }
    if not any(candidates.values()):
        return
    try:
        marker = read_marker(remote, step)
    except ManifestError as e:  # which save is committed is unknown: delete none of them
        logger.warning("not sweeping the saves of %s: %s", step, e)
        return
    keep = (
        keep | quarantined_saves(remote, step) | ({str(marker.get("save_id"))} if marker else set())
    )
    newest: dict[str, float] = {}
    found: dict[str, list[str]] = {}
    for prefix, sids in candidates.items():
        for sid in sids:
            if sid in keep:
                continue
            for key, mtime in remote.modified(f"{prefix}{sid}/").items():
                found.setdefault(sid, []).append(key)
                newest[sid] = max(newest.get(sid, 0.0), mtime)
    for sid, keys in sorted(found.items()):
        if older_than is not None and newest[sid] >= older_than:
            continue
        for key in sorted(keys):
            remote.remove(key, reason=f"orphan of step {step}: save {sid} was never committed")


def read_latest(remote: RemoteBackend) -> tuple[dict[str, Any] | None, str | None] | None:
    """The root's ``latest`` pointer and its version tag (for compare-and-set), None if there
    is none; the pointer is None if it is unreadable (readers then list the root)."""
    got = remote.get_tagged(layout.REMOTE_LATEST)
    if got is None:
        return None
    try:
        body = records.latest_pointer(got[0], where=remote.url(layout.REMOTE_LATEST))
    except ManifestError as e:
        logger.warning("ignoring the latest pointer: %s", e)
        return None, got[1]
    return body, got[1]


def advance_latest(remote: RemoteBackend, step: str, marker: dict[str, Any]) -> None:
    """Move the ``latest`` pointer to ``step`` unless it names a newer step (in
    `layout.newest`'s order) that is committed, or about to be. Compare-and-set: two saves
    racing re-read and retry, so the pointer only ever moves forward. A pointer naming a step
    whose marker is another save's, or missing while no save of it is running, is replaced."""
    body = json.dumps(layout.latest_body(step, marker)).encode()
    for _ in range(16):
        current = read_latest(remote)
        if current is not None and current[0] is not None:
            cur = current[0]
            there = (str(cur["step"]), int(cur["marker"]["committed_at_ns"]))
            if not layout.is_newer(step, int(marker["committed_at_ns"]), there):
                try:
                    found = read_marker(remote, there[0])
                except ManifestError as e:  # not a commit of that step: the pointer is stale
                    logger.warning("%s", e)
                    found = None
                if found is not None and found.get("save_id") == cur["marker"].get("save_id"):
                    return  # a newer step is committed: it stays latest
                if time.time_ns() - there[1] < remote.config.durable_timeout_secs * 1e9:
                    return  # a newer save still committing: its marker comes soon
        if remote.put_if(layout.REMOTE_LATEST, body, None if current is None else current[1]):
            return
    raise UploadFailedError(
        f"{remote.url(layout.REMOTE_LATEST)} kept changing under 16 attempts to move it to "
        f"{step!r}: many saves commit into this prefix at once; the step is retried"
    )


def sweep_orphans(tier: LocalTier, remote: RemoteBackend) -> None:
    """Remove what killed uploads left on the remote: saves never committed there, whose
    newest object is older than ``orphan_grace_secs``, and that are not committed on this
    (the coordinator's) local tier, whose promotion would still commit them."""
    pending = {
        (s.name, tier.read_manifest(s.name).save_id)
        for s in tier.steps()
        if s.verified_format and _readable(tier, s.name)
    }
    cutoff = time.time() - remote.config.orphan_grace_secs
    names = set(remote.children()) - {layout.HASHED_DATA}
    if remote.config.prefix_strategy == "hash":  # a step's data may sit only under data/
        for bucket in remote.children(f"{layout.HASHED_DATA}/"):
            names.update(remote.children(f"{layout.HASHED_DATA}/{bucket}/"))
    for step in sorted(n for n in names if layout.is_step_name(n)):
        keep = {sid for name, sid in pending if name == step}
        remove_orphan_saves(remote, step, keep=keep, older_than=cutoff)


def _readable(tier: LocalTier, step: str) -> bool:
    try:
        tier.read_manifest(step)
        return True
    except (ManifestError, OSError):
        return False


def quarantine_remote_step(remote: RemoteBackend, step: str, *, reason: str) -> bool:
    """Move the commit marker of ``step`` aside (its objects stay where they are), so that
    ``latest``, retention and the step's immutability ignore it and the step can be saved
    again. Returns whether a marker was there."""
    marker = read_marker(remote, step)
    if marker is None:
        return False
    sid = str(marker.get("save_id"))
    if not layout.is_save_id(sid):
        raise IntegrityError(
            f"{remote.url(f'{step}/{layout.REMOTE_MARKER}')} names no valid "
            "save id; it was left in place"
        )
    record = {**marker, "quarantined_at_ns": time.time_ns(), "reason": reason}
    remote.put_bytes(layout.quarantine_record_key(step, sid), json.dumps(record).encode())
    remote.remove(f"{step}/{layout.REMOTE_MARKER}", reason=f"quarantined: {reason}")
    logger.warning(
        "quarantined remote step %s (save %s) of %s: %s; its objects stay under %s",
        step,
        sid,
        remote.config.url,
        reason,
        layout.quarantine_record_key(step, sid),
    )
    return True


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
    if any(
        (p := layout.parse_hidden_dir(n)) and p[0] == step and p[2] == layout.TMP_SUFFIX
        for n in tier.backend.list_names()
    ):
        return Durability.STAGED
    raise CheckpointNotFoundError(f"step {step!r} is neither in {tier.root} nor remote")


def read_manifest(
    remote: RemoteBackend, keys: layout.RemoteKeys, nodes: Iterable[int] | None = None
) -> Manifest:
    """A committed save's manifest, with the sections of ``nodes`` (default: all) merged in."""
    return read_manifest_files(remote, keys, nodes)[0]


def merge_sections(
    remote: RemoteBackend, keys: layout.RemoteKeys, m: Manifest, nodes: Iterable[int]
) -> Manifest:
    for node in m.missing(nodes):
        key = keys.section(node)
        m = manifest.parse_section(m, node, remote.get_bytes(key), where=remote.url(key))
    return m


def read_manifest_files(
    remote: RemoteBackend, keys: layout.RemoteKeys, nodes: Iterable[int] | None = None
) -> tuple[Manifest, dict[str, bytes]]:
    """The manifest (as :func:`read_manifest`) and the bytes of its files, by file name.
    CheckpointNotFoundError when the save's manifest is not on the store (its marker names a
    save whose objects are gone)."""
    try:
        index = remote.get_bytes(keys.manifest)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(
            f"{remote.url(keys.manifest)} is not there: the commit marker of step "
            f"{keys.step!r} names a save ({keys.save_id}) whose objects are gone from the "
            "store. That step cannot be restored from it; restore another step."
        ) from e
    m = manifest.parse(index, where=remote.url(keys.manifest))
    files = {}
    for node in m.sections if nodes is None else nodes:
        key = keys.section(node)
        files[layout.manifest_section_name(node)] = data = remote.get_bytes(key)
        m = manifest.parse_section(m, node, data, where=remote.url(key))
    files[layout.MANIFEST_NAME] = index  # last, as a save writes it
    return m, files


def _sections_for(
    remote: RemoteBackend,
    keys: layout.RemoteKeys,
    nodes: Iterable[int],
    have: dict[str, bytes],
) -> dict[str, bytes]:
    """The sections of ``nodes`` that ``have`` lacks, from the remote (a hydrated step keeps
    the sections of every file it holds)."""
    out = {}
    for node in nodes:
        name = layout.manifest_section_name(node)
        if name not in have:
            out[name] = remote.get_bytes(keys.section(node))
    return out


def adopt_remote_step(tier: LocalTier, remote: RemoteBackend, step: str) -> None:
    """Commit a durable remote step on the local tier as its manifest and ``.metadata`` alone.

    Its data stays remote: readers fetch each file from there, verified, so a fresh node can
    restore a step through tools that look for it on local disk (DeepSpeed's loader) without
    first downloading all of it. Committed like a save: temporary directory, rename.
    """
    if tier.has_step(step):
        return
    keys = keys_of_step(remote, step)
    if keys is None:
        raise CheckpointNotFoundError(f"step {step!r} is not committed on {remote.config.url}")
    m, files = read_manifest_files(remote, keys)
    files = {layout.DCP_METADATA_NAME: remote.get_bytes(keys.metadata), **files}
    commit.build_and_publish(
        tier.backend, step, m.save_id, lambda tmp: None, files, what="adoption of the remote step"
    )
    logger.info(
        "adopted step=%s from %s into %s (data stays remote)", step, remote.config.url, tier.root
    )


def hydrate_step(
    tier: LocalTier,
    remote: RemoteBackend,
    step: str,
    m: Manifest,
    names: list[str],
    keys: layout.RemoteKeys,
    progress: Callable[[int], object] | None = None,
) -> None:
    """Copy data files ``names`` of durable remote step ``step`` (manifest ``m``) into the
    local tier, so the next load reads them locally.

    Committed like a save: a complete copy of the step is built in a temporary directory (the
    local step's other files hard-linked, no bytes copied; the named files downloaded and
    checked against the manifest; manifest and .metadata last), then swapped in atomically for
    the local step, if there is one (e.g. adopted as manifest and .metadata alone). So no local
    step ever looks committed while it lacks files, whatever fails or crashes. The ranks of a
    node hydrate one at a time, each building on the copy the others published.
    ``progress(n)`` is called as each chunk of ``n`` bytes arrives (the CLI's progress bar).
    """
    backend = tier.backend
    need = sum(int(m.files[n]["size"]) for n in names)
    if need > (free := backend.free_bytes()):
        raise InsufficientSpaceError(
            errno.ENOSPC,
            (
                f"hydrating step {step!r} needs {need / 2**20:.1f} MiB but {tier.root} has "
                f"{free / 2**20:.1f} MiB free"
            ),
        )
    # The sections the reader merged, and those of the nodes whose files arrive here.
    sections = sorted(m.loaded | {m.node_of_rank(int(m.files[n]["rank"])) for n in names})
    lock = backend.lock_root_exclusive(layout.HYDRATE_LOCK_NAME)
    try:
        keep: list[str] = []
        if tier.has_step(step):
            here = tier.read_manifest(step)
            if here.save_id != m.save_id:
                raise ManifestError(
                    f"the local {step} in {tier.root} is another save ({here.save_id}) than the "
                    f"remote copy being read ({m.save_id}); they are never mixed"
                )
            meta = {}
            for name in backend.list_files(step):
                if layout.is_step_metadata(name):
                    meta[name] = backend.read_file(step, name)
                    continue
                if name in names:
                    continue
                if not backend.is_regular_file(step, name):
                    raise ManifestError(
                        f"{backend.path_of(step, name)} is not a plain file: "
                        "the step is left as it is"
                    )
                keep.append(name)
        else:
            there, meta = read_manifest_files(remote, keys, sections)
            if there.save_id != m.save_id:
                raise ManifestError(f"the remote {step} changed while it was being read")
            meta[layout.DCP_METADATA_NAME] = remote.get_bytes(keys.metadata)

        def fill(tmp: str) -> None:
            for name in keep:
                backend.link_file((step, name), (tmp, name))
            for name in names:
                _download(
                    tier,
                    remote,
                    keys.file(name),
                    (tmp, name),
                    int(m.files[name]["size"]),
                    str(m.files[name]["checksum"]),
                    progress,
                )

        commit.build_and_publish(
            backend,
            step,
            f"h{uuid.uuid4().hex[:11]}",
            fill,
            {**_sections_for(remote, keys, sections, meta), **meta},
            what="hydration",
        )
    finally:
        backend.unlock(lock)


def _download(
    tier: LocalTier,
    remote: RemoteBackend,
    key: str,
    dst: tuple[str, str],
    size: int,
    checksum: str,
    progress: Callable[[int], object] | None = None,
) -> None:
    """Stream one remote object into a local file in bounded chunks, checking its checksum."""
    crc = 0
    with tier.backend.open_write(*dst) as f:
        span = _chunk_bytes(remote)
        for start in range(0, size, span):
            chunk = remote.get_range(key, start, min(size, start + span))
            crc = integrity.checksum(chunk, crc)
            f.write(chunk)
            if progress is not None:
                progress(len(chunk))
    if integrity.format_checksum(crc) != checksum:
        raise IntegrityError(
            f"{remote.url(key)} fails its checksum against the manifest; it "
            "was not copied to the local tier"
        )


def delete_remote_step(remote: RemoteBackend, step: str, *, reason: str) -> None:
    """Remove a committed remote step: its marker first, so readers stop trusting it before
    any of its objects go; then its save's objects (quarantined saves of the name stay)."""
    keys = keys_of_step(remote, step)
    remote.remove(f"{step}/{layout.REMOTE_MARKER}", reason=reason)
    if keys is not None:
        remove_save(remote, keys, reason=reason)
    remote.remove_empty_dirs(f"{step}/")
