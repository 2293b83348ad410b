"""Checksums: CRC32C (the checksum S3 and GCS also offer), computed while bytes stream past."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable
from typing import Any, BinaryIO

import crc32c

ALGORITHM = "crc32c"
# Smallest tensor whose raw bytes are located for in-place reads; torch.save's own framing
# writes (headers, pickle, central directory) are all far smaller, so they never match.
RAW_MIN_BYTES = 4096


def checksum(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value``. Releases the GIL on large buffers."""
    return crc32c.crc32c(data, value=value)


def checksums(views: Iterable[bytes | bytearray | memoryview]) -> list[int]:
    """CRC32C of each of ``views`` (one C call each, no Python frame between them)."""
    return list(map(crc32c.crc32c, views))


# CRC32C (Castagnoli), reflected: combining two CRCs is multiplying in GF(2) modulo this
# polynomial (the method of zlib's crc32_combine).
_POLY = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


# Lengths up to 2^64 bytes: x^(2^k) for every bit of 8 * length. zlib's table has 32 entries
# and wraps (k & 31), which holds for CRC-32's polynomial, whose squares repeat every 32 steps,
# and not for CRC32C's: they repeat every 31, so a table of 32 combined every length of 512 MiB
# or more wrongly (a tensor that large saved with a CRC its own bytes fail).
_X2N_BITS = 67


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(_X2N_BITS):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()  # x^(2^k) modulo the polynomial, k = 0 .. _X2N_BITS - 1


@functools.lru_cache(maxsize=8192)
def _shift(length: int) -> int:
    """x^(8 * length) modulo the polynomial: appending ``length`` bytes, as a factor."""
    if not 0 <= length < 2**64:
        raise ValueError(f"cannot append {length} bytes to a CRC32C")
    p, k = 1 << 31, 3  # one byte is 2^3 bits
    while length:
        if length & 1:
            p = _multmodp(_X2N[k], p)
        length >>= 1
        k += 1
    return p


def shift_factor(length: int) -> int:
    """The factor that appends ``length`` bytes to a CRC32C (:func:`combine` multiplies by
    it); for :mod:`dcp_tiered.policy.region_crcs`."""
    return _shift(length)


def combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of A + B from CRC32C(A), CRC32C(B) and len(B), without reading either."""
    return _multmodp(_shift(len2), crc1) ^ crc2


def format_checksum(value: int) -> str:
    return f"{value:08x}"


def matches(data: bytes | bytearray | memoryview, expected: str) -> bool:
    """Whether ``data`` has the CRC32C ``expected`` (as :func:`format_checksum` writes it; an
    empty one: no checksum recorded, nothing to compare). One call per item of a restore."""
    return not expected or f"{crc32c.crc32c(data):08x}" == expected


class ChecksummingWriter:
    """A write-only stream that checksums every byte on its way to ``raw``.

    torch.save hands its stream about 40 writes per tensor (zip headers, pickle, padding), so
    the per-write work is what a state of many small tensors costs. Writes under
    ``BUFFER_BYTES`` only collect in a buffer; the item's CRC is taken once over its part of
    the buffer, the file's CRC once per flush, and the buffer goes to ``raw`` in one write per
    few MiB. Writes of ``DIRECT_BYTES`` or more (a large tensor's storage) go straight
    through; from ``COMBINE_BYTES`` on they are checksummed once and folded into both CRCs
    (see :func:`combine`), smaller ones twice. The manifest gets both CRCs
    without reading anything back. Call :meth:`close` once done: until then the last bytes
    may still be in the buffer.
    """

    BUFFER_BYTES = 4 * 2**20
    DIRECT_BYTES = 2**20
    # From this size a second CRC pass (~12 GB/s here) costs more than combining (~0.2 ms).
    COMBINE_BYTES = 8 * 2**20

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.position = 0  # bytes accepted so far (the file offset of the next write)
        self._buf = bytearray()
        self._buf_start = 0  # file offset of _buf[0]; everything before it is in raw
        self._file_crc = 0  # CRC of the bytes before _buf_start
        self._item_crc = 0  # CRC of the current item's bytes before _item_mark
        self._item_mark = 0
        self._expect = 0  # the current tensor's byte count (see start_item)
        # (position, length) of the current item's writes that may be its tensor's storage:
        # torch.save hands the storage to the stream in one write, so the reader can later
        # view those bytes in place instead of running torch.load (see raw_offset).
        self.item_large_writes: list[tuple[int, int]] = []
        # torch.save reports a failed write only as a position mismatch; keep the real error.
        self.error: OSError | None = None

    def start_item(self, tensor_bytes: int = 0) -> int:
        """Start the next item (``tensor_bytes``: the size of the tensor it holds, if any);
        returns its offset. Flushes the buffer when it is full, between items only."""
        if len(self._buf) >= self.BUFFER_BYTES:
            self._flush_buffer()
        self._item_crc = 0
        self._item_mark = self.position
        self._expect = tensor_bytes
        self.item_large_writes = []
        return self.position

    @property
    def item_crc(self) -> int:
        """CRC32C of the current item's bytes so far."""
        return checksum(self._item_tail(), self._item_crc)

    @property
    def file_crc(self) -> int:
        """CRC32C of every byte written so far."""
        return checksum(self._buf, self._file_crc)

    def _item_tail(self) -> memoryview:
        return memoryview(self._buf)[self._item_mark - self._buf_start :]

    def raw_offset(self, start: int, nbytes: int, tensor: Any = None) -> int | None:
        """Offset, from the item's ``start``, of the tensor's raw storage of ``nbytes``, or None
        when it cannot be told for certain. A storage of at least RAW_MIN_BYTES is the single
        write of exactly that size (torch.save's framing writes are all smaller). A smaller
        one is a write of that size whose bytes, still in the buffer, equal ``tensor``'s own
        (a CPU contiguous tensor): equal bytes read back as the same tensor wherever they lie.
        """
        found = [pos for pos, length in self.item_large_writes if length == nbytes]
        if nbytes >= RAW_MIN_BYTES:
            return found[0] - start if len(found) == 1 else None
        if nbytes <= 0 or tensor is None:
            return None
        own = ctypes.string_at(tensor.data_ptr(), nbytes)
        for pos in found:
            at = pos - self._buf_start
            if at >= 0 and self._buf[at : at + nbytes] == own:
                return pos - start
        return None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if n == self._expect or n >= RAW_MIN_BYTES:
            self.item_large_writes.append((self.position, n))
        if n < self.DIRECT_BYTES:
            self._buf += view
        else:
            self._flush_buffer()
            if n >= self.COMBINE_BYTES:  # one pass, folded into both CRCs
                own, shift = checksum(view), _shift(n)
                self._item_crc = _multmodp(shift, self._item_crc) ^ own
                self._file_crc = _multmodp(shift, self._file_crc) ^ own
            else:
                self._item_crc = checksum(view, self._item_crc)
                self._file_crc = checksum(view, self._file_crc)
            self._write_raw(view)
            self._item_mark = self._buf_start = self.position + n
        self.position += n
        return n

    def _flush_buffer(self) -> None:
        """Hand the buffer to ``raw``, folding it into both CRCs first."""
        if self._item_mark < self.position:
            self._item_crc = checksum(self._item_tail(), self._item_crc)
            self._item_mark = self.position
        if self._buf:
            self._file_crc = checksum(self._buf, self._file_crc)
            self._write_raw(memoryview(self._buf))
            self._buf = bytearray()
        self._buf_start = self.position

    def _write_raw(self, view: memoryview) -> None:
        try:
            written = self._raw.write(view)
            if written is None or written != len(view):
                raise OSError(f"short write: {written} of {len(view)} bytes")
        except OSError as e:
            self.error = e
            raise

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        """Hand everything written so far to ``raw`` (and flush it)."""
        self._flush_buffer()
        self._raw.flush()

    def close(self) -> None:
        """Flush; ``raw`` stays open (its owner closes it)."""
        self._flush_buffer()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False
