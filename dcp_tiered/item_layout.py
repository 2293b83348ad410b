"""A data file written again with the same items: its layout kept from the last save.

DCP's plan caching hands every save of one structure the same final plan, and the writer
splits it into the same lists of items (``writer._datafile``): each data file then holds the
same items, in the same order, framed alike at the same offsets, save after save. Only the
tensors' bytes change. A :class:`Layout` keeps what a save of a file worked out per item (its
frame, where it lands, whether it is copied or written from its own memory) and a staging
buffer that already holds every frame's head and tail. A later save of the same list checks
the tensors' kinds, dtypes and shapes in one comparison, copies every small tensor into its
slot with one batched copy, writes the file in a few ``writev`` calls and checksums each
item: a few microseconds of Python per item, where :class:`~dcp_tiered.item_writer.DataFile`
frames each one anew (20,000 tensors: about 25 us each). The bytes are the same either way.

A list of items gets a layout the second time it is written (a list seen once may never come
back: a save without plan caching plans anew), and only if every item is a tensor that
``DataFile`` frames and the staging buffer stays under :data:`MAX_STAGING_BYTES`. A save
whose tensors no longer match, or that finds the layout in use by another save, is written
by ``DataFile``.
"""

from __future__ import annotations

import io
import operator
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from . import item_writer
from .backends.local import LocalBackend
from .host_copy import PLAIN_TENSORS
from .item_frame import FRAMER, Frame
from .policy import integrity
from .policy.item_keys import ItemKeys

# Staging buffers kept in all (every layout holds its small tensors' bytes and every frame)
MAX_STAGING_BYTES = 256 * 2**20
_KEPT_LISTS = 16  # item lists remembered (seen once, or with a layout), the oldest dropped


class Layout:
    """One data file's items, framed and placed once; :meth:`stage` and :meth:`write_staged`
    write them again."""

    def __init__(self, items: Sequence[WriteItem], tensors: list[Any]) -> None:
        """Raises ``_NoLayout`` where ``DataFile`` would not frame every item alike."""
        heads: list[bytes] = []  # the staging buffer's parts, in file order
        self._small: list[int] = []  # items staged whole: small tensors, bytes items
        self._large: list[int] = []  # items whose tensor bytes are written from its memory
        self._bytes: list[tuple[int, int, int]] = []  # bytes items' (index, offset, length)
        self._item_at: list[tuple[int, int]] = []  # (start, length) of each item in the file
        raw: list[int | None] = []
        self._frames: list[Frame] = []  # of the large items
        self._large_sizes: list[int] = []  # their tensors' bytes
        self._large_parts: list[tuple[int, bytes]] = []  # each one's (head's CRC, tail)
        cuts: list[int] = []  # staging offsets where a large tensor's bytes go
        slots: list[tuple[int, int, torch.dtype, torch.Size]] = []  # small tensors'
        small_items: list[tuple[int, int]] = []  # (staging offset, length) of each small item
        staged = position = 0
        for k, (item, data) in enumerate(zip(items, tensors)):
            body, frame = _parts(item, data)
            head, tail = (frame.head, frame.tail) if frame is not None else (b"", b"")
            length = len(head) + len(body) + len(tail)
            heads.append(head)
            if frame is None or len(body) < item_writer.COPY_BELOW_BYTES:
                self._small.append(k)
                small_items.append((staged, length))
                if frame is None:
                    self._bytes.append((k, staged, len(body)))
                elif len(body):
                    slots.append((k, staged + len(head), data.dtype, data.shape))
                heads.append(bytes(body))
                staged += length
            else:
                self._large.append(k)
                cuts.append(staged + len(head))
                self._frames.append(frame)
                self._large_sizes.append(len(body))
                self._large_parts.append((integrity.checksum(head), tail))
                staged += length - len(body)
            heads.append(tail)
            self._item_at.append((position, length))
            raw.append(len(head) if frame is not None and len(body) else None)
            position += length
            if staged > MAX_STAGING_BYTES:
                raise _NoLayout
        self.signature = _signature(tensors)
        self.size = position
        self.staging = bytearray(b"".join(heads))
        staging = memoryview(self.staging)
        # The staging buffer between the large tensors' bytes, in file order
        self._segments = [staging[a:b] for a, b in zip([0, *cuts], [*cuts, len(self.staging)])]
        # typed views of the small tensors' slots, for one batched copy
        self._copied = [k for k, _, _, _ in slots]
        self._slots = [
            torch.frombuffer(self.staging, dtype=dtype, count=shape.numel(), offset=at).view(shape)
            for _, at, dtype, shape in slots
        ]
        self._small_views = [staging[at : at + n] for at, n in small_items]
        self.keys = ItemKeys.packed(
            (i.index.fqn, None if i.index.offset is None else tuple(i.index.offset), i.index.index)
            for i in items
        )
        self.offsets = [at for at, _ in self._item_at]
        self.lengths = [n for _, n in self._item_at]
        self.raw_offsets = raw
        self.busy = threading.Lock()  # one save at a time writes from the staging buffer

    def _large_crcs(self, i: int, body: memoryview, file_crc: int) -> tuple[int, int]:
        """The file's CRC continued over large item ``i``'s head and body (the staging
        segment before it, then its bytes), and the item's own CRC."""
        file_crc = integrity.checksum(self._segments[i], file_crc)
        head_crc, tail = self._large_parts[i]
        n = len(body)
        if n >= item_writer.COMBINE_BYTES:  # one pass, folded into both (as DataFile)
            own = integrity.checksum(body)
            file_crc = integrity.combine(file_crc, own, n)
            item_crc = integrity.combine(head_crc, own, n)
        else:  # two passes cost less than two combines
            file_crc = integrity.checksum(body, file_crc)
            item_crc = integrity.checksum(body, head_crc)
        return file_crc, integrity.checksum(tail, item_crc)

    def stage(self, tensors: list[Any]) -> _Staged | None:
        """``tensors`` (the items' data, in order) checked against the layout, the large
        ones' bytes found, the bytes items' staged: a few Python calls per item. None,
        having staged nothing, where they do not match (the caller frames them anew)."""
        if _signature(tensors) != self.signature:
            return None
        # A large tensor's bytes are written from its own memory: the same dtype and shape
        # (the signature) in row-major order there is the kept frame's tensor. Any other (a
        # view, a lazy conjugate) is made plain first, and must then frame as kept
        # (FRAMER's own checks: a class or layout it does not frame is DataFile's to write)
        large = [tensors[k] for k in self._large]
        # held until written: the views keep nothing alive (a tensor the caller lets go of
        # meanwhile leaves its memory here; one changed in place, resize_ included, is
        # against DCP's rules, and not guarded against)
        held = list(map(torch.Tensor.untyped_storage, large))
        bodies: list[memoryview] = []
        for j, body in enumerate(item_writer.raw_views(large, self._large_sizes)):
            if body is None:
                large[j] = plain = item_writer.as_saveable(large[j])
                if FRAMER.frame(plain) != self._frames[j]:
                    return None
                body = item_writer.memory_of(plain, self._large_sizes[j])
            bodies.append(body)
        for k, at, n in self._bytes:
            with tensors[k].getbuffer() as value:
                self.staging[at : at + n] = value
        return _Staged(bodies, [*held, *large], [tensors[k] for k in self._copied])

    def write_staged(self, f: BinaryIO, staged: _Staged, *, writeback: bool) -> item_writer.Written:
        """Write the data :meth:`stage` checked into ``f``: the small tensors copied into
        their slots, every item checksummed, the file written. Its calls are few, and release
        the GIL."""
        if self._slots:
            with torch.no_grad():
                torch._foreach_copy_(self._slots, staged.small)
        crcs = [0] * len(self._item_at)
        # in the cache after the copy
        for k, crc in zip(self._small, integrity.checksums(self._small_views)):
            crcs[k] = crc
        # Written in batches as DataFile writes them, each started to the disk; a batch's
        # large tensors are checksummed just after it is written, while still in the cache
        bodies = staged.bodies
        file_crc, batch, done, written = 0, [self._segments[0]], 0, 0
        pending = len(batch[0])
        for j, body in enumerate(bodies):
            batch += (body, self._segments[j + 1])
            pending += len(body) + len(self._segments[j + 1])
            if j + 1 < len(bodies) and (
                pending < item_writer._BATCH_BYTES and len(batch) < item_writer._BATCH_BUFFERS - 1
            ):
                continue
            written += _write(f, batch, written, writeback)
            pending = 0
            for i in range(done, j + 1):
                file_crc, crcs[self._large[i]] = self._large_crcs(i, bodies[i], file_crc)
            batch, done = [], j + 1
        if batch:  # no large tensors: the staging buffer is the file
            _write(f, batch, written, writeback)
        file_crc = integrity.checksum(self._segments[-1], file_crc)
        return item_writer.Written(
            position=self.size,
            file_crc=file_crc,
            keys=self.keys,
            offsets=self.offsets,
            lengths=self.lengths,
            checksums=struct.pack(f">{len(crcs)}I", *crcs).hex(),
            raw_offsets=self.raw_offsets,
        )


@dataclass(frozen=True, slots=True)
class _Staged:
    """A save's data checked against a layout, ready for :meth:`Layout.write_staged`."""

    bodies: list[memoryview]  # the large tensors' bytes, in file order
    held: list[Any]  # what the bodies point into, until written
    small: list[Any]  # the tensors copied into the slots, in slot order


class _NoLayout(Exception):
    """The items are not all tensors ``DataFile`` frames, or stage too many bytes."""


def _parts(item: WriteItem, data: Any) -> tuple[memoryview, Frame | None]:
    """An item's bytes as ``DataFile`` would write them: a tensor's own and its frame, or a
    bytes item's serialised value (no frame). Raises ``_NoLayout`` for anything else."""
    if item.type is WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise _NoLayout
        return data.getbuffer().cast("B"), None
    if not isinstance(data, torch.Tensor):
        raise _NoLayout
    saveable = item_writer.as_saveable(data)
    frame = FRAMER.frame(saveable)
    if frame is None:
        raise _NoLayout
    return item_writer.memory_of(saveable, saveable.numel() * saveable.element_size()), frame


def _signature(data: list[Any]) -> tuple[list[type], list[Any]]:
    """What a layout depends on: each item's class, and each tensor's dtype and shape (a copy
    into its slot takes care of strides, devices and views; the large ones' frames are
    checked apart), each bytes item's length. The facts of a file of tensors only are taken
    by one ``map`` (no Python frame per tensor: 10,000 tensors, about 9 -> 4 ms)."""
    kinds = list(map(type, data))
    if PLAIN_TENSORS.issuperset(kinds):
        return kinds, list(map(_DTYPE_AND_SHAPE, data))
    return kinds, list(map(_fact, data))


def _fact(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.dtype, value.shape
    return _length(value) if isinstance(value, io.BytesIO) else None  # None: never laid out


_DTYPE_AND_SHAPE = operator.attrgetter("dtype", "shape")


def _length(value: io.BytesIO) -> int:
    with value.getbuffer() as view:
        return view.nbytes


def _write(f: BinaryIO, batch: list[memoryview], at: int, writeback: bool) -> int:
    """Write ``batch`` at file offset ``at`` (where ``f`` stands), started to the disk if
    asked; returns its bytes."""
    LocalBackend.write_vectors(f, batch)
    size = sum(len(v) for v in batch)
    if writeback:
        LocalBackend.start_writeback(f, at, size)
    return size


class _Kept:
    """An item list this process has written, and its layout once it has one."""

    def __init__(self, items: Sequence[WriteItem]) -> None:
        self.items = items  # held: its id is the key
        self.layout: Layout | None = None
        self.tried = False  # a layout was built for it, or found impossible


_lock = threading.Lock()
_kept: OrderedDict[int, _Kept] = OrderedDict()  # by id of the item list, oldest first


class FileJob:
    """One data file's items and their data, made ready to write (:func:`prepare`). The
    thread that writes it takes its layout (and the layout's ``busy``) over; :meth:`release`
    lets go of one that no thread took."""

    def __init__(
        self,
        items: Sequence[WriteItem],
        data: list[Any],
        layout: Layout | None = None,
        staged: _Staged | None = None,
    ) -> None:
        self._items: Sequence[WriteItem] | None = items
        self._data: list[Any] | None = data
        self._layout, self._staged = layout, staged  # the layout's ``busy`` held with them
        self._taking = threading.Lock()

    def write(self, f: BinaryIO, *, writeback: bool = False) -> item_writer.Written:
        """Write the items into ``f``: from the kept layout where :func:`prepare` staged
        them there, else framed anew. Once only."""
        layout, staged, items, data = self._take()
        if items is None or data is None:
            raise RuntimeError("a data file's job was written twice, or after its release")
        try:
            if layout is not None and staged is not None:
                return layout.write_staged(f, staged, writeback=writeback)
            return item_writer.write_items(f, items, data, writeback=writeback).written()
        finally:
            if layout is not None:
                layout.busy.release()

    def release(self) -> None:
        """Let go of the layout (and the data) if no thread took them to write."""
        layout = self._take()[0]
        if layout is not None:
            layout.busy.release()

    def _take(self) -> tuple[Layout | None, _Staged | None, Any, Any]:
        with self._taking:  # the writing thread and the one that gave up on it, once
            out = (self._layout, self._staged, self._items, self._data)
            self._layout = self._staged = self._items = self._data = None
        return out


def prepare(
    items: Sequence[WriteItem], resolve: Callable[[Sequence[WriteItem]], list[Any]]
) -> FileJob:
    """``items`` with their data (from ``resolve``: DCP's ``planner.resolve_data`` of each),
    checked against the list's kept layout and staged in it where one fits. The work here
    is a few Python calls per item, which hold the GIL: the writer prepares every file on
    one thread and hands each to a thread of its own as it is ready, whose work then is a few
    calls that release it. Writer threads that prepared their files side by side took 2-3x
    as long as one thread doing both (20,000 tensors in two files: 70-90 ms before the first
    byte was written, every save)."""
    data = resolve(items)
    layout = _layout_for(items, data)
    if layout is not None and layout.busy.acquire(blocking=False):
        try:
            staged = layout.stage(data)
        except BaseException:
            layout.busy.release()
            raise
        if staged is not None:
            return FileJob(items, data, layout, staged)
        layout.busy.release()
        _forget(items)  # the state changed under the same plan: framed anew from now on
    return FileJob(items, data)


def _layout_for(items: Sequence[WriteItem], data: list[Any]) -> Layout | None:
    with _lock:
        kept = _kept.get(id(items))
        if kept is None or kept.items is not items:
            _kept[id(items)] = _Kept(items)
            while len(_kept) > _KEPT_LISTS:
                _kept.popitem(last=False)
            return None
        _kept.move_to_end(id(items))
        if kept.tried:
            return kept.layout
        kept.tried = True
    try:
        layout = Layout(items, data)
    except _NoLayout:
        return None
    with _lock:
        kept.layout = layout
        staged = [k for k in _kept.values() if k.layout is not None]  # oldest first
        while sum(len(k.layout.staging) for k in staged if k.layout) > MAX_STAGING_BYTES:
            staged.pop(0).layout = None
    return layout


def _forget(items: Sequence[WriteItem]) -> None:
    with _lock:
        _kept.pop(id(items), None)
