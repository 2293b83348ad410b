"""Uploading one data file to the remote tier, verified: the one upload both the early upload
(as a file is written) and the promotion (after the local commit) run, under the file's lock
in the save's upload area, so a node uploads each file once.

The store's word decides what is there: a file is checked against its manifest checksum before
it is sent, and what the store then holds is proven (its acceptance of a body with its CRC32C,
or a read-back). Local ``.done`` records only ever save this process work it did itself.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Callable

from ..backends import s3_checksums
from ..backends.remote import RemoteBackend
from ..errors import IntegrityError, UploadFailedError
from ..policy import integrity, layout
from .local import LocalTier
from .remote import chunk_bytes

logger = logging.getLogger(__name__)

# Marks this process's own records of early uploads: a record another process wrote (before a
# restart) proves nothing about what the store holds now.
PROCESS_TOKEN = uuid.uuid4().hex
os.register_at_fork(after_in_child=lambda: globals().update(PROCESS_TOKEN=uuid.uuid4().hex))


def done_record(tag: str | None) -> bytes:
    """What an upload area's ``<file>.done`` holds: who verified the upload, and its tag."""
    return json.dumps({"process": PROCESS_TOKEN, "tag": tag}).encode()


def trusted_tag(data: bytes) -> tuple[bool, str | None]:
    """``(trusted, tag)`` of a ``.done`` record: trusted only if this process wrote it."""
    try:
        body = json.loads(data)
        return body.get("process") == PROCESS_TOKEN, body.get("tag")
    except (ValueError, AttributeError, RecursionError):
        return False, None


def upload_locked(
    tier: LocalTier,
    remote: RemoteBackend,
    keys: layout.RemoteKeys,
    name: str,
    checksum: str,
    *,
    early: bool = False,
    trust_records: bool = True,
    size: int = 0,
    may_start: Callable[[], bool] = lambda: True,
) -> str | None:
    """Upload data file ``name`` of save ``keys`` once per node, whoever comes first: the early
    upload (``early``, as the file is written, before the local commit) or the promotion. Both
    hold the file's lock in the save's upload area, and the one that uploads leaves a
    ``<file>.done`` record (with the tag the store gave the bytes it verified) for the other.

    Early: no area, or any record in it, means the promotion got there first (the area is
    this save's, made by live processes when they queue the upload); ``may_start()`` is asked
    under the lock (the remote step is free); the file is read from the save's temporary
    directory, or the step if it was committed meanwhile.
    Promotion (of ``size`` bytes): a record counts only if this process wrote it
    (``trust_records``); else the store is asked first (a resumed promotion after a restart),
    and a leftover multipart upload of the key is aborted before it is uploaded again.
    Returns the stored object's tag (None where not known, or not uploaded early)."""
    backend, step = tier.backend, keys.step
    area, key = layout.upload_area_name(step, str(keys.save_id)), keys.file(name)
    lock = backend.lock_exclusive(area, f"{name}.lock") if backend.is_dir(area) else None
    if early and lock is None:
        # The area is made when the upload is queued, before the commit (a promotion waits
        # on its locks); gone now, the promotion finished and removed it, or the save was
        # abandoned and swept: nothing left to upload early, and nothing to make again.
        return None
    try:
        if lock is not None and (early or trust_records) and backend.exists(area, f"{name}.done"):
            if early:
                return None
            trusted, tag = trusted_tag(backend.read_file(area, f"{name}.done"))
            if trusted:  # this process verified it; the commit's listing checks it again
                return tag
        if early:
            if not may_start():
                return None
            tag = _upload_uncommitted(tier, remote, keys, name, checksum)
        else:
            stored, tag = verify_object(remote, key, size)
            if stored == checksum:
                logger.debug("skip %s: already uploaded", key)
                return tag
            # Holding the lock, no upload of this key from this node is in flight: any
            # incomplete multipart upload of it is a leftover of an interrupted attempt.
            remote.abort_multipart_uploads(key, only={key})
            tag = upload_verified(tier, remote, (step,), name, key, checksum)
        if lock is not None:  # an upload of it still queued skips it
            backend.write_file(area, f"{name}.done", done_record(tag), sync=False)
        return tag
    finally:
        if lock is not None:
            backend.unlock(lock)


def _upload_uncommitted(
    tier: LocalTier, remote: RemoteBackend, keys: layout.RemoteKeys, name: str, checksum: str
) -> str | None:
    """An early upload: the file is in the save's temporary directory until the local commit
    renames that to the step, which can happen between any two of the upload's reads of it
    (its checksum, its size, the upload itself); then it is read again from the step."""
    step = keys.step
    tmp = layout.tmp_dir_name(step, str(keys.save_id))
    try:
        return upload_verified(tier, remote, (tmp,), name, keys.file(name), checksum)
    except FileNotFoundError:
        if not tier.backend.exists(step, name):
            raise  # neither: the save was abandoned
        logger.debug("early upload of %s/%s: committed meanwhile, read from the step", step, name)
        return upload_verified(tier, remote, (step,), name, keys.file(name), checksum)


def upload_verified(
    tier: LocalTier,
    remote: RemoteBackend,
    directory: tuple[str, ...],
    name: str,
    key: str,
    checksum: str,
) -> str | None:
    """Upload a local file after checking it against its manifest checksum, so promotion
    never copies corruption (S3: the bytes sent are checked as they are read); then prove
    what the store holds is what was written (a store or proxy that corrupts a body gets it
    again, a few times, before the promotion fails): on a store that proved it refuses a body
    failing its CRC32C (``verify_uploads="auto"``), its acceptance of every body; elsewhere
    (``"auto"`` or ``True``), a read-back of the stored object checked against the manifest.
    Returns the stored object's version tag (None with ``verify_uploads=False``)."""
    path = tier.backend.path_of(*directory, name)
    # S3 uploads check the bytes they send (s3_checksums): no separate read of the file.
    actual = checksum if remote.protocol in ("s3", "s3a") else None
    actual = actual or tier.backend.file_checksum(*directory, name)
    if actual != checksum:
        raise IntegrityError(
            f"local file {path} fails its checksum ({actual} != manifest {checksum}); it was "
            "not uploaded. Re-save the step."
        )
    size = tier.backend.file_size(*directory, name)
    attempts = min(3, remote.config.retry.max_attempts)  # each one is a whole upload
    for attempt in range(1, attempts + 1):
        sent = remote.put_file(path, key, checksum)
        mode = remote.config.verify_uploads
        if mode is False:
            return None
        if mode == "auto" and sent is not None and remote.validates_checksums():
            return sent  # the store checked every body against the CRC32C of the bytes read
        stored, tag = verify_object(remote, key, size, read_back=True)
        if stored == checksum:
            return tag
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


def verify_object(
    remote: RemoteBackend, key: str, size: int, *, read_back: bool | None = None
) -> tuple[str | None, str | None]:
    """``(CRC32C, version tag)`` of the object at ``key`` if it has ``size`` bytes and is whole,
    else ``(None, None)``. Unless told otherwise, reads it back only where ``verify_uploads``
    asks (or the store keeps no metadata); otherwise trusts the checksum recorded with it at
    upload: on a store that checks checksums (``"auto"``), one HEAD that shows the store
    checked it (with its tag); with ``verify_uploads=False``, one HEAD (no tag)."""
    mode = remote.config.verify_uploads
    if read_back is None:
        read_back = mode is True or (mode == "auto" and not remote.validates_checksums())
    if not read_back and mode == "auto" and remote.validates_checksums():
        got = s3_checksums.head(remote, key)
        if got is None or got[0] != size:
            return None, None
        if got[3]:
            return got[1], got[2]
    elif not read_back:
        stat = remote.stat(key)
        if stat is None or stat[0] != size:
            return None, None
        if stat[1] is not None:
            return stat[1], None
    # One GET for the whole object (a ranged GET per part would double the requests), no
    # HEAD before it: its length is counted as it streams, and an object longer than
    # ``size`` (not the one sought) is not read to its end.

    def fold(acc: tuple[int, int], chunk: bytes) -> tuple[int, int]:
        length = acc[1] + len(chunk)
        if length > size:
            raise _OtherObject
        return integrity.checksum(chunk, acc[0]), length

    try:
        (crc, length), tag = remote.fold_object(key, chunk_bytes(remote), fold, (0, 0))
    except (FileNotFoundError, _OtherObject):
        return None, None
    except IntegrityError as e:  # the store's own checksum of it disagrees with its bytes
        logger.warning("%s", e)
        return None, None
    return (integrity.format_checksum(crc), tag) if length == size else (None, None)


def remote_checksum(
    remote: RemoteBackend, key: str, size: int, *, read_back: bool | None = None
) -> str | None:
    """The CRC32C part of :func:`verify_object`."""
    return verify_object(remote, key, size, read_back=read_back)[0]


class _OtherObject(Exception):
    """Ends a read-back early: the object is longer than the one sought."""
