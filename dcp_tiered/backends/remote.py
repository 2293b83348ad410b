"""Remote backend over fsspec (S3 first-class; any fsspec store works).

Every remote read, write and delete goes through here. Wire errors are translated once, at
this edge, by S3 error code or exception type, into TransientTierError (retried with backoff)
or PermanentTierError (not retried; the message says what to fix).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .. import _retry
from ..config import RemoteConfig, RetryConfig
from ..errors import ConfigError, PermanentTierError, TransientTierError
from . import _clients, s3_checksums
from ._remote_files import LOCAL_PROTOCOLS, mtime_of, split_url, tag_of, write_whole
from ._remote_tagged import TaggedObjects
from .base import Backend
from .remote_errors import PERMANENT_HINTS, translate

logger = logging.getLogger(__name__)
T = TypeVar("T")

_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "adl"}


class RemoteBackend(TaggedObjects, Backend):
    """Objects under one fsspec URL. Keys are relative to it; nothing outside is touched."""

    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self.protocol, base = split_url(config.url)
        self.base = base.rstrip("/")
        self._fs: Any = None
        self._fs_pid = -1

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fs"], state["_fs_pid"] = None, -1  # clients never cross processes
        return state

    def __repr__(self) -> str:
        return f"RemoteBackend({self.config.url!r})"

    def with_one_attempt(self) -> RemoteBackend:
        """The same store, tried once per request (no retry policy): for housekeeping and
        probes that must never hold a job's start for the retry policy's minute."""
        return RemoteBackend(dataclasses.replace(self.config, retry=RetryConfig(max_attempts=1)))

    @property
    def fs(self) -> Any:
        if self._fs is None or self._fs_pid != os.getpid():
            if self._fs is not None:  # a forked child's copy of the parent's: never freed here
                _clients.keep_inherited(self._fs)
            self._fs = _clients.filesystem(self.protocol, self.config.storage_options)
            self._fs_pid = os.getpid()
        return self._fs

    @property
    def is_object_store(self) -> bool:
        return self.protocol in _OBJECT_STORES

    def path(self, key: str) -> str:
        key = key.rstrip("/")  # prefixes are given with their trailing slash
        parts = key.split("/")
        if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ConfigError(f"refusing remote key {key!r} under {self.config.url}")
        return f"{self.base}/{key}"

    def url(self, key: str) -> str:
        return f"{self.protocol}://{self.path(key)}"

    def _call(self, op: str, key: str, fn: Callable[[], T], retry: RetryConfig | None = None) -> T:
        where = self.url(key) if key else self.config.url

        def attempt() -> T:
            try:
                return fn()
            except Exception as e:  # translated once, here
                translated = translate(e, op, where)
                if translated is e:
                    raise
                raise translated from e

        return _retry.call(retry or self.config.retry, attempt)

    def probe(self, attempts: int = 1) -> None:
        """One cheap request that tells a wrong bucket, missing or bad credentials and denied
        access (PermanentTierError, saying what to fix) from a store that cannot be reached
        now (TransientTierError), tried ``attempts`` times: seconds, not the upload policy's
        minute. One attempt is already a short bounded retry: botocore retries 5xx and s3fs
        connection errors (about two seconds). S3: a one-key listing of the prefix (a HEAD
        carries no error code; a listing names it)."""
        retry = RetryConfig(max_attempts=attempts, initial_backoff_secs=0.2, max_backoff_secs=1.0)
        if self.protocol in ("s3", "s3a"):
            bucket, _, prefix = self.base.partition("/")
            self._call(
                "check",
                "",
                lambda: self.fs.call_s3(
                    "list_objects_v2",
                    Bucket=bucket,
                    Prefix=f"{prefix}/" if prefix else "",
                    MaxKeys=1,
                ),
                retry=retry,
            )
        else:  # a directory that does not exist yet is fine: uploads create it
            self._call("check", "", lambda: self.fs.exists(self.base), retry=retry)

    # ------------------------------------------------------------ writes

    def put_file(self, local_path: str, key: str, checksum: str) -> str | None:
        """Upload a local file whose CRC32C is ``checksum``. S3: every body goes with its
        CRC32C (:mod:`dcp_tiered.backends.s3_checksums`), the bytes read must match
        ``checksum`` (IntegrityError, nothing stored, if not), and the stored object's ETag is
        returned; None elsewhere."""
        path = self.path(key)
        if self.protocol in ("s3", "s3a"):
            if self.config.verify_uploads == "auto":
                s3_checksums.probe_soon(self)
            meta = {"crc32c": checksum}
            return self._call(
                "upload", key, lambda: s3_checksums.upload(self, local_path, key, checksum, meta)
            )
        self._call("mkdir", key, lambda: self.fs.makedirs(self.fs._parent(path), exist_ok=True))
        self._call("upload", key, lambda: self.fs.put_file(local_path, path))
        return None

    def validates_checksums(self) -> bool:
        """Whether the store proved it refuses a body that fails its CRC32C (probed once per
        store and process), so an upload it accepted need not be read back."""
        return s3_checksums.validates(self)

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self.path(key)
        if not self.is_object_store:
            self._call("mkdir", key, lambda: self.fs.makedirs(self.fs._parent(path), exist_ok=True))
        if self.protocol in LOCAL_PROTOCOLS:
            self._call("put", key, lambda: write_whole(path, data, exclusive=False))
        else:
            self._call("put", key, lambda: self.fs.pipe_file(path, data))

    def create_exclusive(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if absent (S3: single-part PUT with If-None-Match: *)."""
        path = self.path(key)
        if not self.is_object_store:
            self._call("mkdir", key, lambda: self.fs.makedirs(self.fs._parent(path), exist_ok=True))
        try:
            if self.protocol in LOCAL_PROTOCOLS:
                self._call("create", key, lambda: write_whole(path, data, exclusive=True))
            else:
                self._call("create", key, lambda: self.fs.pipe_file(path, data, mode="create"))
        except FileExistsError:
            return False
        return True

    def remove(self, key: str, *, reason: str) -> None:
        logger.info("deleting %s (%s)", self.url(key), reason)
        try:
            self._call("delete", key, lambda: self.fs.rm_file(self.path(key)))
        except FileNotFoundError:
            pass

    def remove_empty_dirs(self, prefix: str) -> None:
        """Directory-backed stores (``file://``) keep a deleted step's empty directories;
        remove them, bottom up. Only empty directories go, never a file."""
        if self.is_object_store:
            return
        path = self.path(prefix)
        try:
            found = self._call(
                "list", prefix, lambda: self.fs.find(path, withdirs=True, detail=True)
            )
        except FileNotFoundError:
            return
        dirs = [p for p, info in found.items() if info.get("type") == "directory"]
        for d in sorted(dirs, key=len, reverse=True) + [path]:
            try:
                self.fs.rmdir(d)
            except OSError:
                pass  # not empty: something else lives there, leave it

    def abort_multipart_uploads(self, prefix: str, only: set[str] | None = None) -> int:
        """Abort incomplete multipart uploads under ``prefix`` (S3 only), optionally only
        those of the keys in ``only`` (other nodes may be uploading their own)."""
        if self.protocol not in ("s3", "s3a"):
            return 0
        bucket, _, key_prefix = self.path(prefix).partition("/")
        resp = self._call(
            "list uploads",
            prefix,
            lambda: self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key_prefix),
        )
        wanted = None if only is None else {self.path(k).partition("/")[2] for k in only}
        uploads = [u for u in resp.get("Uploads", []) if wanted is None or u["Key"] in wanted]
        for up in uploads:
            logger.info(
                "aborting incomplete upload s3://%s/%s (%s)", bucket, up["Key"], up["UploadId"]
            )
            self._call(
                "abort upload",
                prefix,
                functools.partial(
                    self.fs.call_s3,
                    "abort_multipart_upload",
                    Bucket=bucket,
                    Key=up["Key"],
                    UploadId=up["UploadId"],
                ),
            )
        return len(uploads)

    # ------------------------------------------------------------ reads

    def get_bytes(self, key: str) -> bytes:
        if self.protocol in ("s3", "s3a"):  # one GET (s3fs may HEAD first, or list if absent)
            got = self.get_tagged(key)
            if got is None:
                raise FileNotFoundError(f"{self.url(key)}: not found")
            return got[0]
        return self._call("get", key, lambda: self.fs.cat_file(self.path(key)))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``key`` with one ranged GET."""
        data = self._call(
            "get", key, lambda: self.fs.cat_file(self.path(key), start=start, end=end)
        )
        if len(data) != end - start:
            raise TransientTierError(
                f"short read of {self.url(key)}: {len(data)} of {end - start} bytes"
            )
        return data

    def stat(self, key: str) -> tuple[int, str | None] | None:
        """(size, recorded crc32c or None) of ``key``, or None if it does not exist."""
        path = self.path(key)
        self.fs.invalidate_cache(path)
        try:
            if self.protocol in ("s3", "s3a"):  # one HEAD gives both
                bucket, _, obj = path.partition("/")
                head = self._call(
                    "stat", key, lambda: self.fs.call_s3("head_object", Bucket=bucket, Key=obj)
                )
                return int(head["ContentLength"]), head.get("Metadata", {}).get("crc32c")
            info = self._call("stat", key, lambda: self.fs.info(path))
        except FileNotFoundError:
            return None
        return int(info["size"]), None

    def sizes(self, prefix: str) -> dict[str, int]:
        """Relative key -> size of every object under ``prefix``, in one listing."""
        return {key: int(info["size"]) for key, info in self._find(prefix).items()}

    def listing(self, prefix: str) -> dict[str, tuple[int, str | None]]:
        """Relative key -> (size, version tag) of every object under ``prefix``, in one listing
        (a page per 1,000 objects). The tag names one version of an object: the ETag on S3,
        inode and mtime on a local store, None where the store gives none. An object with the
        tag a read of it returned (:meth:`fold_object`) is still the object that was read."""
        return {key: (int(info["size"]), tag_of(info)) for key, info in self._find(prefix).items()}

    def modified(self, prefix: str) -> dict[str, float]:
        """Relative key -> last-modified time (epoch seconds) of every object under ``prefix``."""
        return {key: mtime_of(info) for key, info in self._find(prefix).items()}

    def _find(self, prefix: str) -> dict[str, Mapping[str, Any]]:
        path = self.path(prefix)
        self.fs.invalidate_cache(path)
        try:
            found = self._call("list", prefix, lambda: self.fs.find(path, detail=True))
        except FileNotFoundError:
            return {}
        return {p[len(self.base) + 1 :]: info for p, info in found.items()}

    def children(self, prefix: str = "") -> list[str]:
        """The names directly under ``prefix`` (default: the remote root), in one listing."""
        path = self.path(prefix) if prefix else self.base
        try:  # refresh: never a listing cached by this or another backend sharing the client
            found = self._call("list", prefix, lambda: self.fs.ls(path, detail=False, refresh=True))
        except FileNotFoundError:
            return []
        return sorted({p.rstrip("/").rpartition("/")[2] for p in found})

    def glob(self, pattern: str) -> list[str]:
        """Relative keys matching ``pattern`` (fsspec glob, relative to the root), as the store
        holds them now."""
        # Every listing asked for anew (``refresh``, passed down to each ``ls``): one cached by
        # this or another backend sharing the client would miss keys written since. The
        # invalidation too, for a filesystem that does not take ``refresh``.
        self.fs.invalidate_cache()
        try:
            found = self._call(
                "list", "", lambda: self.fs.glob(f"{self.base}/{pattern}", refresh=True)
            )
        except FileNotFoundError:
            return []
        return sorted(p[len(self.base) + 1 :] for p in found)

    # ------------------------------------------------------------ the contract (base.Backend)

    def read(self, key: str) -> bytes:
        return self.get_bytes(key)

    def write(self, key: str, data: bytes) -> None:
        self.put_bytes(key, data)

    def atomic_write(self, key: str, data: bytes, *, exclusive: bool = False) -> bool:
        # A PUT is whole or absent on an object store, as write_whole makes it on file://.
        if exclusive:
            return self.create_exclusive(key, data)
        self.put_bytes(key, data)
        return True

    def exists(self, key: str) -> bool:
        return self.stat(key) is not None

    def require_bucket(self) -> None:
        """PermanentTierError if the bucket of an S3 URL does not exist: s3fs lists a missing
        bucket as empty, and an empty listing must tell a typo from a new run."""
        if self.protocol not in ("s3", "s3a"):
            return
        bucket = self.base.partition("/")[0]
        try:
            self._call("head bucket", "", lambda: self.fs.call_s3("head_bucket", Bucket=bucket))
        except FileNotFoundError as e:
            raise PermanentTierError(
                f"bucket {bucket!r} of {self.config.url} does not exist (NoSuchBucket); "
                f"{PERMANENT_HINTS['NoSuchBucket']}"
            ) from e


def remote_backend(
    remote: str | RemoteConfig | None, storage_options: Mapping[str, Any] | None = None
) -> RemoteBackend | None:
    """The backend for a writer's or reader's ``remote=`` (a URL or a RemoteConfig)."""
    if remote is None:
        return None
    if not isinstance(remote, RemoteConfig):
        remote = RemoteConfig(url=remote, storage_options=dict(storage_options or {}))
    return RemoteBackend(remote)
