"""The remote tier: what a committed remote step is, and the acts on one (read, quarantine,
release, delete), each on proof.

A step is committed on the remote once its marker ``STEP/_COMMITTED.json`` names a save whose
objects live under ``STEP/<save id>/`` (how a save gets there, and the proof a marker needs, is
:mod:`dcp_tiered.tiers.promotion`'s). Readers trust only steps with a marker. The root's
``latest`` pointer is moved before the marker is written, so no step is ever committed while
the pointer names an older one: a pointer whose step has no marker of the save it names is
stale, and readers then list the root instead.

Acts that un-commit or delete (quarantine, delete) act only on a marker that names this run
(or a save the run adopted), and delete only keys of our exact name grammar; anything else
under the prefix is left alone.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from ..backends import ranged_reads
from ..backends.remote import RemoteBackend
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ForeignPathError,
    InsufficientSpaceError,
    IntegrityError,
    ManifestError,
    TierError,
    UploadFailedError,
)
from ..policy import integrity, layout, manifest, records
from ..policy.identity import Owner
from ..policy.manifest import Manifest
from . import commit, ownership
from .local import LocalTier

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 16 * 2**20
_MAX_CHUNK_BYTES = 64 * 2**20  # memory a read-back or a download holds at once


def chunk_bytes(remote: RemoteBackend) -> int:
    """Ranged GETs as large as the upload's parts (fewer requests), within a memory bound."""
    return min(max(_CHUNK_BYTES, remote.config.part_size_bytes), _MAX_CHUNK_BYTES)


class Durability(str, enum.Enum):
    STAGED = "staged"  # being written on the local tier
    COMMITTED_LOCAL = "committed-local"
    DURABLE_REMOTE = "durable-remote"
    MEMORY = "memory"  # in a node's memory tier only (``dcp-tiered status``)
    PEER_COPIES = "copies"  # only partners' copies of some ranks' snapshots (peer replication)


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
    """Delete every object of one save by our name grammar, its claims last (never a marker,
    another save's objects, or anything else someone put under its prefixes)."""
    found: list[str] = []
    for prefix in keys.prefixes():
        if (
            prefix.startswith(layout.HASHED_DATA)
            and remote.config.prefix_strategy != "hash"
            and keys.prefix_strategy != "hash"
        ):
            continue
        found += [key for key in remote.sizes(prefix) if keys.owns(key)]
    for key in sorted(found, key=lambda k: (k.startswith(keys.claims_prefix), k)):
        remote.remove(key, reason=reason)


def owner(remote: RemoteBackend, marker: dict[str, Any], step: str, run_id: str | None) -> Owner:
    """Whose the save a marker (or a quarantine record) commits is, for run ``run_id``: this
    run's when it names the run, or the prefix's record says the run adopted it."""
    written_by = layout.run_of(marker)
    save_id = str(marker.get("save_id"))
    if run_id is not None and written_by == run_id:
        return Owner.OURS
    record = ownership.read_remote(remote)
    if record is not None and record.run_id == run_id:
        return record.owner(written_by, step, save_id)
    return Owner.UNOWNED if written_by is None else Owner.FOREIGN


def _require_ours(
    remote: RemoteBackend, marker: dict[str, Any], step: str, run_id: str | None, doing: str
) -> None:
    whose = owner(remote, marker, step, run_id)
    if whose == Owner.OURS:
        return
    written = (
        "saved before run identities"
        if whose == Owner.UNOWNED
        else f"run {layout.run_of(marker)!r}'s"
    )
    raise ForeignPathError(
        f"{remote.url(f'{step}/{layout.REMOTE_MARKER}')} commits a save {written}, not run "
        f"{run_id!r}'s: it was not {doing}. If it is yours, make it this run's with "
        f"`dcp-tiered adopt ROOT {step} --remote {remote.config.url}`"
    )


def holds_whole(remote: RemoteBackend, m: Manifest) -> bool:
    """Whether the store holds save ``m`` whole as far as ``m`` knows its files: its marker
    names that save, and one listing per prefix shows every file ``m`` lists with its size.
    What deletes the last local copy of a step asks this first."""
    marker = read_marker(remote, m.step)
    if marker is None or marker.get("save_id") != m.save_id:
        return False
    keys = layout.keys_of_marker(m.step, marker)
    wanted = {keys.file(name): int(info["size"]) for name, info in m.files.items()}
    listed: dict[str, tuple[int, str | None]] = {}
    for prefix in sorted({key.rpartition("/")[0] + "/" for key in wanted}):
        listed.update(remote.listing(prefix))
    return all(key in listed and listed[key][0] == size for key, size in wanted.items())


def quarantined(remote: RemoteBackend) -> list[tuple[str, str]]:
    """``(step, save id)`` of every save quarantined on the remote."""
    out = []
    for key in remote.glob(f"*/{layout.REMOTE_QUARANTINE}/*.json"):
        step, _, rest = key.partition("/")
        sid = rest.rpartition("/")[2].removesuffix(".json")
        if layout.is_step_name(step) and layout.is_save_id(sid):
            out.append((step, sid))
    return out


def quarantined_saves(remote: RemoteBackend, step: str) -> set[str]:
    prefix = f"{step}/{layout.REMOTE_QUARANTINE}/"
    return {k[len(prefix) :].removesuffix(".json") for k in remote.sizes(prefix)}


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


def quarantine_remote_step(
    remote: RemoteBackend, step: str, *, reason: str, run_id: str | None
) -> bool:
    """Move the commit marker of ``step`` aside (its objects stay where they are), so that
    ``latest``, retention and the step's immutability ignore it and the step can be saved
    again. Returns whether a marker was there. ForeignPathError if it commits a save that is
    not run ``run_id``'s (see :func:`owner`): that is never touched."""
    marker = read_marker(remote, step)
    if marker is None:
        return False
    sid = str(marker.get("save_id"))
    if not layout.is_save_id(sid):
        raise IntegrityError(
            f"{remote.url(f'{step}/{layout.REMOTE_MARKER}')} names no valid "
            "save id; it was left in place"
        )
    _require_ours(remote, marker, step, run_id, "quarantined")
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


def release_remote_step(remote: RemoteBackend, step: str, save_id: str, *, run_id: str) -> None:
    """Undo :func:`quarantine_remote_step`: commit quarantined save ``save_id`` of ``step`` again
    (its marker back, exclusively, then its quarantine record removed). Refused while the step
    is committed by another save (saved again since), and for a save not run ``run_id``'s."""
    key = layout.quarantine_record_key(step, save_id)
    try:
        record = records.quarantine_record(remote.get_bytes(key), step=step, where=remote.url(key))
        marker = {k: v for k, v in record.items() if k not in ("quarantined_at_ns", "reason")}
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"no quarantined save {save_id} of {step} on {remote.config.url}"
        ) from None
    if marker.get("step") != step or marker.get("save_id") != save_id:
        raise ManifestError(f"{remote.url(key)} names another save than {step}/{save_id}")
    _require_ours(remote, marker, step, run_id, "released")
    if not remote.create_exclusive(f"{step}/{layout.REMOTE_MARKER}", json.dumps(marker).encode()):
        raise CheckpointExistsError(
            f"{step} is committed on {remote.config.url} by another save (saved again since the "
            f"quarantine): quarantined save {save_id} was left aside"
        )
    remote.remove(key, reason=f"released from quarantine: {step} is save {save_id} again")
    logger.warning("released remote step %s (save %s) of %s", step, save_id, remote.config.url)


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
    if step in layout.unfinished_steps(tier.backend.list_names()):
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
    )  # a step committed here meanwhile (a save) is never replaced: CheckpointExistsError
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
        replaces = None  # the local copy this completes, if any: nothing else is replaced
        if tier.has_step(step):
            here = tier.read_manifest(step)
            if here.save_id != m.save_id:
                raise ManifestError(
                    f"the local {step} in {tier.root} is another save ({here.save_id}) than the "
                    f"remote copy being read ({m.save_id}); they are never mixed"
                )
            replaces = here.save_id
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
            replaces=replaces,
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
    span = chunk_bytes(remote)
    ranges = [(start, min(size, start + span)) for start in range(0, size, span)]
    pieces = ranged_reads.read_ranges(
        [(key, ranges)], remote.get_range, span, remote.config.max_concurrency
    )
    with tier.backend.open_write(*dst) as f, contextlib.closing(pieces):
        for _, _, _, chunk in pieces:
            crc = integrity.checksum(chunk, crc)
            f.write(chunk)
            if progress is not None:
                progress(len(chunk))
    if integrity.format_checksum(crc) != checksum:
        raise IntegrityError(
            f"{remote.url(key)} fails its checksum against the manifest; it "
            "was not copied to the local tier"
        )


def delete_remote_step(
    remote: RemoteBackend, step: str, *, reason: str, run_id: str | None
) -> None:
    """Remove a committed remote step: its marker first, so readers stop trusting it before
    any of its objects go; then its save's objects (quarantined saves of the name stay).
    ForeignPathError if it is not run ``run_id``'s: never deleted."""
    marker = read_marker(remote, step)
    if marker is None:
        return
    _require_ours(remote, marker, step, run_id, "deleted")
    keys = keys_of_step(remote, step)
    remote.remove(f"{step}/{layout.REMOTE_MARKER}", reason=reason)
    if keys is not None:
        remove_save(remote, keys, reason=reason)
    remote.remove_empty_dirs(f"{step}/")
