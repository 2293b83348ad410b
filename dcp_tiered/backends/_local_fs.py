"""The local filesystem under one root, as every part of :class:`~dcp_tiered.backends.local.
LocalBackend` sees it: the root, its one-component names, and the typed errors of a failed
write. Also the few filesystem calls the backend's parts share (renameat2, directory fsync)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from ..errors import ConfigError, DcpTieredError, InsufficientSpaceError, NotWritableError

_AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def typed_write_error(e: OSError, path: Path, doing: str, where: Path) -> OSError:
    """The typed error for an OSError met while ``doing`` something to ``path`` on the
    filesystem of ``where``: InsufficientSpaceError for ENOSPC/EDQUOT (saying whether bytes or
    inodes ran out), NotWritableError for EROFS/EACCES/EPERM; anything else unchanged."""
    if isinstance(e, DcpTieredError) or e.errno not in (errno.ENOSPC, errno.EDQUOT, *_NOT_WRITABLE):
        return e
    if e.errno == errno.EROFS:
        return NotWritableError(
            e.errno,
            (
                f"cannot {doing} {path}: the filesystem of {where} is read-only. Remount it "
                "read-write (mount -o remount,rw) or point the tier at a writable directory; "
                "nothing was written and earlier steps are intact"
            ),
        )
    if e.errno in (errno.EACCES, errno.EPERM):
        return NotWritableError(
            e.errno,
            (
                f"cannot {doing} {path}: {e.strerror} (uid {os.geteuid()}). Give this process "
                f"write access to {where} (owner, mode, ACL) or point the tier at a writable "
                "directory; nothing was written and earlier steps are intact"
            ),
        )
    if e.errno == errno.EDQUOT:
        return InsufficientSpaceError(
            e.errno,
            (
                f"disk quota exceeded while trying to {doing} {path}: raise the quota (bytes or "
                f"files) for {where}, or keep fewer steps; earlier steps are untouched"
            ),
        )
    try:
        st = os.statvfs(nearest_existing(where))
    except OSError:
        st = None
    free = f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB" if st else "unknown"
    if st is not None and st.f_files and st.f_favail == 0:
        return InsufficientSpaceError(
            e.errno,
            (
                f"no free inodes while trying to {doing} {path}: the filesystem of {where} has "
                f"{free} free but every one of its {st.f_files} inodes is used (each file and "
                "directory takes one). Delete files there (old steps, other small files) or use "
                "a filesystem with more inodes; earlier steps are untouched"
            ),
        )
    return InsufficientSpaceError(
        e.errno,
        (
            f"local disk full while trying to {doing} {path} ({free} free on the filesystem of "
            f"{where}): free space there or keep fewer steps; earlier steps are untouched"
        ),
    )


def renameat2(a: Path, b: Path, flags: int) -> bool:
    """Linux renameat2 with ``flags``; False where the call or the flag is unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def available_memory_bytes() -> int | None:
    """The kernel's estimate of RAM available without swapping (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# sync_file_range's flag: start writing the range's dirty pages out, waiting for none of it
_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # a foreign call: the GIL is released while the kernel queues the pages


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` of ``fd`` from ``offset`` to the disk now,
    without waiting. A file written in one go and fsynced at its end otherwise piles up every
    page dirty until the fsync (or until the kernel throttles the writer), so the disk idles
    while the file is framed and checksummed, then the fsync waits for all of it; started
    batch by batch, the disk writes while the next batch is prepared (256 MiB written in
    32 MiB pieces, each after 10 ms of checksumming, then fsynced: 0.23-0.28 s, 0.16-0.19 s
    with this). Only a hint: where the call is missing or refused nothing happens, and the
    fsync that follows still decides, and reports, whether the bytes reached the disk."""
    fn = _sync_file_range()
    if fn is not None and nbytes > 0:
        fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileVersion(NamedTuple):
    """Which bytes a path holds: a file written aside and renamed into place (as every record
    of ours is) gets a new inode and change time, and one rewritten in place a new change
    time (which no unprivileged writer sets back)."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int


def version_of(st: os.stat_result) -> FileVersion:
    return FileVersion(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class LocalRoot:
    """A directory on a local disk: every name under it is checked to be one path component
    (:meth:`_child`), so nothing here can reach outside it."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise ConfigError(f"root must be a directory path, got {root!r}")
        if "://" in str(root) and not str(root).startswith("file://"):
            raise ConfigError(
                f"root {root!r} is a URL; the local tier needs a path on a local disk"
            )
        self.root = Path(str(root).removeprefix("file://")).expanduser().absolute()

    @contextlib.contextmanager
    def _writing(self, doing: str, path: Path) -> Iterator[None]:
        """Raise the typed error (see :func:`typed_write_error`) for what fails in the block."""
        try:
            yield
        except OSError as e:
            typed = typed_write_error(e, path, doing, self.root)
            if typed is e:
                raise
            raise typed from e

    def write_errors(self, *names: str) -> contextlib.AbstractContextManager[None]:
        """Typed errors naming file ``names`` for what fails in the block: for a file that
        :meth:`open_write` opened, written in a block of another's (files written side by
        side on threads, closed together)."""
        return self._writing("write", self._child(*names))

    def _child(self, *names: str) -> Path:
        path = self.root
        for name in names:
            if not name or "/" in name or "\x00" in name or name in (".", ".."):
                raise ConfigError(f"refusing path component {name!r} under {self.root}")
            path = path / name
        return path

    def ensure_root(self) -> None:
        try:
            with self._writing("create the directory", self.root):
                self.root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:  # it, or a parent, is a file
            raise ConfigError(
                f"{self.root} cannot be a tier's directory: {nearest_existing(self.root)} is "
                "a file, not a directory. Point the tier at a directory (it is made if "
                "missing); nothing was written"
            ) from e
