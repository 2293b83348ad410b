"""What the remote backend reads from fsspec's listing entries (version tags, modification
times), how it splits a URL, and its whole-or-nothing writes on a ``file://`` store."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping
from typing import Any


def tag_of(info: Mapping[str, Any]) -> str | None:
    """The version tag of an fsspec listing or info entry (see RemoteBackend.listing)."""
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return str(etag)
    if "ino" in info and "mtime" in info:
        return f"{info['ino']}-{info['mtime']}"
    return None


def mtime_of(info: Mapping[str, Any]) -> float:
    """An fsspec listing entry's modification time: S3 gives a datetime, local stores a float."""
    value = info.get("LastModified", info.get("mtime", info.get("created", 0.0)))
    return value.timestamp() if hasattr(value, "timestamp") else float(value or 0.0)


def split_url(url: str) -> tuple[str, str]:
    protocol, sep, rest = url.partition("://")
    if not sep:
        return "file", os.path.abspath(url)
    if protocol == "file":
        return "file", rest
    return protocol, rest


LOCAL_PROTOCOLS = ("file", "local")


def write_whole(path: str, data: bytes, *, exclusive: bool) -> None:
    """Write a small object on a local (``file://``) remote so that a reader sees it whole or
    not at all, as on an object store: written aside, then linked into place (``exclusive``:
    fails with FileExistsError if it exists) or renamed over it. Writing it in place would
    show a concurrent reader an empty or half-written marker or pointer."""
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.partial"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:  # a filesystem without hard links: create it in place
                with open(path, "xb") as f:
                    f.write(data)
        else:
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
