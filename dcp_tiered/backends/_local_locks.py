"""flock-based locks on the local tier: held by live processes only (the kernel drops a dead
one's), so a lock tells a directory in use from one a crash left. A part of
:class:`~dcp_tiered.backends.local.LocalBackend`."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from ..policy.layout import LOCK_NAME as LOCK_FILE
from . import _proc
from ._local_fs import LocalRoot


class LocalLocks(LocalRoot):
    """The locks of :class:`~dcp_tiered.backends.local.LocalBackend`."""

    def lock_shared(self, directory: str) -> int:
        """Take a shared flock on ``directory``'s lock file; the kernel drops it if we die.

        Returns the descriptor; :meth:`unlock` releases it. While any holder is alive the
        directory is never swept as abandoned.
        """
        return self._lock(self._child(directory, LOCK_FILE), fcntl.LOCK_SH)

    def lock_exclusive(self, directory: str, name: str) -> int:
        """Wait for an exclusive flock on ``directory/name`` (created if missing)."""
        return self._lock(self._child(directory, name), fcntl.LOCK_EX)

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

    def root_lock_holders(self, name: str) -> list[int] | None:
        """The processes of this machine that hold a lock on root-level file ``name``; None
        where the OS does not say (see :mod:`~dcp_tiered.backends._proc`)."""
        return _proc.lock_holders(self._child(name))

    @staticmethod
    def process_exiting(pid: int) -> bool:
        """Whether process ``pid`` of this machine is gone or already being killed."""
        return _proc.exiting(pid)

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

    def is_locked_file(self, directory: str, name: str) -> bool:
        """True if some live process holds lock file ``directory/name`` (creates nothing)."""
        return self._lock_held(self._child(directory, name))
