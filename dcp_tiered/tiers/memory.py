"""The memory tier: each rank's snapshot in host shared memory, in two reused slots.

Under the memory root (a tmpfs such as ``/dev/shm/run1``) every rank owns ``rank-<R>/``::

    slot-0.data  slot-1.data    the tensors, at fixed offsets; allocated once, then reused
    slot-0.json  slot-1.json    headers: step, layout, checksums. A slot is committed once its
                                header exists, and its header is the last thing written.

A save picks the slot that does not hold the newest snapshot, removes its header, copies the
state into it (the caller's stall: one copy, no serialisation), and hands the checksums and
the header to a background thread. A crash at any moment leaves the other slot's snapshot
whole. The files outlive the processes (not the node), and the copy is the only cost a
training step pays, so a snapshot every step is affordable. (A new layout's second slot is
made in the background once its first snapshot is queued for commit, where no file holds it.)

Memory snapshots involve no collective: ranks agree on what to restore in the manager.

Each header names the run and the world size that saved it. A tier built for a run sees only
that run's snapshots of the same world size: another run's (the memory directory records its
run, so that is refused at start) or one written before run identities is never restored, and a
snapshot of another world size is left to the disk and remote tiers, which reshard.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from .. import _torch_compat, batch_copy, tensor_versions
from .._priority import lower_this_thread
from ..backends.local import LocalBackend
from ..errors import StateChangedError
from ..policy import layout, memory_chunks
from ..policy import memory_format as fmt
from . import chunk_copy, memory_copy, ownership
from .memory_replication import SlotReplication
from .memory_slots import (
    SLOTS,
    data_file,
    header_file,
    read_headers,
    refuse_foreign,
    refuse_links,
    reserve,
)

logger = logging.getLogger(__name__)


class MemoryTier(SlotReplication):
    """One rank's two snapshot slots under ``root/rank-<rank>``."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        rank: int,
        *,
        allow_pickle: bool = False,
        directory: str | None = None,
        run_id: str | None = None,
        world_size: int | None = None,
    ) -> None:
        self.root = str(LocalBackend(root).root)
        self.rank = rank  # whose snapshots these are
        # whose snapshots count here (None: any, as the CLI lists them) and of how many ranks
        self.run_id, self.world_size = run_id, world_size
        self._recorded = False  # the memory root records run_id (see save)
        self.allow_pickle = allow_pickle  # non-tensor values load with full pickle (trusted)
        # ``directory``: another rank's copies kept here (peer replication), same format.
        self.backend = LocalBackend(os.path.join(self.root, directory or f"rank-{rank}"))
        # A slot being sent to a partner is leased: no save overwrites it until released.
        self._lock = threading.Lock()
        self._leased = None
        # slot -> (structure of the state, (regions, size, buffer, a view per tensor))
        self._buffers = {}
        self._plans: dict[int, memory_copy.CopyPlan | None] = {}  # slot -> how its copy runs
        # slot -> (its regions, their header encoding), made by the first commit of a layout
        self._encoded: dict[int, tuple[list[fmt.Region], str]] = {}
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="dcp-tiered-memory", initializer=lower_this_thread
        )
        self._pending: Future[dict[str, float]] | None = None
        # the other slot being made ahead on the background thread (see _made_ahead)
        self._reserved: tuple[int, Future[Any]] | None = None
        self._next_slot: int | None = None
        self.last_copy_secs = 0.0
        self.last_bytes = 0
        # slot -> (its regions, the bytes of their tensors), made by its first save of a layout
        self._tensor_bytes_of: dict[int, tuple[list[fmt.Region], int]] = {}

    def __repr__(self) -> str:
        return f"MemoryTier({self.backend.root})"

    # ------------------------------------------------------------ saving

    def buffers_ready(self) -> bool:
        """Whether both slots are made (one made ahead counts: its memory is taken)."""
        if self._reserved is not None:
            self._take_reserved(self._reserved[0])
        return len(self._buffers) == SLOTS

    def save(
        self, step: str, state: dict[str, Any], *, let_go: Callable[[], None] | None = None
    ) -> Future[dict[str, float]]:
        """Copy ``state`` (already resolved: no Stateful objects) into a slot now; checksum
        and commit it in the background. The future gives the background timings.

        ``let_go``: called once the snapshot no longer needs the state but for its tensors'
        bytes (the manager's ``async_snapshots`` lets the caller go on then). One thread then
        copies, leaving training its core, and a tensor that changes meanwhile fails the save
        with StateChangedError, the slot left uncommitted."""
        layout.validate_step_name(step)
        self.wait()  # the other slot's commit: never leave both slots uncommitted
        if self.run_id is not None and not self._recorded:  # the directory is the run's
            refuse_links(self.backend)  # before the record: nothing written through one
            refuse_foreign(self.backend, self.run_id)
            ownership.record_local(LocalBackend(self.root), self.run_id)
            self._recorded = True
        started = time.perf_counter()
        slot = self._uncommit_a_slot()
        with self._torn_if_failed(slot):
            copied = self._copy_as_planned(slot, state, let_go)
            if copied is None:  # a new structure, or one the plan cannot hold
                copied = self._copy_new(slot, state, let_go)
        chunks, blob = copied
        sig, (regions, size, _, _) = self._buffers[slot]
        self.last_copy_secs = time.perf_counter() - started
        self.last_bytes = self._tensor_bytes(slot, regions)
        self._pending = self._pool.submit(self._commit, step, slot, regions, size, blob, chunks)
        other = 1 - slot  # not yet made for any layout: made ahead, after this commit
        if self._reserved is None and other not in self._buffers and not sig[0]:  # not GPU
            made = self._pool.submit(self._made_ahead, other, sig, regions, size)
            self._reserved = (other, made)
        return self._pending

    def _copy_as_planned(
        self, slot: int, state: dict[str, Any], let_go: Callable[[], None] | None
    ) -> tuple[list[Future[str]], bytes] | None:
        """Copy ``state`` into ``slot`` by the slot's plan: (chunk hashes, non-tensor values
        encoded). None, the slot's bytes undefined, where ``state`` no longer fits the plan."""
        plan = self._plans.get(slot)
        if plan is None:
            return None
        objects: dict[str, Any] = {}
        try:
            _, dsts, srcs, expected = batch_copy.pair_unchecked(
                state, plan.tree, on_value=objects.__setitem__, descriptions=plan.described
            )
            check = lambda: expected.check(0, len(srcs))
            blob = fmt.encode_objects(objects)  # before the caller may change them
            return self._copy(slot, plan, dsts, srcs, let_go, check), blob
        except batch_copy.Mismatch:
            return None

    def _copy_new(
        self, slot: int, state: dict[str, Any], let_go: Callable[[], None] | None
    ) -> tuple[list[Future[str]], bytes]:
        """Lay ``state`` out in ``slot`` (unless its structure is the slot's already), plan its
        copy and copy it."""
        objects, tensors = {}, []
        for path, leaf in fmt.leaves(state):
            if isinstance(leaf, torch.Tensor):
                tensors.append((path, leaf))
            else:
                objects[fmt.key(path)] = leaf
        on_gpu = any(t.is_cuda for _, t in tensors)
        sig = (on_gpu, tuple((path, t.dtype, t.shape) for path, t in tensors))
        regions, _, buffer, views = self._buffer(slot, sig, lambda: fmt.layout(tensors), pin=on_gpu)
        plan = self._plans[slot] = memory_copy.plan(
            state, regions, views, buffer, by_chunks=not on_gpu
        )
        blob = fmt.encode_objects(objects)
        return self._copy(slot, plan, views, [t for _, t in tensors], let_go), blob

    def _copy(
        self,
        slot: int,
        plan: memory_copy.CopyPlan | None,
        dsts: list[torch.Tensor],
        srcs: list[torch.Tensor],
        let_go: Callable[[], None] | None,
        check: Callable[[], None] | None = None,
    ) -> list[Future[str]]:
        """Copy ``srcs`` into ``slot``'s views ``dsts`` by chunks (``chunk_copy``, which checks
        each source as it copies it) where the plan allows, else tensor by tensor
        (``memory_copy``: tensors a memcpy cannot copy, or a structure the plan cannot hold),
        after ``check``; the chunk hashes. Raises Mismatch where a source does not fit.

        ``let_go``: every source checked first and its version counter and address read, the
        caller let go, then the copy by one thread; StateChangedError where a source changed
        (or was given other memory) meanwhile."""
        if let_go is None:
            return self._copy_bytes(slot, plan, dsts, srcs, check, beside_training=False)
        if check is not None:
            check()  # before the caller goes on: a source that does not fit is a new layout
        before = tensor_versions.read(srcs)
        let_go()
        where = f"memory-tier snapshot in slot {slot} of {self.backend.root}"
        try:
            chunks = self._copy_bytes(slot, plan, dsts, srcs, None, beside_training=True)
        except batch_copy.Mismatch as e:  # checked above: changed since
            raise StateChangedError(f"{where}: a tensor was replaced during the copy: {e}") from e
        tensor_versions.require_unchanged(srcs, before, self._names(slot, dsts), where)
        return chunks

    def _names(self, slot: int, dsts: list[torch.Tensor]) -> Callable[[int], str]:
        """Source number -> its key in the snapshot, by where its view lies in the slot."""
        regions, _, buffer, _ = self._buffers[slot][1]
        base, keys = buffer.data_ptr(), {r.offset: r.key for r in regions}
        return lambda i: keys.get(dsts[i].data_ptr() - base, f"tensor {i}")

    def _copy_bytes(
        self,
        slot: int,
        plan: memory_copy.CopyPlan | None,
        dsts: list[torch.Tensor],
        srcs: list[torch.Tensor],
        check: Callable[[], None] | None,
        *,
        beside_training: bool,
    ) -> list[Future[str]]:
        """The copy itself (``chunk_copy``'s ``beside_training``: on this thread only)."""
        _, size, buffer, _ = self._buffers[slot][1]
        if plan is not None and plan.chunks is not None:
            chunks = chunk_copy.copy_and_checksum(
                buffer, dsts, srcs, plan.chunks, beside_training=beside_training
            )
            if chunks is not None:
                return chunks
        if check is not None:
            check()
        steps = plan.batches if plan is not None else memory_copy.batches(dsts, buffer.data_ptr())
        return memory_copy.copy_and_checksum(buffer, size, dsts, srcs, steps, self._pool.submit)

    def _tensor_bytes(self, slot: int, regions: list[fmt.Region]) -> int:
        """The bytes of the tensors in ``regions`` (one sum per layout, not per save)."""
        cached = self._tensor_bytes_of.get(slot)
        if cached is None or cached[0] is not regions:
            cached = self._tensor_bytes_of[slot] = (regions, sum(r.nbytes for r in regions))
        return cached[1]

    @contextlib.contextmanager
    def _torn_if_failed(self, slot: int) -> Iterator[None]:
        """A write into ``slot`` (uncommitted) that fails leaves it torn: it is then the slot
        written next, so that the next write never uncommits the other one, which holds the
        newest snapshot, while this one holds none."""
        try:
            yield
        except BaseException:
            with self._lock:
                self._next_slot = slot
            raise

    def _uncommit_a_slot(self) -> int:
        """The slot to write next, its header removed first (the copy tears it)."""
        refuse_links(self.backend)
        with self._lock:
            if self._next_slot is None:  # a new process: keep the newest snapshot of the last
                committed = read_headers(self.backend)
                newest = max(committed, key=lambda s: committed[s].committed_at_ns, default=1)
                self._next_slot = 1 - newest
            slot = self._next_slot
            if slot == self._leased:
                # The older snapshot is being sent to a partner: overwrite the newer one
                # instead of waiting. The leased one stays committed, so a crash now still
                # leaves a whole snapshot.
                slot = 1 - slot
            self._next_slot = 1 - slot
            self.backend.remove_file(header_file(slot))
            return slot

    def _buffer(
        self,
        slot: int,
        sig: Any,
        make_layout: Callable[[], tuple[list[fmt.Region], int]],
        *,
        pin: bool = False,
    ) -> tuple[list[fmt.Region], int, torch.Tensor, list[torch.Tensor]]:
        """The slot's layout, buffer and one view per tensor, made once per state structure
        (``sig``): a snapshot every step then costs one copy per tensor and nothing else.
        ``pin``: a state on the GPU, whose copies need the mapping page-locked to run at the
        bus's speed (measured on an H200: 1 GiB in 0.7-1.4 s into the plain mapping)."""
        self._take_reserved(slot)
        cached = self._buffers.get(slot)
        if cached is None or cached[0] != sig:
            self._buffers.pop(slot, None)  # drop the old mapping before making the new one
            self._plans.pop(slot, None)  # its views are the old mapping's
            regions, size = make_layout()
            buffer = self.backend.map_file(data_file(slot), size)
            if pin:
                _torch_compat.pin_host_memory(buffer)
            self._buffers[slot] = (sig, (regions, size, buffer, fmt.views(buffer, regions)))
        return self._buffers[slot][1]

    def _made_ahead(self, slot: int, sig: Any, regions: list[fmt.Region], size: int) -> Any:
        """On the background thread, once a layout's first snapshot is queued for commit: the
        other slot made for it (``reserve``: only a slot with no file yet), so that the next
        snapshot does not pay for new memory within the caller's stall; None where not made.
        A state on the GPU gets none (its slots are page-locked by CUDA on the saving thread)."""
        buffer = reserve(self.backend, slot, size)
        return (
            None if buffer is None else (sig, (regions, size, buffer, fmt.views(buffer, regions)))
        )

    def _take_reserved(self, slot: int) -> None:
        """The other slot made ahead, if this is it (waiting for it to be made): installed
        here, by the saving thread, as the slot's buffer (its layout still to be matched)."""
        if self._reserved is None or self._reserved[0] != slot:
            return
        _, made = self._reserved
        self._reserved = None
        try:
            entry = made.result()
        except Exception as e:  # noqa: BLE001 - only a head start: the save makes its own
            logger.debug("memory tier: slot %d made ahead unusable: %s", slot, e)
            return
        if entry is not None and slot not in self._buffers:
            self._buffers[slot] = entry

    def _commit(
        self,
        step: str,
        slot: int,
        regions: list[fmt.Region],
        size: int,
        blob: bytes,
        chunks: list[Future[str]],
    ) -> dict[str, float]:
        with self._torn_if_failed(slot):
            return self._write_header(step, slot, regions, size, blob, chunks)

    def _write_header(
        self,
        step: str,
        slot: int,
        regions: list[fmt.Region],
        size: int,
        blob: bytes,
        chunks: list[Future[str]],
    ) -> dict[str, float]:
        started = time.perf_counter()
        header = fmt.encode_header(
            step=step,
            rank=self.rank,
            committed_at_ns=time.time_ns(),
            data_size=size,
            regions=regions,
            checksums=[],
            objects=blob,
            run_id=self.run_id,
            world_size=self.world_size,
            chunk_bytes=memory_chunks.CHUNK_BYTES,
            chunk_checksums=[c.result() for c in chunks],  # done: queued before this task
            encoded_regions=self._encoded_regions(slot, regions),
        )
        write_done = time.perf_counter()
        self.backend.replace_root_file(header_file(slot), header)
        logger.debug("memory tier: %s committed in slot %d of %s", step, slot, self.backend.root)
        return {"write_s": write_done - started, "commit_s": time.perf_counter() - write_done}

    def _encoded_regions(self, slot: int, regions: list[fmt.Region]) -> str:
        cached = self._encoded.get(slot)
        if cached is None or cached[0] is not regions:
            cached = self._encoded[slot] = (regions, fmt.encode_regions(regions))
        return cached[1]

    def wait(self) -> None:
        """Wait for the commit in flight; its error, if any, was reported by its future."""
        if self._pending is not None:
            wait([self._pending])  # without raising: the caller got this future and its error
            self._pending = None

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()
        self._reserved = None  # a slot made ahead: its mapping
        self._buffers.clear()
        self._plans.clear()  # their views hold the mappings too
