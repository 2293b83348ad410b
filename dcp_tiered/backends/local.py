"""Local filesystem backend: every read, write, rename and delete on the local tier.

Nothing here writes or deletes outside ``root``: every name is one path component checked by
``_child``, and every delete is logged at INFO. Its reads and its locks live in
:mod:`._local_reads` and :mod:`._local_locks`; the root and the typed write errors in
:mod:`._local_fs`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import torch

from ..errors import InsufficientSpaceError
from ..policy import layout
from ..policy.layout import TMP_SUFFIX
from ._local_fs import (  # noqa: F401 - names callers import from here
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    FileVersion,
    available_memory_bytes,
    fsync_dir,
    nearest_existing,
    renameat2,
    typed_write_error,
)
from ._local_locks import LocalLocks
from ._local_reads import LocalReads
from .base import Backend

logger = logging.getLogger(__name__)

_WRITE_BUFFER_BYTES = 4 * 2**20


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


class LocalBackend(LocalReads, LocalLocks, Backend):
    """A directory on a local disk holding one run's steps."""

    def __repr__(self) -> str:
        return f"LocalBackend({str(self.root)!r})"

    # ------------------------------------------------------------ paths

    def exists(self, *names: str) -> bool:
        """Whether ``names`` exists: one path component each, or one key of the contract."""
        return self._child(*(_names(names[0]) if len(names) == 1 else names)).exists()

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
        st = os.statvfs(nearest_existing(self.root))
        return st.f_bavail * st.f_frsize

    def check_writable(self) -> None:
        """Raise NotWritableError now if the root's filesystem is read-only, or the root (its
        nearest existing parent) is not writable by this process: before anything is planned
        or written, and before a read-only disk's free space could be blamed instead."""
        where = nearest_existing(self.root)
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

    def write_sidecar(self, step: str, name: str, data: bytes) -> None:
        """Write file ``name`` of an adapter's into committed ``step`` as
        :meth:`write_atomically` does, marked as ours first (an empty file beside it), so that
        deleting the step deletes it too."""
        self._atomic_write((step, layout.SIDECAR_MARK + name), b"", exclusive=False)
        self._atomic_write((step, name), data, exclusive=False)

    def write_atomically(self, directory: str, name: str, data: bytes) -> None:
        """Replace small file ``directory/name`` as :meth:`replace_root_file` does under the
        root: readers see the old content or the new, even after a power loss."""
        self._atomic_write((directory, name), data, exclusive=False)

    def map_file(self, name: str, nbytes: int, *, exclusive: bool = False) -> torch.Tensor:
        """A uint8 tensor backed by root-level file ``name`` of exactly ``nbytes`` bytes, shared
        with the file (writes go to it). The space is reserved up front, so a full tmpfs fails
        here with InsufficientSpaceError rather than with SIGBUS on a later write.
        ``exclusive``: only a file this call creates (FileExistsError where one exists)."""
        self.ensure_root()
        path = self._child(name)
        # O_NOFOLLOW: a link at the name is not ours to write through (its target would be
        # truncated and overwritten); the open fails with ELOOP instead
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | (os.O_EXCL if exclusive else 0)
        # exclusive: FileExistsError untyped, the caller asked to find the file absent
        with contextlib.nullcontext() if exclusive else self._writing("create", path):
            fd = os.open(path, flags, 0o600)
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
        self._atomic_write((name,), data, exclusive=False)

    def create_root_file(self, name: str, data: bytes) -> bool:
        """Create small file ``name`` directly under the root only if it does not exist, whole
        or not at all (as :meth:`replace_root_file`, but linked into place); False if it
        exists."""
        return self._atomic_write((name,), data, exclusive=True)

    def atomic_write(self, key: str, data: bytes, *, exclusive: bool = False) -> bool:
        """The contract's atomic write (:class:`~dcp_tiered.backends.base.Backend`)."""
        return self._atomic_write(_names(key), data, exclusive=exclusive)

    def _atomic_write(self, names: tuple[str, ...], data: bytes, *, exclusive: bool) -> bool:
        """The one atomic small-file write: file ``names`` written aside (a hidden temporary
        file of this process and thread), fsynced, then renamed over it (``exclusive``: linked
        into place, False if it exists), and its directory fsynced."""
        *where, name = names
        if not where:
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
                if not renameat2(tmp, final, RENAME_NOREPLACE):
                    if final.exists():  # no RENAME_NOREPLACE: rename() refuses a non-empty one
                        raise FileExistsError(errno.EEXIST, "exists", str(final))
                    os.rename(tmp, final)
            elif final.exists():
                if renameat2(tmp, final, RENAME_EXCHANGE):
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

    def remove_step_dir(self, name: str, *, reason: str) -> list[str]:
        """Delete step directory ``name`` (a step, or one under a hidden name of ours) as far
        as it is ours: its files a save writes (:func:`~dcp_tiered.policy.layout.is_step_file`),
        the manifest first, then the directory if that empties it. Anything else in it (a
        user's file, a subdirectory) stays, named in a warning; returns those names."""
        path = self._child(name)
        entries = os.listdir(path)
        kept = sorted(e for e in entries if not self._is_step_file(path / e, entries))
        if not kept:
            self.remove_tree(name, reason=reason)
            return []
        logger.warning(
            "deleting only the step's own files of %s (%s): %s %s not the step's and stay%s",
            path,
            reason,
            ", ".join(kept),
            "is" if len(kept) == 1 else "are",
            "s" if len(kept) == 1 else "",
        )
        with self._writing("delete", path):
            for entry in layout.step_files_in_order(set(entries) - set(kept)):
                logger.info("deleting %s (%s)", path / entry, reason)
                with contextlib.suppress(FileNotFoundError):
                    (path / entry).unlink()
            fsync_dir(path)
        return kept

    @staticmethod
    def _is_step_file(path: Path, beside: list[str]) -> bool:
        try:  # a directory under our file name is not ours; a link is removed, not followed
            return layout.is_step_file(path.name, beside) and not stat.S_ISDIR(path.lstat().st_mode)
        except FileNotFoundError:
            return True  # gone already

    def path_of(self, *names: str) -> str:
        """The absolute path of an entry, for libraries that open files themselves."""
        return str(self._child(*names))

    def remove_empty_dir(self, name: str) -> None:
        """Remove directory ``name`` if it is empty (and nothing otherwise)."""
        with contextlib.suppress(OSError):
            self._child(name).rmdir()

    def remove_file(self, *names: str) -> None:
        with self._writing("delete", self._child(*names)), contextlib.suppress(FileNotFoundError):
            self._child(*names).unlink()

    # ------------------------------------------------------------ the rest of the contract

    def read(self, key: str) -> bytes:
        return self.read_file(*_names(key))

    def write(self, key: str, data: bytes) -> None:
        path = self._child(*_names(key))
        with self._writing("write", path), open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def remove(self, key: str, *, reason: str) -> None:
        path = self._child(*_names(key))
        logger.info("deleting %s (%s)", path, reason)
        with self._writing("delete", path), contextlib.suppress(FileNotFoundError):
            path.unlink()

    def children(self, prefix: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._child(*_names(prefix)) if prefix else self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []


def _names(key: str) -> tuple[str, ...]:
    """A key's path components (each is checked by ``_child``: a key of ``..``, an empty or an
    absolute one is refused there)."""
    return tuple(key.removesuffix("/").split("/"))
