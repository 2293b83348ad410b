"""The memory tier's side of peer replication: a committed snapshot lent out as stored, and a
partner's copy received into a slot.

A part of :class:`~dcp_tiered.tiers.memory.MemoryTier` (a base class of it, beside
:class:`~dcp_tiered.tiers.memory_reading.SlotReading`, which it extends). A received copy
takes a slot the way a save does (the saving side's ``_uncommit_a_slot``, ``_torn_if_failed``
and ``_buffer``, declared below), so a crash while receiving leaves the other slot whole; a
lent slot is one no save overwrites until it is released.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..errors import IntegrityError
from ..policy import memory_format as fmt
from .memory_reading import SlotReading
from .memory_restore import verify
from .memory_slots import header_file

# A slot's layout, mapping and one view per tensor (MemoryTier._buffer)
SlotBuffer = tuple[list[fmt.Region], int, torch.Tensor, Any]


class SlotReplication(SlotReading):
    """Lends this rank's committed snapshot to a partner; receives a partner's copy."""

    _lock: threading.Lock
    _leased: int | None  # the slot lent out: no save overwrites it until released
    _buffers: dict[int, tuple[Any, SlotBuffer]]  # slot -> (state structure, its buffer)
    # the saving side's (MemoryTier): the slot written next, uncommitted; a write into it that
    # fails leaves it the slot written next; its buffer for a layout
    _uncommit_a_slot: Callable[[], int]
    _torn_if_failed: Callable[[int], AbstractContextManager[None]]
    _buffer: Callable[..., SlotBuffer]

    def lease(self, step: str) -> tuple[bytes, torch.Tensor] | None:
        """The committed snapshot of ``step`` (header bytes, data), kept from being overwritten
        until :meth:`release`; None if no slot holds it."""
        with self._lock:
            newest = self._newest(step)
            if newest is None:
                return None
            slot, header = newest
            data = self.backend.read_file(header_file(slot))
            self._leased = slot
        cached = self._buffers.get(slot)
        buffer = (
            cached[1][2]
            if cached is not None and cached[1][2].numel() == header.data_size
            else self._file(slot, header.data_size)
        )
        return data, buffer[: header.data_size]

    def release(self) -> None:
        with self._lock:
            self._leased = None

    def receive(
        self, header_bytes: bytes, fill: Callable[[torch.Tensor], None], *, step: str
    ) -> None:
        """Commit a copy of rank ``rank``'s snapshot of ``step``: ``fill`` writes its data
        into a slot, which is verified against the header's checksums before the header (the
        sender's, as it was) is written last. Raises ManifestError or IntegrityError."""
        where = f"replica of rank {self.rank}'s {step} in {self.backend.root}"
        header = fmt.decode_header(header_bytes, where=where)
        if header.rank != self.rank or header.step != step:
            raise IntegrityError(f"{where}: the header is rank {header.rank}'s {header.step}")
        if not self._counts(header):
            raise IntegrityError(
                f"{where}: the snapshot is run {header.run_id!r}'s, not this run's"
            )
        slot = self._uncommit_a_slot()
        sig = (
            "received",
            header.data_size,
            tuple((r.key, r.offset, r.nbytes) for r in header.regions),
        )
        with self._torn_if_failed(slot):
            layout_of = lambda: (header.regions, header.data_size)
            _, _, buffer, _ = self._buffer(slot, sig, layout_of)
            fill(buffer)
            verify(header, buffer, where)
            self.backend.replace_root_file(header_file(slot), header_bytes)
