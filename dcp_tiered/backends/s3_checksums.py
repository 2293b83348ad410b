"""S3 uploads that carry the CRC32C of every body they send, and whether a store checks them.

A store that checks an ``x-amz-checksum-crc32c`` header against the body it receives (AWS S3
does, and refuses a mismatch with BadDigest) proves at upload what a read-back proves after it:
the bytes it kept are the bytes whose CRC32C was computed here from the local file. Not every
S3-compatible store checks (moto 5.2 keeps a body whatever CRC32C it is sent), so it is found
out, never assumed: once per (endpoint, bucket) per process, a PUT of a tiny object with a
deliberately wrong CRC32C must be refused and one with the right CRC32C accepted (:func:`
validates`). Until a store has proved it, uploads keep their read-back
(:func:`dcp_tiered.tiers.file_upload.upload_verified`).

Uploads here always send the checksums (harmless where a store ignores them): a single PUT
with the object's CRC32C, or a multipart upload with each part's CRC32C, parts read and sent
``max_concurrency`` at a time (memory: that many parts). The CRC32Cs of the bytes read are
combined into the file's and must match the manifest's before the object is completed, so a
local file that changed or rotted since it was checksummed never becomes an object.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from fsspec.asyn import sync

from ..errors import IntegrityError, PermanentTierError, TransientTierError
from ..policy import integrity, layout
from . import _clients

T = TypeVar("T")


class RemoteBackend(Protocol):
    """What this module uses of :class:`~dcp_tiered.backends.remote.RemoteBackend`: named here,
    not imported, since that module builds on this one."""

    config: Any  # a RemoteConfig
    base: str
    protocol: str

    @property
    def fs(self) -> Any: ...

    def path(self, key: str) -> str: ...
    def url(self, key: str) -> str: ...
    def remove(self, key: str, *, reason: str) -> None: ...
    def _call(self, op: str, key: str, fn: Callable[[], T], retry: Any = None) -> T: ...


logger = logging.getLogger(__name__)

# What a store that checks the header answers a body that fails it: AWS S3 says BadDigest;
# some S3-compatible stores say InvalidRequest. Anything else is not an answer to the probe.
_REFUSED_CODES = {"BadDigest", "InvalidRequest", "XAmzContentChecksumMismatch"}
_PROBE_BODY = b"dcp-tiered checksum probe: this object is deleted by the probe that wrote it\n"
_PROBE_RETRY_SECS = 300.0  # a probe that got no answer (store unreachable) is tried again then
_MAX_PARTS = 10_000  # S3's limit on parts of one multipart upload

_lock = threading.Lock()  # one probe at a time: uploads wait for the verdict, not probe twice
_verdicts: dict[tuple[str, str], bool] = {}
_retry_at: dict[tuple[str, str], float] = {}
_started_lock = threading.Lock()
_started: set[tuple[str, str]] = set()


def header(crc: int) -> str:
    """A CRC32C as S3's checksum headers carry it: base64 of its 4 big-endian bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


def store_of(backend: RemoteBackend) -> tuple[str, str]:
    """(endpoint, bucket): what one probe's verdict holds for."""
    opts = backend.config.storage_options
    client = opts.get("client_kwargs") or {}
    endpoint = (
        client.get("endpoint_url")
        or opts.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or "aws"
    )
    return str(endpoint), backend.base.partition("/")[0]


def validates(backend: RemoteBackend) -> bool:
    """Whether the store refuses a body whose CRC32C header does not match it (probed once per
    store per process; False where it accepts it, does not answer, or is not S3)."""
    if backend.protocol not in ("s3", "s3a"):
        return False
    where = store_of(backend)
    with _lock:
        if where in _verdicts:
            return _verdicts[where]
        if time.monotonic() < _retry_at.get(where, 0.0):
            return False
        verdict = _probe(backend, where)
        if verdict is None:
            _retry_at[where] = time.monotonic() + _PROBE_RETRY_SECS
            return False
        _verdicts[where] = verdict
        return verdict


def probe_soon(backend: RemoteBackend) -> None:
    """Start the probe of the backend's store in the background, once, so that its requests
    (and a client of its own) overlap the upload that will ask :func:`validates`."""
    where = store_of(backend)
    with _started_lock:
        if where in _started or where in _verdicts:
            return
        _started.add(where)
    threading.Thread(
        target=validates, args=(backend,), name="dcp-tiered-checksum-probe", daemon=True
    ).start()


def client_error(exc: BaseException | None) -> Any | None:
    """The botocore ClientError behind an exception (s3fs keeps it as __cause__)."""
    seen = 0
    while exc is not None and seen < 5:
        if hasattr(exc, "response") and isinstance(exc.response, dict):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _code(exc: BaseException) -> str:
    ce = client_error(exc)
    return "" if ce is None else str(ce.response.get("Error", {}).get("Code", ""))


def _probe(backend: RemoteBackend, where: tuple[str, str]) -> bool | None:
    """True: wrong CRC32C refused, right one accepted; False: wrong one accepted, or right one
    refused too; None: no answer (unreachable, denied, ...)."""
    key = layout.probe_key(uuid.uuid4().hex[:16])
    bucket, _, obj = backend.path(key).partition("/")
    crc = integrity.checksum(_PROBE_BODY)
    # A client of its own that sends each probe once: botocore's default (legacy) retries
    # resend a body refused with BadDigest, with backoff, seconds for an expected refusal.
    opts = dict(backend.config.storage_options)
    config_kwargs = {**(opts.get("config_kwargs") or {})}
    config_kwargs["retries"] = {"mode": "standard", "max_attempts": 1}
    fs = _clients.filesystem(backend.protocol, {**opts, "config_kwargs": config_kwargs})

    def put(value: int) -> None:
        fs.call_s3(
            "put_object", Bucket=bucket, Key=obj, Body=_PROBE_BODY, ChecksumCRC32C=header(value)
        )

    try:
        try:
            put(crc ^ 0xFFFFFFFF)
        except Exception as e:  # noqa: BLE001 - any refusal is an answer; its code says which
            if _code(e) not in _REFUSED_CODES:
                logger.warning(
                    "checksum probe of %s: no answer (%s: %s); uploads are read back",
                    backend.url(key),
                    type(e).__name__,
                    e,
                )
                return None
        else:
            logger.info(
                "%s keeps bodies whose CRC32C does not match them: uploads are read back", where
            )
            return False
        try:
            backend._call("probe", key, lambda: put(crc))
        except (TransientTierError, PermanentTierError, OSError) as e:
            if isinstance(e, TransientTierError):
                return None
            logger.info("%s refuses CRC32C checksums (%s): uploads are read back", where, e)
            return False
        logger.info("%s checks the CRC32C of every body it keeps: uploads are not read back", where)
        return True
    finally:
        try:
            backend.remove(key, reason="the checksum probe's own object")
        except Exception as e:  # noqa: BLE001 - a leftover probe object is harmless: say so
            logger.warning("could not delete %s: %s", backend.url(key), e)


def upload(
    backend: RemoteBackend, local_path: str, key: str, checksum: str, metadata: Mapping[str, str]
) -> str | None:
    """Upload ``local_path`` to ``key`` with the CRC32C of every body sent; the stored object's
    ETag. IntegrityError (nothing stored) if the bytes read do not match ``checksum``."""
    fs, cfg = backend.fs, backend.config
    bucket, _, obj = backend.path(key).partition("/")
    # One descriptor for every read: an early upload's file is renamed with its directory
    # when the save commits locally, which may happen while its parts are being read.
    with open(local_path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        part = max(cfg.part_size_bytes, -(-size // _MAX_PARTS))
        if size >= min(5 * 2**30, 2 * part):
            # _multipart owns the duplicate (closed when it ends, whatever ends this call).
            sizes, fd = (size, part, cfg.max_concurrency), os.dup(f.fileno())
            return sync(
                fs.loop, _multipart, fs, (fd, local_path), (bucket, obj), sizes, checksum, metadata
            )
        data = f.read()
    crc = integrity.checksum(data)  # one PUT, as s3fs would
    _check(crc, checksum, local_path)
    resp = fs.call_s3(
        "put_object",
        Bucket=bucket,
        Key=obj,
        Body=data,
        ChecksumCRC32C=header(crc),
        Metadata=dict(metadata),
    )
    return resp.get("ETag")


def _check(crc: int, checksum: str, local_path: str) -> None:
    if integrity.format_checksum(crc) != checksum:
        raise IntegrityError(
            f"local file {local_path} fails its checksum ({integrity.format_checksum(crc)} != "
            f"manifest {checksum}); it was not uploaded. Re-save the step."
        )


def _read(fd: int, start: int, length: int) -> tuple[bytes, int]:
    """A part's bytes from ``fd``, which this closes: a duplicate of its own, so that a read
    still running when its upload is given up never reads a descriptor closed (and reused)
    meanwhile."""
    try:
        data = os.pread(fd, length, start)
    finally:
        os.close(fd)
    if len(data) != length:
        raise IntegrityError(f"short read of a local file: {len(data)} of {length} bytes")
    return data, integrity.checksum(data)


async def _multipart(
    fs: Any,
    source: tuple[int, str],
    where: tuple[str, str],
    sizes: tuple[int, int, int],
    checksum: str,
    metadata: Mapping[str, str],
) -> str | None:
    """The ETag of a multipart upload of ``source`` (a descriptor this closes, and the path
    it was opened at) to ``where`` (bucket, key), ``sizes`` (file, part, window): up to
    ``window`` parts in flight, each sent as soon as a slot is free (no waves). Aborted on any
    failure, and before completion if the CRC32C of the bytes read is not ``checksum``
    (IntegrityError)."""
    fd, local_path = source
    try:
        return await _upload_parts(fs, fd, local_path, where, sizes, checksum, metadata)
    finally:
        os.close(fd)  # the parts' reads are done: each one had a duplicate of its own


async def _upload_parts(
    fs: Any,
    fd: int,
    local_path: str,
    where: tuple[str, str],
    sizes: tuple[int, int, int],
    checksum: str,
    metadata: Mapping[str, str],
) -> str | None:
    (bucket, obj), (size, part, window) = where, sizes
    mpu = await fs._call_s3(
        "create_multipart_upload",
        Bucket=bucket,
        Key=obj,
        ChecksumAlgorithm="CRC32C",
        Metadata=dict(metadata),
    )
    upload_id = mpu["UploadId"]
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(window)

    async def one(number: int, start: int) -> tuple[dict[str, Any], int, int]:
        async with slots:  # memory: ``window`` parts
            data, crc = await loop.run_in_executor(
                None, _read, os.dup(fd), start, min(part, size - start)
            )
            resp = await fs._call_s3(
                "upload_part",
                Bucket=bucket,
                Key=obj,
                UploadId=upload_id,
                PartNumber=number,
                Body=data,
                ChecksumCRC32C=header(crc),
            )
            entry = {"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC32C": header(crc)}
            return entry, crc, len(data)

    tasks = [asyncio.ensure_future(one(n, s)) for n, s in enumerate(range(0, size, part), 1)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:  # the first failure, if any, is raised here
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        results = [t.result() for t in tasks]
        whole = 0
        for _, crc, length in results:
            whole = integrity.combine(whole, crc, length)
        _check(whole, checksum, local_path)  # aborted below: the object never exists
        done = await fs._call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=obj,
            UploadId=upload_id,
            MultipartUpload={"Parts": [entry for entry, _, _ in results]},
        )
        return done.get("ETag")
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=obj, UploadId=upload_id)
        except Exception as e:  # noqa: BLE001 - recover() aborts our keys' leftovers later
            logger.warning("could not abort the upload of s3://%s/%s: %s", bucket, obj, e)
        raise


def head(backend: RemoteBackend, key: str) -> tuple[int, str | None, str | None, bool] | None:
    """(size, CRC32C recorded in its metadata, ETag, whether the store holds a checksum of it
    that it checked at upload and that agrees) of the object at ``key``; None if absent. One
    HEAD asking for the store's checksum (a multipart object's is of its parts: present, it
    says each part was checked; a single PUT's must equal the recorded CRC32C)."""
    bucket, _, obj = backend.path(key).partition("/")
    try:
        resp = backend._call(
            "stat",
            key,
            lambda: backend.fs.call_s3(
                "head_object", Bucket=bucket, Key=obj, ChecksumMode="ENABLED"
            ),
        )
    except FileNotFoundError:
        return None
    recorded = resp.get("Metadata", {}).get("crc32c")
    stored = resp.get("ChecksumCRC32C")
    checked = bool(stored) and recorded is not None
    if checked and "-" not in str(stored) and resp.get("ChecksumType") != "COMPOSITE":
        try:
            checked = stored == header(int(str(recorded), 16))
        except ValueError:
            checked = False
    return int(resp["ContentLength"]), recorded, resp.get("ETag"), checked
