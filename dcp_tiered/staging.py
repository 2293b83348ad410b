"""Double-buffered staging of a state dict into reused host buffers.

``dcp.async_save`` calls ``stage()`` on the caller's thread; that copy is the caller's whole
stall. Two buffer sets alternate, so staging save N+1 never touches the buffers save N is still
writing from. A buffer set is handed out again only once the background work of the save that
used it has ended: DCP gives a writer no completion hook, so the executor thread that
``async_save`` starts for each save (it lives exactly as long as that save) is tracked instead.
The same tracking orders the background saves, so their collectives run one save at a time and
in the same order on every rank.
"""

from __future__ import annotations

import copy
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import _torch_compat, batch_copy, tensor_versions
from ._torch_compat import ShardedTensor
from .errors import StagingError, StateChangedError
from .host_copy import PLAIN_TENSORS

logger = logging.getLogger(__name__)

# ThreadPoolExecutor workers started by DCP's THREAD and PROCESS async executors.
_THREAD_EXECUTOR = "AsyncCheckpointExecutor"
_PROCESS_EXECUTOR = "ThreadPoolExecutor"
_POOL_THREAD = re.compile(r"^ThreadPoolExecutor-(\d+)_\d+$")


def _signature(obj: Any) -> Any:
    """Structure, shapes and dtypes of a state dict: buffers are reused only if it matches.
    Computed on every save, so plain tensors (nearly every leaf) are tested first."""
    if type(obj) in PLAIN_TENSORS:
        return ("T", obj.shape, obj.dtype)
    if type(obj) in batch_copy.DICTS:
        return tuple([(k, _signature(v)) for k, v in obj.items()])
    if isinstance(obj, DTensor):
        return ("D", tuple(obj.shape), obj.dtype, tuple(obj.to_local().shape), obj.placements)
    if isinstance(obj, ShardedTensor):
        shards = tuple((tuple(s.tensor.shape), s.tensor.dtype) for s in obj.local_shards())
        return ("S", tuple(obj.size()), shards)
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_signature(v) for v in obj))
    return None  # non-tensor values are deep-copied, never buffered


def state_bytes(obj: Any) -> int:
    """Bytes of this rank's tensors in a state dict (local shards of distributed tensors)."""
    if isinstance(obj, DTensor):
        return state_bytes(obj.to_local())
    if isinstance(obj, ShardedTensor):
        return sum(state_bytes(s.tensor) for s in obj.local_shards())
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


@dataclass
class _Slot:
    signature: Any = None
    buffers: dict[str, Any] | None = None
    nbytes: int = 0
    seq: int = 0
    threads: list[threading.Thread] = field(default_factory=list)
    batched: bool = False  # the buffers' structure is one batch_copy copies into
    # batch_copy's descriptions of these buffers: replaced with them, so they hold no old ones
    described: batch_copy.Descriptions = field(default_factory=batch_copy.new_descriptions)


def _values_taken(obj: Any) -> Any:
    """``obj``'s structure with its tensors as they are and every other mutable value
    deep-copied (as staging copies them): what a copy beside training reads of the caller's
    state later is its tensors' bytes only."""
    if isinstance(obj, torch.Tensor) or type(obj) in batch_copy.SIMPLE:
        return obj
    if type(obj) in batch_copy.DICTS:
        return type(obj)((k, _values_taken(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_values_taken(v) for v in obj)
    return copy.deepcopy(obj)  # a ShardedTensor is a Tensor; anything else is a value


def _copy_batched(state_dict: dict[str, Any], slot: _Slot, cuda: bool) -> Any:
    """``state_dict`` copied into the slot's buffers in one batched copy, or None (nothing
    copied) where it does not fit them or holds distributed tensors (DCP's helpers copy
    those)."""
    try:
        return batch_copy.copy_into(
            state_dict, slot.buffers, non_blocking=cuda, descriptions=slot.described
        )
    except batch_copy.Mismatch:
        return None


def _executor_thread(candidates: list[threading.Thread]) -> list[threading.Thread]:
    """The one thread async_save just started for this save (or none).

    THREAD mode names its worker "AsyncCheckpointExecutor_0"; PROCESS mode uses a plain
    ThreadPoolExecutor, created just before it submits, so its pool number is the highest
    among threads that appeared meanwhile.
    """
    named = [t for t in candidates if t.name.startswith(_THREAD_EXECUTOR)]
    if named:
        return named[-1:]
    pools = [m for t in candidates if (m := _POOL_THREAD.match(t.name))]
    if not pools:
        return []
    newest = max(pools, key=lambda m: int(m.group(1)))
    return [t for t in candidates if t.name == newest.string]


class DoubleBufferStager:
    """Copies state dicts into two alternating, reused sets of CPU buffers."""

    def __init__(self, *, share_memory: bool, timeout_secs: float) -> None:
        self._share_memory = share_memory
        self._timeout_secs = timeout_secs
        self._slots = [_Slot(), _Slot()]
        self._next = 0
        self._seq = 0
        self._lock = threading.Lock()
        self._pending: tuple[_Slot, set[threading.Thread]] | None = None
        self.last_stall_secs = 0.0
        self.last_staged_bytes = 0
        self.last_change: StateChangedError | None = None  # see stage(beside=)

    def buffers_ready(self) -> int:
        """How many buffer sets are allocated for the last staged structure (0 to 2)."""
        last = self._slots[1 - self._next].signature
        return sum(s.buffers is not None and s.signature == last for s in self._slots)

    # ------------------------------------------------------------ staging

    def stage(
        self, state_dict: dict[str, Any], beside: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """``state_dict`` copied into the next buffer set. ``beside``: called once the
        non-tensor values are copied and the tensors' version counters read, so that the
        caller goes on during the copy (buffers for a new structure made in it too); ``last_change`` then says whether a tensor changed meanwhile."""
        start = time.perf_counter()
        slot = self._slots[self._next]
        self._wait_for(slot.threads, what="the save that used this staging buffer")
        # DCP's PROCESS executor sends every save down one pipe without a lock, so two in
        # flight could swap their replies: in that mode saves do not overlap at all.
        in_process_mode = [
            t for s in self._slots for t in s.threads if t.name.startswith(_PROCESS_EXECUTOR)
        ]
        self._wait_for(in_process_mode, what="the previous PROCESS-mode async save")
        self.last_change = None
        if beside is None:
            staged = self._copy(state_dict, slot)
        else:
            # before the caller goes on: the non-tensor values, which the loop may change in
            # place next (buffers made for a new structure read no tensor's bytes: after)
            state_dict = _values_taken(state_dict)
            named = list(tensor_versions.leaves(state_dict))
            tensors = [t for _, t in named]
            before = tensor_versions.read(tensors)
            beside()
            staged = self._copy(state_dict, slot)
            try:
                tensor_versions.require_unchanged(
                    tensors, before, lambda i: named[i][0], "staging copy", "disk save"
                )
            except StateChangedError as e:
                self.last_change = e
        self.last_staged_bytes = slot.nbytes
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        with self._lock:
            self._seq += 1
            slot.seq = self._seq
            slot.threads = []
            self._pending = (slot, set(threading.enumerate()))
        logger.debug("staged into buffer set %d in %.3f s", self._next, time.perf_counter() - start)
        self._next = 1 - self._next
        self.last_stall_secs = time.perf_counter() - start
        return staged

    def _copy(self, state_dict: dict[str, Any], slot: _Slot) -> dict[str, Any]:
        cuda = torch.cuda.is_available()
        staged = None
        if slot.buffers is not None and slot.batched:  # the same structure as last time?
            staged = _copy_batched(state_dict, slot, cuda)
        if staged is None:
            signature = _signature(state_dict)
            if slot.buffers is None or signature != slot.signature:
                slot.buffers = _torch_compat.create_cpu_state_dict(
                    state_dict, pin_memory=cuda, share_memory=self._share_memory
                )
                slot.signature = signature
                slot.nbytes = state_bytes(state_dict)
                slot.described = batch_copy.new_descriptions()
            staged = _copy_batched(state_dict, slot, cuda)
            slot.batched = staged is not None
        if staged is None:
            assert slot.buffers is not None  # allocated above
            # type_check=False: non-tensor values are deep-copied, so later mutation by the
            # trainer cannot leak into the checkpoint.
            staged = _torch_compat.copy_state_dict(
                state_dict, slot.buffers, non_blocking=cuda, type_check=False
            )
        return staged

    def after_execute(self) -> None:
        """Called by async_save right after it started the save's executor thread."""
        with self._lock:
            if self._pending is None:
                return
            slot, before = self._pending
            self._pending = None
            new = [t for t in threading.enumerate() if t not in before]
            slot.threads = _executor_thread(new)
            if not slot.threads:
                # Not DCP's executor as we know it (another torch?): we cannot tell when this
                # save is done, so its buffers are never handed out again. The in-flight save
                # keeps them alive; the next stage into this slot allocates fresh ones.
                logger.warning(
                    "cannot track this async save's thread; staging buffers will "
                    "not be reused for it"
                )
                slot.buffers, slot.signature = None, None
                slot.described = batch_copy.new_descriptions()

    # ------------------------------------------------------------ ordering

    def wait_for_earlier_saves(self) -> None:
        """Block until every background save staged before the current one has ended.

        Called at the start of each save's background work (and of synchronous saves), before
        DCP issues any collective, so saves never overlap on the process group.
        """
        me = threading.current_thread()
        with self._lock:
            mine = next((s.seq for s in self._slots if me in s.threads), None)
            earlier = [
                t
                for s in self._slots
                if mine is None or s.seq < mine
                for t in s.threads
                if t is not me
            ]
        self._wait_for(earlier, what="an earlier async save")

    def wait_for_saves(self) -> None:
        """Block until every background save staged here has ended (from any thread but a
        save's own)."""
        me = threading.current_thread()
        with self._lock:
            threads = [t for s in self._slots for t in s.threads if t is not me]
        self._wait_for(threads, what="an async save")

    def _wait_for(self, threads: list[threading.Thread], *, what: str) -> None:
        deadline = time.monotonic() + self._timeout_secs
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise StagingError(
                    f"{what} is still running after {self._timeout_secs:.0f} s "
                    f"(thread {t.name}); wait for the previous async_save future before "
                    "saving again, or raise staging_timeout_secs"
                )

    def close(self) -> None:
        self.wait_for_saves()
        self._slots = [_Slot(), _Slot()]
