"""Checksums: CRC32C (the checksum S3 and GCS also offer), computed while bytes stream past."""

from __future__ import annotations

from typing import BinaryIO

import crc32c

ALGORITHM = "crc32c"


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
        # torch.save reports a failed write only as a position mismatch; keep the real error.
        self.error: OSError | None = None

    def start_item(self) -> int:
        self.item_crc = 0
        return self.position

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
