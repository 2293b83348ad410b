"""The memory tier: each rank's snapshot in host shared memory, in two reused slots.

Under the memory root (a tmpfs such as ``/dev/shm/run1``) every rank owns ``rank-<R>/``::

    slot-0.data  slot-1.data    the tensors, at fixed offsets; allocated once, then reused
    slot-0.json  slot-1.json    headers: step, layout, checksums. A slot is committed once its
                                header exists, and its header is the last thing written.

A save picks the slot that does not hold the newest snapshot, removes its header, copies the
state into it (the caller's stall: one copy, no serialisation), and hands the checksums and
the header to a background thread. A crash at any moment leaves the other slot's snapshot
whole. The files outlive the processes (not the node), and the copy is the only cost a
training step pays, so a snapshot every step is affordable.

Memory snapshots involve no collective: ranks agree on what to restore in the manager.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from .._priority import lower_this_thread
from ..backends.local import LocalBackend
from ..errors import CheckpointNotFoundError, IntegrityError, ManifestError
from ..policy import layout
from ..policy import memory_format as fmt

logger = logging.getLogger(__name__)

SLOTS = 2


def _data(slot: int) -> str:
    return f"slot-{slot}.data"


def _header(slot: int) -> str:
    return f"slot-{slot}.json"


class MemoryTier:
    """One rank's two snapshot slots under ``root/rank-<rank>``."""

    def __init__(
        self, root: str | os.PathLike[str], rank: int, *, allow_pickle: bool = False
    ) -> None:
        self.root = str(LocalBackend(root).root)
        self.rank = rank
        self.allow_pickle = allow_pickle  # non-tensor values load with full pickle (trusted)
        self.backend = LocalBackend(os.path.join(self.root, f"rank-{rank}"))
        self._buffers: dict[int, tuple[tuple[Any, ...], torch.Tensor]] = {}
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="dcp-tiered-memory", initializer=lower_this_thread
        )
        self._pending: Future[dict[str, float]] | None = None
        self._next_slot: int | None = None
        self.last_copy_secs = 0.0
        self.last_bytes = 0

    def __repr__(self) -> str:
        return f"MemoryTier({self.backend.root})"

    # ------------------------------------------------------------ saving

    def buffers_ready(self) -> bool:
        return len(self._buffers) == SLOTS

    def save(self, step: str, state: dict[str, Any]) -> Future[dict[str, float]]:
        """Copy ``state`` (already resolved: no Stateful objects) into a slot now; checksum
        and commit it in the background. The future gives the background timings."""
        layout.validate_step_name(step)
        self.wait()  # the other slot's commit: never leave both slots uncommitted
        started = time.perf_counter()
        tensors, objects = [], {}
        for path, leaf in fmt.leaves(state):
            if isinstance(leaf, torch.Tensor):
                tensors.append((path, leaf))
            else:
                objects[fmt.key(path)] = leaf
        regions, size = fmt.layout(tensors)
        slot = self._slot_to_write()
        self.backend.remove_file(_header(slot))  # uncommit first: the copy tears it
        buffer = self._buffer(slot, regions, size)
        with torch.no_grad():
            for (_, src), region in zip(tensors, regions):
                fmt.view(buffer, region).copy_(src)
        blob = fmt.encode_objects(objects)  # values may change once we return
        self.last_copy_secs = time.perf_counter() - started
        self.last_bytes = sum(r.nbytes for r in regions)
        self._pending = self._pool.submit(self._commit, step, slot, buffer, regions, size, blob)
        return self._pending

    def _slot_to_write(self) -> int:
        if self._next_slot is None:  # a new process: keep the newest snapshot of the last one
            committed = read_headers(self.backend)
            newest = max(committed, key=lambda s: committed[s].committed_at_ns, default=1)
            self._next_slot = 1 - newest
        slot, self._next_slot = self._next_slot, 1 - self._next_slot
        return slot

    def _buffer(self, slot: int, regions: list[fmt.Region], size: int) -> torch.Tensor:
        sig = (size, fmt.signature(regions))
        cached = self._buffers.get(slot)
        if cached is None or cached[0] != sig:
            self._buffers[slot] = (sig, self.backend.map_file(_data(slot), size))
        return self._buffers[slot][1]

    def _commit(
        self,
        step: str,
        slot: int,
        buffer: torch.Tensor,
        regions: list[fmt.Region],
        size: int,
        blob: bytes,
    ) -> dict[str, float]:
        started = time.perf_counter()
        checksums = [fmt.region_checksum(buffer, r) for r in regions]
        header = fmt.encode_header(
            step=step,
            rank=self.rank,
            committed_at_ns=time.time_ns(),
            data_size=size,
            regions=regions,
            checksums=checksums,
            objects=blob,
        )
        write_done = time.perf_counter()
        self.backend.replace_root_file(_header(slot), header)
        logger.debug("memory tier: %s committed in slot %d of %s", step, slot, self.backend.root)
        return {"write_s": write_done - started, "commit_s": time.perf_counter() - write_done}

    def wait(self) -> None:
        """Wait for the commit in flight; its error, if any, was reported by its future."""
        if self._pending is not None:
            wait([self._pending])  # without raising: the caller got this future and its error
            self._pending = None

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()
        self._buffers.clear()

    # ------------------------------------------------------------ reading

    def steps(self) -> dict[str, int]:
        """Committed step name -> commit time (ns) of this rank's slots."""
        out: dict[str, int] = {}
        for h in read_headers(self.backend).values():  # a step saved again: its newest copy
            out[h.step] = max(out.get(h.step, 0), h.committed_at_ns)
        return out

    def load(self, step: str, app_state: dict[str, Any]) -> None:
        """Verify ``step``'s snapshot and load it into ``app_state`` (Stateful objects get
        ``load_state_dict``); raises CheckpointNotFoundError or IntegrityError."""
        found = [(s, h) for s, h in read_headers(self.backend).items() if h.step == step]
        if not found:
            raise CheckpointNotFoundError(f"{step} is not in the memory tier {self.backend.root}")
        # Saved again after a restore fell back past it: the newest copy is the step.
        slot, header = max(found, key=lambda sh: sh[1].committed_at_ns)
        where = f"memory-tier {step} of rank {self.rank} ({self.backend.path_of(_data(slot))})"
        if self.backend.file_size(_data(slot)) != header.data_size:
            raise IntegrityError(f"{where}: data file has the wrong size")
        buffer = torch.from_file(
            self.backend.path_of(_data(slot)),
            shared=False,
            size=header.data_size,
            dtype=torch.uint8,
        )
        tensors = {}
        for region, expected in zip(header.regions, header.checksums):
            if fmt.region_checksum(buffer, region) != expected:
                raise IntegrityError(f"{where}: {region.key} fails its checksum")
            tensors[region.key] = fmt.view(buffer, region)
        objects = fmt.decode_objects(header.objects, allow_pickle=self.allow_pickle)
        for name, value in app_state.items():
            if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
                value.load_state_dict(
                    fmt.fill(value.state_dict(), tensors, objects, where, (name,))
                )
            else:
                app_state[name] = fmt.fill(value, tensors, objects, where, (name,))


def read_headers(backend: LocalBackend) -> dict[int, fmt.Header]:
    """Slot -> header of each committed slot in one rank's directory."""
    found = {}
    for slot in range(SLOTS):
        try:
            data = backend.read_file(_header(slot))
        except FileNotFoundError:
            continue
        try:
            found[slot] = fmt.decode_header(data, where=backend.path_of(_header(slot)))
        except ManifestError as e:
            logger.warning("ignoring memory-tier slot %d: %s", slot, e)
    return found


def list_steps(root: str | os.PathLike[str]) -> dict[str, list[int]]:
    """Step name -> ranks whose slots hold it, for every rank directory under ``root``."""
    found: dict[str, list[int]] = {}
    for name in LocalBackend(root).list_names():
        if name.startswith("rank-") and name[5:].isdigit():
            backend = LocalBackend(os.path.join(root, name))
            for header in read_headers(backend).values():
                found.setdefault(header.step, []).append(int(name[5:]))
    return found
