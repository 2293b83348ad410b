"""The small contract every backend keeps: what a tier may ask of its storage by key alone.

A key is a ``/``-separated path relative to the backend's root (``"step-1/manifest.json"``);
no key reaches outside it (each backend refuses ``..``, empty and absolute components). The
local disk and an object store differ in everything else (renames and locks on one, tags,
ranged GETs and conditional PUTs on the other), which their own classes carry; this is only
what both do alike, so that code moving small records (run records, markers, pointers) can be
written, and tested, once for both.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Backend(Protocol):
    """Keys under one root: read, write, replace atomically, remove, list, test."""

    def read(self, key: str, /) -> bytes:
        """The whole object at ``key``; FileNotFoundError if there is none."""
        ...

    def write(self, key: str, data: bytes, /) -> None:
        """Store ``data`` at ``key``, replacing what is there (no promise about what a
        concurrent reader sees meanwhile: use :meth:`atomic_write` for that)."""
        ...

    def atomic_write(self, key: str, data: bytes, /, *, exclusive: bool = False) -> bool:
        """Store ``data`` at ``key`` so that readers see the old object or the new, whole,
        never a part. With ``exclusive``, only if ``key`` does not exist: False if it does
        (decided by the store, so two writers cannot both win). True when written."""
        ...

    def remove(self, key: str, /, *, reason: str) -> None:
        """Delete the object at ``key`` (nothing if there is none), logged with ``reason``."""
        ...

    def children(self, prefix: str = "", /) -> list[str]:
        """The names directly under ``prefix`` (default: the root), sorted."""
        ...

    def exists(self, key: str, /) -> bool:
        """Whether an object (or, on a local disk, a directory) is at ``key``."""
        ...
