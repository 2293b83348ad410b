"""What the reader checks before it hands DCP anything: stored tensor bytes that agree with the
manifest's dtype and shape, and typed errors for whatever else a hostile step makes fail.

A manifest is checksummed, but a checksum is no signature: one edited and resealed can name
another dtype or shape than the bytes it points at (float16 over float32 storage would load
as wrong values, silently). Each tensor item is a ``torch.save`` archive whose raw storage
record is followed by the zip data descriptor torch writes after it, which records the
record's size: so a raw view is taken only when the descriptor sits right where the
manifest's dtype and shape end the storage, and gives that very size. A tensor loaded through
``torch.load`` instead is compared with the manifest directly.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch

from .errors import (
    CheckpointNotFoundError,
    DcpTieredError,
    IntegrityError,
    ManifestError,
)

_DESCRIPTOR = b"PK\x07\x08"  # signature, CRC-32, then sizes: 4 + 4 bytes, or 8 + 8 (zip64)
_HINT = "the manifest does not match the data; restore the step from another tier"


def check_raw_storage(data: bytes | memoryview, raw_offset: int, nbytes: int, what: str) -> None:
    """Raise IntegrityError unless item bytes ``data`` hold a storage record of exactly
    ``nbytes`` bytes at ``raw_offset`` (``what`` names the item and step)."""
    end = raw_offset + nbytes
    check_storage_tail(memoryview(data)[end : end + 24], nbytes, what)


def raw_storage_ok(data: bytes | memoryview, raw_offset: int, nbytes: int) -> bool:
    """:func:`check_raw_storage` as a yes or no: for a loop over many items, which names
    the item only when it fails."""
    end = raw_offset + nbytes
    return storage_tail_ok(memoryview(data)[end : end + 24], nbytes)


def storage_tail_ok(tail: bytes | memoryview, nbytes: int) -> bool:
    """Whether ``tail`` (the item's bytes right after its raw storage, at least the 24 that
    follow) is the zip data descriptor of a storage record of ``nbytes`` bytes."""
    head = bytes(tail[:24])
    if head[:4] != _DESCRIPTOR:
        return False
    if len(head) >= 16 and struct.unpack_from("<II", head, 8) == (nbytes, nbytes):
        return True
    return len(head) >= 24 and struct.unpack_from("<QQ", head, 8) == (nbytes, nbytes)


_TAIL32 = struct.Struct("<4s4xII")
_TAIL64 = struct.Struct("<4s4xQQ")


def storage_tail_at(buf: memoryview, pos: int, end: int, nbytes: int) -> bool:
    """:func:`storage_tail_ok` for the bytes of ``buf`` from ``pos`` to ``end``, read where
    they lie (a restore's block: no slice, no copy per item)."""
    if end - pos < 16:
        return False
    signature, size, stored = _TAIL32.unpack_from(buf, pos)
    if signature != _DESCRIPTOR:
        return False
    if size == stored == nbytes:
        return True
    return end - pos >= 24 and _TAIL64.unpack_from(buf, pos)[1:] == (nbytes, nbytes)


_DESCRIPTOR32 = int.from_bytes(_DESCRIPTOR, "little")


def storage_tails_ok(
    block: memoryview, pos: np.ndarray, ends: np.ndarray, nbytes: np.ndarray
) -> np.ndarray:
    """:func:`storage_tail_at` for many items of one block at once: per item, whether the
    bytes of ``block`` from ``pos`` (to the item's end, ``ends``) are the 32-bit zip data
    descriptor of a storage record of ``nbytes`` bytes. False also for a zip64 descriptor,
    which :func:`storage_tail_at` then checks on its own."""
    fits = (pos >= 0) & (pos + 16 <= ends) & (ends <= len(block))
    if not len(pos) or len(block) < 16:
        return fits & False
    u8 = np.frombuffer(block, dtype=np.uint8)
    at = np.minimum(np.where(fits, pos, 0), len(u8) - 16)
    words = u8[at[:, None] + np.arange(16)].view("<u4")  # signature, CRC-32, two sizes
    return fits & (words[:, 0] == _DESCRIPTOR32) & (words[:, 2] == nbytes) & (words[:, 3] == nbytes)


def check_storage_tail(tail: bytes | memoryview, nbytes: int, what: str) -> None:
    """``tail``: the item's bytes right after its raw storage (at least the 24 that follow)."""
    if storage_tail_ok(tail, nbytes):
        return
    raise IntegrityError(
        f"{what}: the stored tensor is not {nbytes} bytes long, as the manifest's dtype and "
        f"shape say (its archive's storage record ends elsewhere); {_HINT}"
    )


def check_loaded_tensor(
    tensor: Any, sizes: torch.Size, dtype: torch.dtype, what: str
) -> torch.Tensor:
    """A tensor read back with ``torch.load``, if it is the manifest's dtype and shape."""
    if not isinstance(tensor, torch.Tensor):
        raise IntegrityError(f"{what}: the stored item is a {type(tensor).__name__}; {_HINT}")
    if tensor.dtype != dtype or tensor.size() != sizes:
        raise IntegrityError(
            f"{what}: the stored tensor is {tensor.dtype} {list(tensor.size())}, the manifest "
            f"says {dtype} {list(sizes)}; {_HINT}"
        )
    return tensor


def typed_metadata_error(e: Exception, step: str, where: str) -> DcpTieredError:
    """The typed error for what failed while a step's manifest was being found and read (a
    hostile marker or pointer, a save its marker names that is not there): DCP would report
    any other exception raised there as a bare AssertionError."""
    if isinstance(e, DcpTieredError):
        return e
    if isinstance(e, FileNotFoundError):
        return CheckpointNotFoundError(
            f"step {step!r} in {where}: a file of it is gone ({e}): it was deleted while "
            "being read, or its commit marker names a save whose files are not there; load "
            "another step"
        )
    return ManifestError(
        f"step {step!r} in {where} cannot be read: {type(e).__name__}: {str(e)[:500]}; "
        "load another step"
    )
