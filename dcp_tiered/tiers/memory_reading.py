"""The memory tier's reading side: which snapshots its slots hold, and their loading.

A part of :class:`~dcp_tiered.tiers.memory.MemoryTier` (a base class of it) that only reads
the slots: committed headers, filtered by the tier's run and world size, and a step's
newest copy, verified and loaded, or handed over as stored for peer replication.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .. import _gc
from ..backends.local import LocalBackend
from ..errors import CheckpointNotFoundError, IntegrityError
from ..policy import memory_format as fmt
from .memory_restore import fill_state, verify
from .memory_slots import data_file, header_file, read_headers

logger = logging.getLogger("dcp_tiered.tiers.memory")  # the tier's one logger


class SlotReading:
    """Reads one rank's slots under ``backend``; snapshots count for ``run_id`` (None: any)
    and ``world_size`` (None: any)."""

    backend: LocalBackend
    rank: int
    run_id: str | None
    world_size: int | None
    allow_pickle: bool

    def steps(self) -> dict[str, int]:
        """Committed step name -> commit time (ns) of this rank's slots."""
        out: dict[str, int] = {}
        for h in self._headers().values():  # a step saved again: its newest copy
            out[h.step] = max(out.get(h.step, 0), h.committed_at_ns)
        return out

    @_gc.paused_during  # both headers and the fill: objects per tensor, none in cycles
    def load(self, step: str, app_state: dict[str, Any]) -> None:
        """Verify ``step``'s snapshot and load it into ``app_state`` (Stateful objects get
        ``load_state_dict``); raises CheckpointNotFoundError or IntegrityError."""
        newest = self._newest(step)
        if newest is None:
            raise CheckpointNotFoundError(f"{step} is not in the memory tier {self.backend.root}")
        slot, header = newest
        where = f"memory-tier {step} of rank {self.rank} ({self.backend.path_of(data_file(slot))})"
        if self.backend.file_size(data_file(slot)) != header.data_size:
            raise IntegrityError(f"{where}: data file has the wrong size")
        buffer = self._file(slot, header.data_size)
        verify(header, buffer, where)
        fill_state(header, buffer, app_state, where, allow_pickle=self.allow_pickle)

    def _newest(self, step: str) -> tuple[int, fmt.Header] | None:
        """The slot holding ``step`` and its header (saved again after a restore fell back
        past it: the newest copy is the step); None where no slot counts that holds it."""
        found = [(s, h) for s, h in self._headers().items() if h.step == step]
        return max(found, key=lambda sh: sh[1].committed_at_ns, default=None)

    def _headers(self) -> dict[int, fmt.Header]:
        """The committed slots whose snapshots count for this tier's run and world size."""
        found = read_headers(self.backend)
        kept = {slot: h for slot, h in found.items() if self._counts(h)}
        for slot in sorted(set(found) - set(kept)):
            h = found[slot]
            logger.debug(
                "memory tier %s: slot %d (%s) is not restored: run %r, world size %s (this is "
                "run %r, world size %s)",
                self.backend.root,
                slot,
                h.step,
                h.run_id,
                h.world_size,
                self.run_id,
                self.world_size,
            )
        return kept

    def _counts(self, header: fmt.Header) -> bool:
        if self.run_id is not None and header.run_id != self.run_id:
            return False
        return self.world_size is None or header.world_size == self.world_size

    def raw(self, step: str) -> tuple[bytes, torch.Tensor] | None:
        """The newest copy of ``step`` as stored (header bytes, data), unverified: the reader
        verifies it."""
        newest = self._newest(step)
        if newest is None:
            return None
        slot, header = newest
        return self.backend.read_file(header_file(slot)), self._file(slot, header.data_size)

    def _file(self, slot: int, size: int) -> torch.Tensor:
        return torch.from_file(
            self.backend.path_of(data_file(slot)), shared=False, size=size, dtype=torch.uint8
        )
