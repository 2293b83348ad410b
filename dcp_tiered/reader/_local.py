"""Local reads: each file of the step on this node's disk read in blocks of neighbouring items,
or a large tensor straight into its target, with the next read running ahead on a helper
thread; every item checked against its checksum, and fetched from the remote tier instead when
its local bytes fail."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from .. import reader_checks
from ..errors import IntegrityError, MissingShardError
from ..policy import integrity, read_blocks
from ..policy.manifest import ItemLocation
from ._deliver import Delivery
from ._remote import RemoteReads
from ._state import by_storage_index

logger = logging.getLogger("dcp_tiered.reader")  # the reader's one logger, whichever module

# Local reads: neighbouring items share one read of up to a block; a tensor of at least
# _IN_PLACE_MIN_BYTES is read alone, straight into its target where it can be. A cold read
# waits on the disk once per read: 2,000 tensors of 16 KiB-4 MiB (261 MiB) restored in
# 0.82-1.03 s with a threshold of 64 KiB (a read or three per tensor), 0.46-0.70 s with 4 MiB
# (a copy out of 8 MiB blocks; less CPU too), 0.53-0.75 s with 1 MiB; a cold read of the
# files 0.33-0.46 s (2026-11-28, a slow hour of this VM's disk).
_LOCAL_BLOCK_BYTES = 8 * 2**20
_LOCAL_GAP_BYTES = 64 * 2**10  # read across a gap this small rather than issue another read
_IN_PLACE_MIN_BYTES = 4 * 2**20
# A local copy that proved bad where the remote tier is configured but lacks the step: the
# local failure stands (proof the copy is bad), not the remote's "not committed".
_NO_REMOTE_COPY = " (and the remote tier has no committed copy of this step)"


# Stored tensor bytes, verified, into a target's memory (dst, src, nbytes): a whole read's
# one copy. ctypes' own, not a function around it: 20,000 calls a restore of small tensors.
_straight_copy = ctypes.memmove


def _address(block: memoryview) -> int:
    """The address of a read block's first byte (a view of one of our bytearrays)."""
    if not len(block):
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(block))


class LocalReads(Delivery, RemoteReads):
    """The step's bytes from this node's disk, delivered as they are checked (Delivery); an
    item whose local bytes fail is fetched from the remote instead (RemoteReads)."""

    def _valid_locally(self, name: str) -> bool:
        """Whether to read ``name`` from the local tier (present, with the manifest's size);
        False means the remote, and raises when there is none to fall back on."""
        can_fetch = self._remote is not None and self._manifest is not None
        here = bool(self._step and self._step.local) and self._tier.backend.is_regular_file(
            *self._dir, name
        )  # no links, FIFOs
        if here:
            size = self._tier.backend.file_size(*self._dir, name)
            expected = int(self._manifest.files[name]["size"]) if self._manifest else size
            if size == expected:
                return True
            problem = f"local copy has {size} bytes, manifest says {expected}"
            if not (can_fetch and self._remote_holds_step()):
                raise IntegrityError.proof(
                    f"corrupt data in step {self.checkpoint_id!r}: file {name!r} in {self.root}: "
                    f"{problem}{_NO_REMOTE_COPY if can_fetch else ''}. Restore it from another "
                    "tier or load an earlier step."
                )
            logger.warning(
                "%s of step %s: %s; reading it from %s",
                name,
                self.checkpoint_id,
                problem,
                self._remote.config.url if self._remote else "",
            )
        elif not (can_fetch and self._remote_holds_step()):
            raise MissingShardError(
                f"data file {name!r} of step {self.checkpoint_id!r} is missing (or not a "
                f"plain file: links, FIFOs and devices are never read) from "
                f"{os.path.join(self.root, *self._dir)} and no remote tier holds the step; "
                "restore it from another tier or load an earlier step"
            )
        return False

    def _load_local(self, files: list[tuple[str, list[ReadItem]]], planner: LoadPlanner) -> None:
        """Loads items from the local tier, verifying each against its checksum.

        Neighbouring items are read together, one read per block of up to
        ``_LOCAL_BLOCK_BYTES``, and each is checked and delivered from the block: a state of
        many small tensors costs a few reads, not one (or a thread hand-off) per item. A helper
        thread reads the next block (across file boundaries) while this one is checksummed and
        delivered; both release the GIL. A large tensor whose raw bytes the manifest locates,
        and whose target is a plain CPU tensor of the stored shape, is read on its own straight
        into the target (no staging buffer, no copy). Blocks use one of two reused buffers.
        """
        self._run_reads(self._plan_reads(files), planner)

    def _run_reads(self, reads: list[Read], planner: LoadPlanner) -> None:
        """Reads ``reads`` in order, the next on a helper thread while this one is checked
        and delivered (see :meth:`_load_local`)."""
        if not reads:
            return
        opened: dict[str, Any] = {}
        backend = self._tier.backend
        # The pool is left first, so a read still in flight finishes before any file closes.
        with (
            contextlib.ExitStack() as open_files,
            ThreadPoolExecutor(1, thread_name_prefix="dcp-tiered-read") as pool,
        ):

            def opened_file(name: str) -> Any:
                if name not in opened:
                    opened[name] = open_files.enter_context(backend.open_read(*self._dir, name))
                return opened[name]

            def read(n: int) -> list[memoryview]:  # runs on the helper thread only
                r = reads[n]
                if r.direct:
                    parts = self._direct_parts(r.groups[0][1], r.target)
                else:
                    parts = [self._read_buffer(n % 2, r.end - r.start)]
                offset, filled = r.start, []
                for part in parts:
                    got = backend.read_range_into(opened_file(r.name), offset, part)
                    filled.append(got)
                    offset += len(got)
                    if len(got) < len(part):
                        break
                if r.expected_crc >= 0 and offset == r.end:  # one CRC for the block, here
                    r.crc = integrity.checksum(filled[0])
                return filled

            # whole reads into plain CPU targets: stored bytes copied straight in (a planner
            # that does not vouch for its targets gets every item through _deliver)
            whole = None if self._descriptors else _WholeReads.of(planner)
            self._resolve_direct(reads[0], planner)
            pending = pool.submit(read, 0)
            for n, r in enumerate(reads):
                parts = pending.result()
                if n + 1 < len(reads):
                    self._resolve_direct(reads[n + 1], planner)
                    pending = pool.submit(read, n + 1)
                if r.direct:
                    index, loc, group = r.groups[0]
                    parts = self._verified(r.name, index, parts, loc)
                    if len(parts) == 3:  # still the target's own memory: nothing to copy
                        assert r.target is not None  # direct: _resolve_direct set it
                        if not reader_checks.storage_tail_ok(parts[2], r.target.nbytes):
                            reader_checks.check_storage_tail(
                                parts[2], r.target.nbytes, self._what(index)
                            )
                        planner.commit_tensor(group[0], r.target)
                        continue
                    self._deliver(group[0], parts[0], planner, r.target)
                    continue
                block = parts[0] if parts else memoryview(b"")
                if r.columns is not None:
                    r.columns.deliver(r, block, planner)
                else:
                    self._deliver_block(r, block, planner, whole)

    def _deliver_block(
        self, r: Read, block: memoryview, planner: LoadPlanner, whole: _WholeReads | None
    ) -> None:
        """Checks and delivers the items of block read ``r``. The loop of a restore of
        20,000 small tensors: a whole read into a target the planner vouches for costs a
        checksum, a look at the archive's storage record and one memmove, every name bound
        once (see ``_copy_stored`` for what is checked); anything else goes through
        ``_deliver``."""
        targets = whole.targets if whole is not None else {}
        base = _address(block) if targets else 0
        crc, tail_at, copy = integrity.checksum, reader_checks.storage_tail_at, _straight_copy
        tensor_type, start = LoadItemType.TENSOR, r.start
        for index, loc, group in r.groups:
            lo, length, expected = loc.offset - start, loc.length, loc.checksum
            data = block[lo : lo + length]
            if len(data) != length or (expected and f"{crc(data):08x}" != expected):
                (data,) = self._verified(r.name, index, [data], loc)  # remote, or raise
            raw = loc.raw_offset  # None: an empty tensor
            for item in group:
                target = targets.get(index.fqn) if item.type is tensor_type else None
                if target is None or raw is None or data.obj is not block.obj:  # remote bytes
                    self._deliver(item, data, planner, r.target)
                    continue
                nbytes = target.nbytes
                if raw + nbytes > length or not tail_at(
                    block, lo + raw + nbytes, lo + length, nbytes
                ):
                    self._copy_stored(index, loc, data, base + lo, target)  # names what is wrong
                elif nbytes:
                    copy(target.data_ptr(), base + lo + raw, nbytes)
                if whole is not None and whole.commits:
                    planner.commit_tensor(item, target.detach())

    def _copy_stored(
        self, index: MetadataIndex, loc: ItemLocation, data: memoryview, at: int, target: Any
    ) -> None:
        """Copy a whole item's stored tensor bytes (``data``, verified, at address ``at``)
        into ``target``, which the planner vouches is a contiguous CPU tensor of the saved
        dtype and size: one memmove, no tensor views, no alignment to mind. The bytes are
        checked to be the archive's storage of exactly that many bytes first."""
        nbytes = target.nbytes
        raw = loc.raw_offset
        assert raw is not None  # the caller's check
        if raw + nbytes > len(data):
            raise IntegrityError(
                f"{self._what(index)}: the manifest places {nbytes} bytes past the end of the "
                f"item's {len(data)} bytes; the manifest does not match the data. Restore the "
                "step from another tier."
            )
        if not reader_checks.raw_storage_ok(data, raw, nbytes):  # names it only if not
            reader_checks.check_raw_storage(data, raw, nbytes, self._what(index))
        if nbytes:
            _straight_copy(target.data_ptr(), at + raw, nbytes)

    def _verified(
        self, name: str, index: MetadataIndex, parts: list[memoryview], loc: ItemLocation
    ) -> list[memoryview]:
        """The item's local bytes (``parts``) if they match the manifest (its location
        ``loc``); else, with a remote tier, its remote bytes (as one part) if those do; else
        IntegrityError."""
        problem = self._problem(loc, parts)
        if problem and self._remote is not None and self._manifest is not None:
            if not self._remote_holds_step():
                raise self._integrity_error(name, index.fqn, loc, problem + _NO_REMOTE_COPY)
            logger.warning(
                "local copy of %s in step %s is corrupt (%s, item %s); reading it from %s",
                name,
                self.checkpoint_id,
                problem,
                index.fqn,
                self._remote.config.url,
            )
            parts = [memoryview(self._fetch(name, loc.offset, loc.offset + loc.length))]
            problem = self._problem(loc, parts)
        if problem:
            raise self._integrity_error(name, index.fqn, loc, problem)
        return parts

    def _plan_reads(self, files: list[tuple[str, list[ReadItem]]]) -> list[Read]:
        """The local reads for ``files`` (items sorted by offset): each large tensor that may
        be read in place on its own, every other run of neighbouring items in blocks."""
        reads: list[Read] = []
        for name, items in files:
            block: Read | None = None
            for index, group in by_storage_index(items):
                loc = self._locations[index]
                start, end = loc.offset, loc.offset + loc.length
                if self._may_read_in_place(index, loc, group):
                    reads.append(Read(name, start, end, [(index, loc, group)], in_place=True))
                    block = None
                elif (
                    block is not None
                    and block.end <= start <= block.end + _LOCAL_GAP_BYTES
                    and end - block.start <= _LOCAL_BLOCK_BYTES
                ):
                    block.end = end
                    block.groups.append((index, loc, group))
                else:
                    block = Read(name, start, end, [(index, loc, group)])
                    reads.append(block)
        return reads

    def _may_read_in_place(
        self, index: MetadataIndex, loc: ItemLocation, group: list[ReadItem]
    ) -> bool:
        """Whether the saved item is a large tensor wanted whole (its target not yet known)."""
        # the item's bytes hold the tensor's: a shorter item holds no large tensor
        if loc.raw_offset is None or loc.length < _IN_PLACE_MIN_BYTES or len(group) != 1:
            return False
        chunk = self._chunk(index)
        if chunk is None:
            return False
        item = group[0]
        sizes, dtype = chunk
        return (
            item.type == LoadItemType.TENSOR
            and not any(item.storage_offsets)
            and tuple(item.lengths) == tuple(sizes)  # not part of the chunk (resharding)
            and math.prod(sizes) * dtype.itemsize >= _IN_PLACE_MIN_BYTES
        )

    def _resolve_direct(self, r: Read, planner: LoadPlanner) -> None:
        """Sets ``r.target`` for a large tensor, and ``r.direct`` when it can be read straight
        into that target."""
        if not r.in_place:
            return
        index, loc, (item,) = r.groups[0]
        chunk = self._chunk(index)
        assert chunk is not None  # in_place: _may_read_in_place found it
        sizes, dtype = chunk
        target = planner.resolve_tensor(item).detach()
        r.target = target
        r.direct = (
            type(target) is torch.Tensor
            and target.device.type == "cpu"
            and target.dtype == dtype
            and target.size() == sizes
            and target.is_contiguous()
            and target.layout == torch.strided
            and loc.raw_offset is not None
            and loc.raw_offset + target.nbytes <= loc.length
        )

    @staticmethod
    def _direct_parts(loc: ItemLocation, target: torch.Tensor | None) -> list[memoryview]:
        """The item's bytes as [framing before, the target's own memory, framing after]."""
        assert loc.raw_offset is not None and target is not None
        body = memoryview((ctypes.c_char * target.nbytes).from_address(target.data_ptr())).cast("B")
        tail = loc.length - loc.raw_offset - target.nbytes
        return [memoryview(bytearray(loc.raw_offset)), body, memoryview(bytearray(tail))]

    def _read_buffer(self, which: int, length: int) -> memoryview:
        if len(self._read_buffers[which]) < length:
            self._read_buffers[which] = bytearray(length)
        return memoryview(self._read_buffers[which])[:length]


class ColumnDelivery(Protocol):
    """Delivers a block read of whole reads by columns (reader._columns.ColumnBatch)."""

    def deliver(self, r: Read, block: memoryview, planner: LoadPlanner) -> None: ...


@dataclass
class _WholeReads:
    """What a planner vouches for its whole reads (TieredLoadPlanner.whole_targets): each
    fqn's target that stored bytes may be copied into as they are, and whether its own
    commit_tensor must see each one (DCP's is a no-op)."""

    targets: dict[str, torch.Tensor]
    commits: bool

    @classmethod
    def of(cls, planner: LoadPlanner) -> _WholeReads | None:
        found = getattr(planner, "whole_targets", None)
        targets = found() if found is not None else None
        if not targets:
            return None
        return cls(targets, type(planner).commit_tensor is not DefaultLoadPlanner.commit_tensor)


@dataclass
class Read:
    """One local read: a byte range of one file and the saved items in it (each with its
    location and the read items it serves)."""

    name: str
    start: int
    end: int
    groups: list[tuple[MetadataIndex, ItemLocation, list[ReadItem]]]
    in_place: bool = False  # a single large tensor, resolved ahead of its read
    target: torch.Tensor | None = None
    direct: bool = False  # the read goes straight into ``target``
    # whole reads by columns: ``columns`` delivers the block, whose items are ``rows``
    # (reader._columns), and ``groups`` is empty
    columns: ColumnDelivery | None = None
    rows: read_blocks.BlockRows | None = None
    # a column read's bytes as a whole: the CRC32C its items' CRCs combine to (-1: none,
    # its items are checked one by one), and the one the read thread found (-1: not taken)
    expected_crc: int = -1
    crc: int = -1
