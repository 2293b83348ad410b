"""Local filesystem backend: every read, write, rename and delete on the local tier.

Nothing here writes or deletes outside ``root``: every name is one path component checked by
:func:`_child`, and every delete is logged at INFO.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

import torch

from ..errors import ConfigError, DcpTieredError, InsufficientSpaceError, NotWritableError
from ..policy import integrity
from ..policy.layout import LOCK_NAME as LOCK_FILE
from ..policy.layout import TMP_SUFFIX

logger = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_WRITE_BUFFER_BYTES = 4 * 2**20
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
_READ_CHUNK_BYTES = 16 * 2**20
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def _nearest_existing(path: Path) -> Path:
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
        st = os.statvfs(_nearest_existing(where))
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


def _renameat2(a: Path, b: Path, flags: int) -> bool:
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


def append_line(path: str | os.PathLike[str], line: str) -> None:
    """Append one line with a single O_APPEND write, so lines of several ranks never mix."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line.rstrip("\n") + "\n").encode())
        finally:
            os.close(fd)
    except OSError as e:
        raise typed_write_error(e, Path(path), "append to", Path(path).parent) from e


def replace_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Atomic, durable replacement of the small file ``path`` (an existing directory's):
    :meth:`LocalBackend.replace_root_file` of its directory. For the frameworks' own files
    beside a step (trackers, stubs, configs)."""
    path = os.fspath(path)
    LocalBackend(os.path.dirname(path)).replace_root_file(os.path.basename(path), data)


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


def _version(st: os.stat_result) -> FileVersion:
    return FileVersion(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class LocalBackend:
    """A directory on a local disk holding one run's steps."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise ConfigError(f"root must be a directory path, got {root!r}")
        if "://" in str(root) and not str(root).startswith("file://"):
            raise ConfigError(
                f"root {root!r} is a URL; the local tier needs a path on a local disk"
            )
        self.root = Path(str(root).removeprefix("file://")).expanduser().absolute()

    def __repr__(self) -> str:
        return f"LocalBackend({str(self.root)!r})"

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

    # ------------------------------------------------------------ paths

    def _child(self, *names: str) -> Path:
        path = self.root
        for name in names:
            if not name or "/" in name or "\x00" in name or name in (".", ".."):
                raise ConfigError(f"refusing path component {name!r} under {self.root}")
            path = path / name
        return path

    def ensure_root(self) -> None:
        with self._writing("create the directory", self.root):
            self.root.mkdir(parents=True, exist_ok=True)

    def exists(self, *names: str) -> bool:
        return self._child(*names).exists()

    def is_dir(self, *names: str) -> bool:
        return self._child(*names).is_dir()

    def is_link(self, *names: str) -> bool:
        return self._child(*names).is_symlink()

    def list_names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []

    def list_files(self, name: str) -> list[str]:
        return sorted(os.listdir(self._child(name)))

    def file_size(self, *names: str) -> int:
        return self._child(*names).stat().st_size

    def mtime(self, *names: str) -> float:
        return self._child(*names).stat().st_mtime

    def free_bytes(self) -> int:
        """Free bytes on the root's filesystem (of its nearest existing parent: asking creates
        nothing, so it works on a read-only filesystem too)."""
        st = os.statvfs(_nearest_existing(self.root))
        return st.f_bavail * st.f_frsize

    def check_writable(self) -> None:
        """Raise NotWritableError now if the root's filesystem is read-only, or the root (its
        nearest existing parent) is not writable by this process: before anything is planned
        or written, and before a read-only disk's free space could be blamed instead."""
        where = _nearest_existing(self.root)
        if os.statvfs(where).f_flag & os.ST_RDONLY:
            code = errno.EROFS
        elif not os.access(
            where, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids
        ):
            code = errno.EACCES
        else:
            return
        raise typed_write_error(OSError(code, os.strerror(code)), self.root, "write to", self.root)

    # ------------------------------------------------------------ writing

    def make_dir(self, name: str) -> None:
        self.ensure_root()
        with self._writing("create the directory", self._child(name)):
            self._child(name).mkdir(exist_ok=True)

    @contextlib.contextmanager
    def open_write(self, directory: str, name: str, *, sync: bool = True) -> Iterator[BinaryIO]:
        """Create ``directory/name``; on success flush and fsync it before closing."""
        path = self._child(directory, name)
        with self._writing("write", path), open(path, "wb", buffering=_WRITE_BUFFER_BYTES) as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())

    def link_file(self, src: tuple[str, str], dst: tuple[str, str]) -> None:
        """Give file ``src`` (directory, name) a second name ``dst``: no copy, no new bytes."""
        with self._writing("link", self._child(*dst)):
            os.link(self._child(*src), self._child(*dst), follow_symlinks=False)

    def write_file(self, directory: str, name: str, data: bytes, *, sync: bool = True) -> None:
        with self.open_write(directory, name, sync=sync) as f:
            f.write(data)

    def write_atomically(self, directory: str, name: str, data: bytes) -> None:
        """Replace small file ``directory/name`` as :meth:`replace_root_file` does under the
        root: readers see the old content or the new, even after a power loss."""
        self._put_small_file(directory, name, data, exclusive=False)

    def map_file(self, name: str, nbytes: int) -> torch.Tensor:
        """A uint8 tensor backed by root-level file ``name`` of exactly ``nbytes`` bytes, shared
        with the file (writes go to it). The space is reserved up front, so a full tmpfs fails
        here with InsufficientSpaceError rather than with SIGBUS on a later write."""
        self.ensure_root()
        path = self._child(name)
        with self._writing("create", path):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != nbytes:
                os.ftruncate(fd, 0)
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise InsufficientSpaceError(
                    e.errno,
                    f"cannot reserve {nbytes / 2**20:.1f} MiB for {path}: the "
                    f"filesystem of {self.root} is full; free space or make the tmpfs larger",
                ) from e
            raise typed_write_error(e, path, "reserve space for", self.root) from e
        os.close(fd)
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)

    def replace_root_file(self, name: str, data: bytes) -> None:
        """Write a small file directly under the root via a temporary file and a rename, both
        fsynced: readers see the old content or the new, even after a power loss."""
        self._put_small_file(None, name, data, exclusive=False)

    def create_root_file(self, name: str, data: bytes) -> bool:
        """Create small file ``name`` directly under the root only if it does not exist, whole
        or not at all (as :meth:`replace_root_file`, but linked into place); False if it
        exists."""
        return self._put_small_file(None, name, data, exclusive=True)

    def _put_small_file(
        self, directory: str | None, name: str, data: bytes, *, exclusive: bool
    ) -> bool:
        """The one atomic small-file write: ``name`` (under ``directory``, else the root)
        written aside (a hidden temporary file of this process and thread), fsynced, then
        renamed over it (``exclusive``: linked into place, False if it exists), and its
        directory fsynced."""
        where = () if directory is None else (directory,)
        if directory is None:
            self.ensure_root()
        final = self._child(*where, name)
        tmp = self._child(*where, f".{name}.{os.getpid()}-{threading.get_ident()}{TMP_SUFFIX}")
        try:
            with self._writing("write", final):
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                if not exclusive:
                    os.replace(tmp, final)
                else:
                    try:
                        os.link(tmp, final, follow_symlinks=False)
                    except FileExistsError:
                        return False
                fsync_dir(final.parent)
            return True
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()  # never leave the temporary file behind

    def sync_dir(self, name: str | None = None) -> None:
        fsync_dir(self._child(name) if name else self.root)

    def publish(
        self, tmp_name: str, final_name: str, old_name: str, *, replace: bool = True
    ) -> bool:
        """Atomically give ``tmp_name`` the name ``final_name``; fsync the root.

        If ``final_name`` exists it is swapped out atomically (renameat2 RENAME_EXCHANGE) to
        ``old_name``, so the step exists under its final name at every instant. Returns
        whether an old step was replaced (it now lives at ``old_name``). With
        ``replace=False`` an existing ``final_name`` raises FileExistsError instead, decided
        by the rename itself (RENAME_NOREPLACE), so two processes cannot both succeed.
        """
        tmp, final = self._child(tmp_name), self._child(final_name)
        replaced = False
        with self._writing("publish", final):
            if not replace:
                if not _renameat2(tmp, final, _RENAME_NOREPLACE):
                    if final.exists():  # no RENAME_NOREPLACE: rename() refuses a non-empty one
                        raise FileExistsError(errno.EEXIST, "exists", str(final))
                    os.rename(tmp, final)
            elif final.exists():
                if _renameat2(tmp, final, _RENAME_EXCHANGE):
                    os.rename(tmp, self._child(old_name))
                else:
                    # No RENAME_EXCHANGE: a short window without the step, repaired by
                    # LocalTier.undo_interrupted_overwrites (readers) and
                    # LocalTier.recover_and_sweep (writers), both through _undo_overwrite.
                    os.rename(final, self._child(old_name))
                    os.rename(tmp, final)
                replaced = True
            else:
                os.rename(tmp, final)
            fsync_dir(self.root)
        return replaced

    def rename(self, src: str, dst: str) -> None:
        with self._writing("rename", self._child(src)):
            os.rename(self._child(src), self._child(dst))
            fsync_dir(self.root)

    def remove_tree(self, name: str, *, reason: str) -> None:
        path = self._child(name)
        logger.info("deleting %s (%s)", path, reason)
        with self._writing("delete", path):
            shutil.rmtree(path, ignore_errors=False)

    # ------------------------------------------------------------ reading

    def is_regular_file(self, *names: str) -> bool:
        """A plain file (not a link, FIFO or device): the only kind we read."""
        try:
            return stat.S_ISREG(os.lstat(self._child(*names)).st_mode)
        except FileNotFoundError:
            return False

    def read_file(self, *names: str, limit: int | None = None) -> bytes:
        """The file's bytes. With ``limit``, a file larger than that (a huge or sparse one
        where a small file of ours belongs) raises OSError (EFBIG) before anything is read."""
        with self.open_read(*names) as f:
            if limit is not None and (size := os.fstat(f.fileno()).st_size) > limit:
                raise OSError(
                    errno.EFBIG,
                    f"{size} bytes, more than the {limit} such a file of ours ever holds; not read",
                    str(self._child(*names)),
                )
            return f.read()

    def read_file_version(
        self, *names: str, limit: int | None = None
    ) -> tuple[bytes, FileVersion | None]:
        """:meth:`read_file`, with the version of the file those bytes are (None if it
        changed while it was read): for caching what is parsed from a file that is never
        rewritten in place, as :meth:`version` will tell."""
        with self.open_read(*names) as f:
            before = _version(os.fstat(f.fileno()))
            if limit is not None and before.size > limit:
                raise OSError(
                    errno.EFBIG,
                    f"{before.size} bytes, more than the {limit} such a file of ours ever holds; "
                    "not read",
                    str(self._child(*names)),
                )
            data = f.read()
            after = _version(os.fstat(f.fileno()))
        return data, (before if before == after else None)

    def version(self, *names: str) -> FileVersion | None:
        """The version of regular file ``names`` (see :class:`FileVersion`); None if there is
        no regular file there."""
        try:
            st = os.lstat(self._child(*names))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return _version(st) if stat.S_ISREG(st.st_mode) else None

    def open_read(self, *names: str) -> BinaryIO:
        """Open a plain file of ours for reading. Links are never followed (they could lead
        out of the root, to /dev/zero, ...), and a FIFO or device is refused before a read
        could block or never end: OSError naming the path and what it is."""
        path = self._child(*names)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise OSError(
                    errno.ELOOP,
                    "a symbolic link: dcp_tiered never reads through "
                    "links (they can lead out of the root); replace it with the file "
                    "itself",
                    str(path),
                ) from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(
                    errno.EINVAL,
                    "not a regular file (a FIFO, device or directory): refused before reading",
                    str(path),
                )
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def read_range_into(f: BinaryIO, offset: int, buffer: memoryview) -> memoryview:
        """Read ``len(buffer)`` bytes at ``offset`` of an open file without moving its position
        (safe from a helper thread); returns the part filled, shorter only at end of file."""
        got = 0
        while got < len(buffer) and (n := os.preadv(f.fileno(), [buffer[got:]], offset + got)):
            got += n
        return buffer[:got]

    @staticmethod
    def write_vectors(f: BinaryIO, views: list[memoryview]) -> None:
        """Write ``views`` in order at the current position of ``f`` (opened by
        :meth:`open_write`, nothing buffered in it), a few ``writev`` calls for all of them:
        one call per IOV_MAX buffers, more only after a short write."""
        fd = f.fileno()
        for start in range(0, len(views), _IOV_MAX):
            batch = views[start : start + _IOV_MAX]
            left = sum(len(v) for v in batch)
            while left:
                done = os.writev(fd, batch)
                if done <= 0:
                    raise OSError(errno.EIO, f"writev wrote nothing of {left} bytes")
                left -= done
                while batch and done >= len(batch[0]):
                    done -= len(batch[0])
                    batch = batch[1:]
                if batch and done:
                    batch[0] = batch[0][done:]

    def file_checksum(self, *names: str, progress: Callable[[int], object] | None = None) -> str:
        """CRC32C of a whole file, read in large chunks."""
        crc = 0
        with self.open_read(*names) as f:
            while chunk := f.read(_READ_CHUNK_BYTES):
                crc = integrity.checksum(chunk, crc)
                if progress is not None:
                    progress(len(chunk))
        return integrity.format_checksum(crc)

    # ------------------------------------------------------------ locks

    def lock_shared(self, directory: str) -> int:
        """Take a shared flock on ``directory``'s lock file; the kernel drops it if we die.

        Returns the descriptor; :meth:`unlock` releases it. While any holder is alive the
        directory is never swept as abandoned.
        """
        return self._lock(self._child(directory, LOCK_FILE), fcntl.LOCK_SH)

    def lock_exclusive(self, directory: str, name: str) -> int:
        """Wait for an exclusive flock on ``directory/name`` (created if missing)."""
        return self._lock(self._child(directory, name), fcntl.LOCK_EX)

    def path_of(self, *names: str) -> str:
        """The absolute path of an entry, for libraries that open files themselves."""
        return str(self._child(*names))

    def lock_root_exclusive(self, name: str) -> int:
        """Wait for an exclusive flock on root-level file ``name`` (created if missing)."""
        self.ensure_root()
        return self._lock(self._child(name), fcntl.LOCK_EX)

    def lock_root_shared(self, name: str) -> int:
        """A shared flock on root-level file ``name`` (created if missing)."""
        self.ensure_root()
        return self._lock(self._child(name), fcntl.LOCK_SH)

    def root_lock_held(self, name: str) -> bool:
        """Whether a live process holds a lock on root-level file ``name`` (creates nothing)."""
        return self._lock_held(self._child(name))

    def _lock_held(self, path: Path) -> bool:
        """Whether a live process holds a lock on the lock file at ``path`` (creates nothing)."""
        try:
            fd = self._lock(path, fcntl.LOCK_EX | fcntl.LOCK_NB, create=False)
        except FileNotFoundError:
            return False
        except BlockingIOError:
            return True
        os.close(fd)
        return False

    def names_file(self, fd: int, name: str) -> bool:
        """Whether root-level ``name`` is still the file open as ``fd`` (not removed or
        replaced since it was opened)."""
        try:
            return os.stat(self._child(name), follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def try_lock_exclusive(self, name: str) -> int | None:
        """Exclusive flock on root-level file ``name`` if nobody holds it, else None."""
        self.ensure_root()
        try:
            return self._lock(self._child(name), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None

    def _lock(self, path: Path, operation: int, *, create: bool = True) -> int:
        """Open lock file ``path`` and flock it; the descriptor, closed on failure.

        Lock files are never written, so they are opened read-only: a held lock then neither
        blocks remounting the filesystem read-only nor fails on a read-only root. Where flock
        is emulated with POSIX locks (NFS), an exclusive lock needs a descriptor open for
        writing (EBADF): then it is reopened read-write."""
        flags = os.O_CLOEXEC | (os.O_CREAT if create else 0)
        for mode in (os.O_RDONLY, os.O_RDWR):
            with self._writing("create the lock", path):
                fd = os.open(path, mode | flags, 0o644)
            try:
                fcntl.flock(fd, operation)
                return fd
            except OSError as e:
                os.close(fd)
                if e.errno != errno.EBADF or mode == os.O_RDWR:
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    def unlock(fd: int) -> None:
        os.close(fd)

    def is_locked(self, directory: str) -> bool:
        """True if some live process holds ``directory``'s lock."""
        return self._lock_held(self._child(directory, LOCK_FILE))

    def remove_empty_dir(self, name: str) -> None:
        """Remove directory ``name`` if it is empty (and nothing otherwise)."""
        with contextlib.suppress(OSError):
            self._child(name).rmdir()

    def remove_file(self, *names: str) -> None:
        with self._writing("delete", self._child(*names)), contextlib.suppress(FileNotFoundError):
            self._child(*names).unlink()
