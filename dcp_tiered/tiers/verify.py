"""Checks a committed save's stored files against its manifest: on the local tier the size and
the CRC32C of the bytes; on the remote the size, and the checksum the store recorded with the
object at upload (no download) or, where it keeps none or when asked, of the bytes read back.
Each file that fails is one line of text in the answer; nothing is raised for a bad file."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..backends.remote import RemoteBackend
from ..policy import integrity, layout
from ..policy.manifest import Manifest
from . import file_upload
from .local import LocalTier


def _nothing(n: int) -> None:
    pass


def local_files(
    tier: LocalTier, step: str, m: Manifest, *, progress: Callable[[int], None] = _nothing
) -> list[str]:
    """What is wrong with the files of ``step`` on ``tier`` that manifest ``m`` lists: missing,
    another size, another CRC32C (every byte is read; ``progress(n)`` as it is)."""
    problems = []
    for name, info in sorted(m.files.items()):
        if not tier.backend.exists(step, name):
            problems.append(f"{name}: missing")
            continue
        size = tier.backend.file_size(step, name)
        if size != int(info["size"]):
            problems.append(f"{name}: {size} bytes, manifest says {info['size']}")
            continue
        crc = tier.backend.file_checksum(step, name, progress=progress)
        if crc != info["checksum"]:
            problems.append(f"{name}: {integrity.ALGORITHM} {crc} != manifest {info['checksum']}")
    return problems


@dataclass
class RemoteCheck:
    """What :func:`remote_files` found, and how: files checked by the checksum the store
    ``recorded`` at upload, and files ``read`` back (``bytes_read`` in all)."""

    problems: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=lambda: {"recorded": 0, "read": 0})
    bytes_read: int = 0


def remote_files(
    remote: RemoteBackend,
    keys: layout.RemoteKeys,
    m: Manifest,
    *,
    read_back: bool = False,
    progress: Callable[[int], None] = _nothing,
) -> RemoteCheck:
    """Check the objects of the save ``keys`` names against its manifest ``m``: DCP's
    ``.metadata`` there, and every data file with the manifest's size and CRC32C. A HEAD per
    object answers where the store recorded the checksum at upload (S3 object metadata);
    elsewhere (``file://``, objects without it), or with ``read_back``, each object is read in
    ranges and checksummed, nothing kept. ``progress(size)`` after each file."""
    out = RemoteCheck()
    if remote.stat(keys.metadata) is None:
        out.problems.append(f"{layout.DCP_METADATA_NAME}: missing")
    for file, info in sorted(m.files.items()):
        key, size = keys.file(file), int(info["size"])
        stat = remote.stat(key)
        if stat is None:
            out.problems.append(f"{file}: missing ({remote.url(key)})")
            continue
        if stat[0] != size:
            out.problems.append(f"{file}: {stat[0]} bytes, manifest says {size}")
            continue
        crc: str | None
        if stat[1] is not None and not read_back:
            crc, how = stat[1], "recorded"
        else:
            crc = file_upload.remote_checksum(remote, key, size, read_back=True)
            how, out.bytes_read = "read", out.bytes_read + size
        progress(size)
        out.checked[how] += 1
        if crc is None:
            out.problems.append(f"{file}: the store's own checksum fails on read")
        elif crc != info["checksum"]:
            what = "recorded at upload" if how == "recorded" else "of the stored bytes"
            out.problems.append(
                f"{file}: {integrity.ALGORITHM} {what} {crc} != manifest {info['checksum']}"
            )
    return out
