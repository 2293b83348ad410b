"""Versioned objects on the remote backend: a read that returns the object's version tag, a
write only while the object is still that version (the root's ``latest`` pointer moves by
compare-and-set), and one GET folded in chunks (a read-back that proves the version it read).

:class:`TaggedObjects` is a part of :class:`~dcp_tiered.backends.remote.RemoteBackend` (which
inherits it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fsspec.asyn import sync

from ..config import RetryConfig
from ._remote_files import tag_of

T = TypeVar("T")


class TaggedObjects:
    """Reads with a version tag, and writes conditional on one (a role of RemoteBackend)."""

    protocol: str

    if TYPE_CHECKING:  # RemoteBackend's

        @property
        def fs(self) -> Any: ...

        def path(self, key: str) -> str: ...

        def _call(
            self, op: str, key: str, fn: Callable[[], T], retry: RetryConfig | None = None
        ) -> T: ...

        def create_exclusive(self, key: str, data: bytes) -> bool: ...

        def put_bytes(self, key: str, data: bytes) -> None: ...

    def put_if(self, key: str, data: bytes, tag: str | None) -> bool:
        """Write ``key`` only if it still is the version ``tag`` (from :meth:`get_tagged`;
        None: only if absent). False if another writer got there first. S3: If-Match /
        If-None-Match; stores without conditional writes: a plain write (the caller re-reads)."""
        if tag is None:
            return self.create_exclusive(key, data)
        if self.protocol not in ("s3", "s3a"):
            self.put_bytes(key, data)
            return True
        bucket, _, obj = self.path(key).partition("/")
        try:
            self._call(
                "put",
                key,
                lambda: self.fs.call_s3(
                    "put_object", Bucket=bucket, Key=obj, Body=data, IfMatch=tag
                ),
            )
        except (FileExistsError, FileNotFoundError):  # 412: changed since; 404: removed since
            return False
        return True

    def get_tagged(self, key: str) -> tuple[bytes, str | None] | None:
        """The bytes of ``key`` and its version tag (S3: the ETag, for :meth:`put_if`), with
        one GET; None if it does not exist."""
        try:
            if self.protocol in ("s3", "s3a"):
                bucket, _, obj = self.path(key).partition("/")

                def get() -> tuple[bytes, str | None]:
                    resp = self.fs.call_s3("get_object", Bucket=bucket, Key=obj)
                    body = resp["Body"]
                    try:
                        return sync(self.fs.loop, body.read), resp.get("ETag")
                    finally:
                        body.close()

                return self._call("get", key, get)
            return self._call("get", key, lambda: self.fs.cat_file(self.path(key))), ""
        except FileNotFoundError:
            return None

    def fold_object(
        self, key: str, span: int, fold: Callable[[T, bytes], T], init: T
    ) -> tuple[T, str | None]:
        """Read all of ``key`` with one GET (S3: one request whatever its size), handing its
        body to ``fold`` in chunks of at most ``span`` bytes (memory: one chunk). Retried
        whole from ``init`` on a transient error. Returns the fold and the version tag of the
        object read (see :meth:`listing`)."""
        path = self.path(key)

        def run() -> tuple[T, str | None]:
            acc = init
            if self.protocol in ("s3", "s3a"):
                bucket, _, obj = path.partition("/")
                resp = self.fs.call_s3("get_object", Bucket=bucket, Key=obj)
                body = resp["Body"]
                try:
                    while chunk := sync(self.fs.loop, body.read, span):
                        acc = fold(acc, chunk)
                finally:
                    body.close()
                return acc, resp.get("ETag")
            with self.fs.open(path, "rb") as f:
                before = tag_of(self.fs.info(path))
                while chunk := f.read(span):
                    acc = fold(acc, chunk)
            return acc, (before if before == tag_of(self.fs.info(path)) else None)

        return self._call("get", key, run)
