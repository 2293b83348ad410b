"""One data file of a step: its items framed, checksummed and written in a few ``writev`` calls.

Each tensor item is a torch.save archive built from a template (:mod:`dcp_tiered.item_frame`):
its head and tail go into a small buffer shared with neighbouring items, and the tensor's own
memory goes to the kernel between them, with no copy unless it is small. Buffers are collected
and written a batch at a time, so a state of many small tensors costs a few system calls and
a few Python calls per item, not torch.save's 39 stream writes. Every byte is CRC32C-checked
in the same pass: each item's checksum for the manifest, and the file's. A tensor that cannot
be framed (an unusual dtype or class, over 4 GiB, a torch whose writer does not match the
templates) is written by torch's own writer in place, as before.
"""

from __future__ import annotations

import ctypes
import io
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from . import _torch_compat
from .backends.local import LocalBackend
from .host_copy import PLAIN_TENSORS
from .item_frame import FRAMER
from .policy import integrity
from .policy.item_keys import ItemKeys
from .policy.manifest_types import ItemLocation

# A tensor smaller than this is copied into the shared buffer (one buffer for many items);
# a larger one is written from its own memory.
COPY_BELOW_BYTES = 16 * 2**10
# From this size one CRC pass, folded into both checksums, costs less than a second pass.
COMBINE_BYTES = 2**20
# Written once this much is pending. item_layout checksums each batch's tensors right after
# the write, which has just read them: a batch that fits the core's cache (2 MiB here) is
# still in it, a larger one comes back from memory. 32 MiB -> 2 MiB, time to committed (medians of
# 12-16 alternating saves, fsync included): 2,000 tensors 226 -> 168 ms, 20,000 tensors 417 ->
# 371 ms, 32 x 32 MiB unchanged (869 / 859 ms).
_BATCH_BYTES = 2 * 2**20
_BATCH_BUFFERS = 1024  # or this many buffers (IOV_MAX)


@dataclass(frozen=True, slots=True)
class ItemKey:
    """An item's MetadataIndex as the coordinator needs it (fqn, chunk offset, index)."""

    fqn: str
    offset: tuple[int, ...] | None
    index: int | None


@dataclass(frozen=True, slots=True)
class Written:
    """A data file as written: its size and CRC32C, and its items' columns (see FileItems)."""

    position: int
    file_crc: int
    keys: ItemKeys
    offsets: list[int]
    lengths: list[int]
    checksums: str  # 8 hex digits per item
    raw_offsets: list[int | None]


@dataclass(frozen=True)
class FileItems:
    """Where every item of one data file landed, as one WriteResult's ``storage_data``.

    DCP gathers every rank's write results to the coordinator by pickling them: with one
    WriteResult per item, unpickling them there cost more than writing the items did (20,000
    tensors: 1.4 s against 0.9 s). Columns of plain values unpickle in milliseconds."""

    name: str
    rank: int
    file_size: int
    file_checksum: str
    keys: ItemKeys
    offsets: list[int]
    lengths: list[int]
    checksums: str  # 8 hex digits per item
    raw_offsets: list[int | None]

    def locations(self) -> Iterator[tuple[ItemKey, ItemLocation]]:
        """(key, location) of each item."""
        for k, (key, offset, length, raw) in enumerate(
            zip(self.keys, self.offsets, self.lengths, self.raw_offsets)
        ):
            yield (
                ItemKey(*key),
                ItemLocation(
                    self.name,
                    offset,
                    length,
                    self.checksums[8 * k : 8 * k + 8],
                    self.rank,
                    self.file_size,
                    self.file_checksum,
                    raw,
                ),
            )

    @classmethod
    def of(cls, name: str, rank: int, out: Written) -> FileItems:
        return cls(
            name=name,
            rank=rank,
            file_size=out.position,
            file_checksum=integrity.format_checksum(out.file_crc),
            keys=out.keys,
            offsets=out.offsets,
            lengths=out.lengths,
            checksums=out.checksums,
            raw_offsets=out.raw_offsets,
        )


@dataclass(frozen=True, slots=True)
class Placed:
    """Where one item landed in the file, and its checksum."""

    key: MetadataIndex
    offset: int
    length: int
    crc: int
    raw_offset: int | None  # of the tensor's bytes, from the item's start


class DataFile:
    """Writes items one after another into ``f`` (opened by ``LocalBackend.open_write``)."""

    def __init__(self, f: BinaryIO, *, writeback: bool = False) -> None:
        self._f = f
        self._writeback = writeback  # start each batch's way to the disk once it is written
        self._written = 0  # bytes written to the file so far
        self.position = 0  # bytes added so far
        self.file_crc = 0  # CRC32C of the bytes sealed so far (all of them after close)
        self._small = bytearray()  # bytes not yet sealed into a batch buffer
        self._batch: list[memoryview] = []
        self._batch_bytes = 0
        self._keep: list[Any] = []  # what the batch's buffers point into, until written
        self.placed: list[Placed] = []

    # ------------------------------------------------------------ items

    def add(self, item: WriteItem, data: Any) -> None:
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO)  # as DCP's FileSystemWriter asserts
            self._add_bytes(item.index, data.getbuffer())
            return
        assert isinstance(data, torch.Tensor)
        tensor = as_saveable(data)
        frame = FRAMER.frame(tensor)
        if frame is None:
            self._add_serialised(item.index, tensor)
            return
        start, nbytes = self.position, tensor.numel() * tensor.element_size()
        if nbytes < COPY_BELOW_BYTES:
            at = len(self._small)
            self._small += frame.head
            if nbytes:  # read by address: a numpy view of a small tensor costs 4x as much
                self._small += ctypes.string_at(tensor.data_ptr(), nbytes)
            self._small += frame.tail
            crc = integrity.checksum(memoryview(self._small)[at:])
        else:
            crc = integrity.checksum(frame.head)
            self._small += frame.head
            crc = self._add_large(memory_of(tensor, nbytes), tensor, crc)
            self._small += frame.tail
            crc = integrity.checksum(frame.tail, crc)
        length = len(frame.head) + nbytes + len(frame.tail)
        self.position += length
        raw_offset = len(frame.head) if nbytes else None  # an empty tensor needs no view
        self.placed.append(Placed(item.index, start, length, crc, raw_offset))

    def _add_bytes(self, index: MetadataIndex, view: memoryview) -> None:
        view = view.cast("B")
        start = self.position
        if len(view) < COPY_BELOW_BYTES:
            crc = integrity.checksum(view)
            self._small += view
        else:
            crc = self._add_large(view, view.obj, 0)
        self.position += len(view)
        self.placed.append(Placed(index, start, len(view), crc, None))

    def _add_large(self, view: memoryview, owner: Any, item_crc: int) -> int:
        """Queue ``view`` (kept alive by ``owner``) as a buffer of its own; returns the item's
        CRC continued over it. The file's CRC follows in the same pass where that is cheaper."""
        self._seal()
        n = len(view)
        if n >= COMBINE_BYTES:
            own = integrity.checksum(view)
            self.file_crc = integrity.combine(self.file_crc, own, n)
            item_crc = integrity.combine(item_crc, own, n)
        else:
            self.file_crc = integrity.checksum(view, self.file_crc)
            item_crc = integrity.checksum(view, item_crc)
        self._queue(view, owner)
        return item_crc

    def _add_serialised(self, index: MetadataIndex, tensor: torch.Tensor) -> None:
        """torch's own writer, streamed to the file (a large tensor is never held twice)."""
        self._seal()
        self._write_batch()
        out = integrity.ChecksummingWriter(cast(BinaryIO, _Passthrough(self._f)))
        nbytes = tensor.numel() * tensor.element_size()
        out.start_item(nbytes)
        try:
            _torch_compat.save_tensor(tensor, out)
        except RuntimeError as e:
            if out.error is not None:
                raise out.error from e
            raise
        raw_offset = out.raw_offset(0, nbytes, tensor)
        crc = out.item_crc
        out.close()
        self.file_crc = integrity.combine(self.file_crc, crc, out.position)
        self.placed.append(Placed(index, self.position, out.position, crc, raw_offset))
        self.position += out.position
        self._wrote(out.position)

    # ------------------------------------------------------------ batching

    def _seal(self) -> None:
        """Close the shared buffer into the batch (its CRC folded into the file's)."""
        if self._small:
            self.file_crc = integrity.checksum(self._small, self.file_crc)
            self._queue(memoryview(self._small), None)
            self._small = bytearray()

    def _queue(self, view: memoryview, owner: Any) -> None:
        self._batch.append(view)
        if owner is not None:
            self._keep.append(owner)
        self._batch_bytes += len(view)
        if self._batch_bytes >= _BATCH_BYTES or len(self._batch) >= _BATCH_BUFFERS:
            self._write_batch()

    def _write_batch(self) -> None:
        if self._batch:
            LocalBackend.write_vectors(self._f, self._batch)
            self._wrote(self._batch_bytes)
        self._batch, self._keep, self._batch_bytes = [], [], 0

    def _wrote(self, nbytes: int) -> None:
        """``nbytes`` more of the file are written: start them to the disk if asked to."""
        if self._writeback:
            LocalBackend.start_writeback(self._f, self._written, nbytes)
        self._written += nbytes

    def close(self) -> None:
        """Write what is pending; ``file_crc`` and ``position`` then cover the whole file."""
        self._seal()
        self._write_batch()

    def written(self) -> Written:
        """The file as written (after :meth:`close`)."""
        return Written(
            position=self.position,
            file_crc=self.file_crc,
            keys=ItemKeys(
                (p.key.fqn, None if p.key.offset is None else tuple(p.key.offset), p.key.index)
                for p in self.placed
            ),
            offsets=[p.offset for p in self.placed],
            lengths=[p.length for p in self.placed],
            checksums="".join(integrity.format_checksum(p.crc) for p in self.placed),
            raw_offsets=[p.raw_offset for p in self.placed],
        )


class _Passthrough:
    """What torch's writer streams to, for a tensor it serialises: straight to the file."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f

    def write(self, data: memoryview) -> int:
        LocalBackend.write_vectors(self._f, [memoryview(data).cast("B")])
        return len(data)


def write_items(
    f: BinaryIO, items: Sequence[WriteItem], data: Sequence[Any], *, writeback: bool = False
) -> DataFile:
    """Write ``items`` (``data``: each one's, from DCP's ``planner.resolve_data``) into ``f``;
    ``writeback``: for a file fsynced at its end, start each batch's writing to the disk at
    once (``LocalBackend.start_writeback``)."""
    out = DataFile(f, writeback=writeback)
    for item, value in zip(items, data):
        out.add(item, value)
    out.close()
    return out


def as_saveable(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor whose storage holds only its own bytes, its values in them:
    torch.save writes whole storages, and a row-major layout lets the reader view the raw
    bytes in place. A lazy conjugate or negation is applied first: the bytes of such a view
    are not its values, and a reader of the raw bytes would restore them unconjugated."""
    if type(tensor) is not torch.Tensor or tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def memory_of(tensor: torch.Tensor, nbytes: int) -> memoryview:
    """The tensor's bytes, in place (CPU, contiguous). Through numpy rather than a ctypes
    array: each new ctypes length makes a new type, which a state of many sizes pays for in
    garbage collection."""
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    assert len(view) == nbytes
    return view


# A read-only memoryview of memory that the caller keeps alive (PyBUF_READ): no numpy array,
# no tensor view and no new type per call (``memory_of`` costs 4x as much per tensor)
_view_of_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_view_of_memory.restype = ctypes.py_object
_view_of_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PY_BUF_READ = 0x100


def raw_views(tensors: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[memoryview | None]:
    """Each tensor's ``sizes[k]`` bytes in place, where they are its values in row-major
    order (a plain CPU tensor, contiguous, no lazy conjugate or negation): what
    ``memory_of(as_saveable(t))`` gives, checked a whole list at a time. None for any other
    tensor (``as_saveable`` makes it one). The views keep nothing alive: the caller holds
    the tensors' storages while it uses them."""
    in_place = map(
        _in_place,
        map(type, tensors),
        map(torch.Tensor.is_contiguous, tensors),
        map(torch.Tensor.is_conj, tensors),
        map(torch.Tensor.is_neg, tensors),
        map(_is_cpu, tensors),
        map(_nbytes, tensors),
        sizes,
    )
    return [
        _view_of_memory(t.data_ptr(), n, _PY_BUF_READ) if ok else None
        for t, n, ok in zip(tensors, sizes, in_place)
    ]


def _in_place(
    kind: type, contiguous: bool, conj: bool, neg: bool, cpu: bool, nbytes: int, size: int
) -> bool:
    # nbytes == size: never a view past the tensor's own bytes, whatever the caller expected
    return (
        kind in PLAIN_TENSORS and contiguous and not conj and not neg and cpu and nbytes == size > 0
    )


_is_cpu = operator.attrgetter("is_cpu")
_nbytes = operator.attrgetter("nbytes")


def split_by_size(
    items: Sequence[WriteItem], n: int, planned_bytes: Callable[[WriteItem], int]
) -> list[list[WriteItem]]:
    """Bytes items first (as DCP does), tensors greedily to the lightest of ``n`` buckets."""
    buckets: list[list[WriteItem]] = [[] for _ in range(n)]
    buckets[0] = [i for i in items if i.type == WriteItemType.BYTE_IO]
    sized = sorted(
        ((planned_bytes(i), k, i) for k, i in enumerate(items) if i.type != WriteItemType.BYTE_IO),
        key=lambda t: (-t[0], t[1]),
    )
    if n == 1:
        buckets[0] += [i for _, _, i in sized]
        return buckets
    sizes = [0] * n
    for size, _, item in sized:
        k = sizes.index(min(sizes))
        buckets[k].append(item)
        sizes[k] += size
    return buckets
