"""Reading files of the local tier: only plain files, never through a link, and never a FIFO
or device a read could block on. A part of :class:`~dcp_tiered.backends.local.LocalBackend`."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from typing import BinaryIO

from ..policy import integrity
from ._local_fs import FileVersion, LocalRoot, start_writeback, version_of

_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
_READ_CHUNK_BYTES = 16 * 2**20


class LocalReads(LocalRoot):
    """The reads of :class:`~dcp_tiered.backends.local.LocalBackend`."""

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
            before = version_of(os.fstat(f.fileno()))
            if limit is not None and before.size > limit:
                raise OSError(
                    errno.EFBIG,
                    f"{before.size} bytes, more than the {limit} such a file of ours ever holds; "
                    "not read",
                    str(self._child(*names)),
                )
            data = f.read()
            after = version_of(os.fstat(f.fileno()))
        return data, (before if before == after else None)

    def version(self, *names: str) -> FileVersion | None:
        """The version of regular file ``names`` (see :class:`FileVersion`); None if there is
        no regular file there."""
        try:
            st = os.lstat(self._child(*names))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return version_of(st) if stat.S_ISREG(st.st_mode) else None

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

    def prefetch(self, *names: str, offset: int, length: int) -> None:
        """Read ``length`` bytes at ``offset`` of plain file ``names`` into the page cache,
        not into this process: ``sendfile`` to ``/dev/null``, which costs a few percent of
        the CPU a read into a buffer does (228 MiB: 7 ms), in as few calls as the kernel
        takes, each without the GIL (a thread that needs the GIL between short calls waits
        up to a switch interval for each while another thread runs Python). For a file
        about to be read: ``posix_fadvise(WILLNEED)`` would not wait, but reads ahead only as
        far as the device's readahead window (128 KiB on many). Raises OSError where the
        file cannot be opened (as :meth:`open_read`) or read."""
        with self.open_read(*names) as f, open(os.devnull, "wb") as sink:
            end = offset + length
            while offset < end:
                n = os.sendfile(sink.fileno(), f.fileno(), offset, end - offset)
                if n <= 0:  # end of file
                    return
                offset += n

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

    @staticmethod
    def start_writeback(f: BinaryIO, offset: int, nbytes: int) -> None:
        """Start writing bytes of ``f`` just written to the disk, not waiting (see
        :func:`~dcp_tiered.backends._local_fs.start_writeback`): the fsync at its end then
        waits for the last of them only."""
        start_writeback(f.fileno(), offset, nbytes)

    def file_checksum(self, *names: str, progress: Callable[[int], object] | None = None) -> str:
        """CRC32C of a whole file, read in large chunks."""
        crc = 0
        with self.open_read(*names) as f:
            while chunk := f.read(_READ_CHUNK_BYTES):
                crc = integrity.checksum(chunk, crc)
                if progress is not None:
                    progress(len(chunk))
        return integrity.format_checksum(crc)
