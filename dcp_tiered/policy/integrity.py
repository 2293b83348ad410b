"""Checksums: CRC32C (the checksum S3 and GCS also offer), computed while bytes stream past."""

from __future__ import annotations

from typing import BinaryIO

import crc32c

ALGORITHM = "crc32c"
# Smallest tensor whose raw bytes are located for in-place reads; torch.save's own framing
# writes (headers, pickle, central directory) are all far smaller, so they never match.
RAW_MIN_BYTES = 4096


def checksum(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value``. Releases the GIL on large buffers."""
    return crc32c.crc32c(data, value=value)


def format_checksum(value: int) -> str:
    return f"{value:08x}"


class ChecksummingWriter:
    """A write-only stream that checksums every byte on its way to ``raw``.

    It keeps two running CRCs: one for the whole file and one for the current item, so the
    manifest gets both without reading anything back.
    """

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.position = 0
        self.file_crc = 0
        self.item_crc = 0
        # Position and length of every write of at least RAW_MIN_BYTES in the current item:
        # torch.save hands a tensor's storage to the stream in one write, so the reader can
        # later view those bytes in place instead of running torch.load (see raw_offset).
        self.item_large_writes: list[tuple[int, int]] = []
        # torch.save reports a failed write only as a position mismatch; keep the real error.
        self.error: OSError | None = None

    def start_item(self) -> int:
        self.item_crc = 0
        self.item_large_writes = []
        return self.position

    def raw_offset(self, start: int, nbytes: int) -> int | None:
        """Offset, from the item's ``start``, of the single write of exactly ``nbytes`` (the
        tensor's raw storage), or None when there is not exactly one such write."""
        found = [pos for pos, length in self.item_large_writes if length == nbytes]
        return found[0] - start if nbytes >= RAW_MIN_BYTES and len(found) == 1 else None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self.file_crc = checksum(view, self.file_crc)
        self.item_crc = checksum(view, self.item_crc)
        try:
            written = self._raw.write(view)
            if written is None or written != len(view):
                raise OSError(f"short write: {written} of {len(view)} bytes")
        except OSError as e:
            self.error = e
            raise
        if len(view) >= RAW_MIN_BYTES:
            self.item_large_writes.append((self.position, len(view)))
        self.position += len(view)
        return len(view)

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False
