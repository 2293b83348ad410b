"""A memory-tier snapshot copied chunk by chunk, each chunk hashed as soon as it is filled.

The slot is checked by one hash per fixed-size chunk of its bytes (``memory_chunks``). Copied
tensor by tensor, a chunk's bytes come from several tensors, or from part of one, at different
moments, so its hash had to wait until the last of them was in, and then read the chunk back
(from memory, or on a thread that competes with the copy for a core). Here the copy is planned
by chunk instead: every chunk's pieces of tensors, in the slot's byte order, copied by one
thread, which hashes the chunk right after filling it, while it is still in the CPU's shared
cache. Two threads claim chunks as they go, so both cores copy and hash, and a snapshot is
valid when its copy ends.

Claimed, not split in halves: after an idle spell the second core may start milliseconds late
or run slower for a while (on the development VM the helper's first chunk began 3-4 ms after
the caller's in a third of the copies that followed a pause), and the other then takes more
chunks. Each thread does as few steps per chunk as it can: one ``memmove`` per piece of a
large tensor (no GIL while it copies), one ``torch._foreach_copy_`` for all its small tensors,
one hash. The old and the new way side by side in one process, snapshot until valid after a
pause, medians on the development VM: 20,000 tensors 76 -> 63 ms, 2,000 tensors 42 -> 39 ms,
32 x 32 MiB unchanged.

Small tensors in a chunk that pieces of large tensors fill mostly (more bytes than the small
ones) are copied before the chunks, all in one ``torch._foreach_copy_``
(``ChunkPlan.up_front``): between large copies, which push torch's code and the tensors'
metadata out of the caches, a 2,000-tensor state's 1.2 MiB of small tensors took 6-8 ms of
the two threads' time in 66 calls, 0.6 ms in one call before them (the snapshot until valid
37 -> 31 ms, memcpy 29 ms). Their bytes are then read back from memory by the chunk's hash:
a megabyte. A chunk of mostly small tensors (the 20,000-tensor state's, each with a piece of
the tensor across its end) still copies them itself, on both threads, and hashes them from
the cache: all 20,000 up front took 66 ms instead of 50.

Large tensors are copied by memcpy, so only where ``host_copy`` allows one (plain contiguous
CPU tensors), all checked before a byte is copied; a state with any other large tensor (on a
GPU, not contiguous) goes the tensor-by-tensor way (``memory_copy``). Small ones go through
torch, as there, each run's sources checked (shapes, dtypes) by the thread that copies them
right before it does: with 20,000 tensors a check of all of them first took 13-17 ms, and
read every tensor's metadata once more than the copy does.
"""

from __future__ import annotations

import ctypes
import itertools
from concurrent.futures import Future
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, NamedTuple

import torch

from .. import batch_copy, host_copy
from ..policy import memory_chunks

_memmove = ctypes.memmove  # a foreign call: the GIL is released while it copies
_shape = attrgetter("shape")
_dtype = attrgetter("dtype")


class Piece(NamedTuple):
    """Bytes of one large tensor inside one chunk, copied by one memcpy."""

    tensor: int  # its number in the state's tensors
    offset: int  # of the bytes in the tensor
    at: int  # their offset in the slot
    nbytes: int


class Batch(NamedTuple):
    """Tensors copied by one ``torch._foreach_copy_``: a chunk's small tensors."""

    views: list[torch.Tensor]  # their views in the slot
    tensors: list[int]  # their numbers in the state's tensors
    shapes: list[torch.Size]  # the views' shapes and dtypes: what their sources must have
    dtypes: list[torch.dtype]

    def add(self, view: torch.Tensor, tensor: int) -> None:
        self.views.append(view)
        self.tensors.append(tensor)
        self.shapes.append(view.shape)
        self.dtypes.append(view.dtype)

    def check(self, srcs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The batch's sources, once their shapes and dtypes are checked (Mismatch)."""
        sources = [srcs[i] for i in self.tensors]
        if list(map(_shape, sources)) != self.shapes or list(map(_dtype, sources)) != self.dtypes:
            raise batch_copy.Mismatch
        return sources

    def copy(self, srcs: list[torch.Tensor]) -> None:
        """Copy the batch's sources in, once checked (never recorded by autograd: a source
        that requires grad, a parameter, would make its view part of a graph that grows by
        one node a save)."""
        sources = self.check(srcs)
        if sources:
            with torch.no_grad():
                torch._foreach_copy_(self.views, sources)


def _batch() -> Batch:
    return Batch([], [], [], [])


@dataclass(frozen=True)
class Chunk:
    """One chunk of the slot: ``[start, end)`` of its bytes, and what fills it: the small
    tensors wholly inside it, copied by one ``torch._foreach_copy_`` (a call per small tensor
    would cost more than its copy, and between calls the large copies push torch's own code
    out of the CPU's caches), and pieces of large tensors, one memcpy each."""

    start: int
    end: int
    small: Batch
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class ChunkPlan:
    """What fills each chunk of a slot; the large tensors (copied in pieces), as their views
    are; the small tensors of chunks that pieces of large ones fill mostly (copied first, in
    one batch); and the tensors of no bytes (in no chunk, but checked as the others are)."""

    chunks: list[Chunk]
    large: Batch
    up_front: Batch
    empty: Batch

    def sources(
        self, srcs: list[torch.Tensor], held: list[Any] | None = None
    ) -> dict[int, int] | None:
        """Tensor number -> address of each large source, all checked against their views
        (Mismatch); None where one is not a tensor a memcpy may copy. With ``held``, each
        source's storage goes into it: the memory a memcpy reads stays allocated while it
        reads, even if the tensor is given other memory meanwhile (a loop that changes the
        state during a copy beside training; the copy then fails its check instead of
        reading freed memory)."""
        # without ``held`` the caller waits for the copy: nobody changes the state meanwhile
        storages = None if held is None else [srcs[i].untyped_storage() for i in self.large.tensors]
        addresses = host_copy.memcpy_addresses(self.large.check(srcs))
        if addresses is None:
            return None
        if held is not None and storages is not None:
            for i, storage, address in zip(self.large.tensors, storages, addresses):
                start = storage.data_ptr()
                if not start <= address < start + storage.nbytes():  # replaced since taken
                    raise batch_copy.Mismatch(f"source {i} was given other memory during the copy")
            held.extend(storages)
        return dict(zip(self.large.tensors, addresses))


def plan(dsts: list[torch.Tensor], base: int, size: int) -> ChunkPlan | None:
    """The chunks of a slot of ``size`` bytes at address ``base`` whose tensors are views
    ``dsts``; None where they overlap or leave the slot (nothing this plan can copy)."""
    chunk_bytes = memory_chunks.CHUNK_BYTES
    count = memory_chunks.count(size, chunk_bytes)
    small = [_batch() for _ in range(count)]
    pieces: list[list[Piece]] = [[] for _ in range(count)]
    large, empty = _batch(), _batch()
    for i, d in enumerate(dsts):
        if not d.nbytes:
            empty.add(d, i)
    spans = sorted((d.data_ptr() - base, d.nbytes, i) for i, d in enumerate(dsts) if d.nbytes)
    end = 0
    for offset, nbytes, i in spans:
        if offset < end or offset + nbytes > size:
            return None
        c = offset // chunk_bytes
        if nbytes < host_copy.MEMCPY_MIN_BYTES and (offset + nbytes - 1) // chunk_bytes == c:
            small[c].add(dsts[i], i)
        else:
            large.add(dsts[i], i)
            done = 0
            while done < nbytes:  # split where chunks end
                at = offset + done
                n = min(nbytes - done, (at // chunk_bytes + 1) * chunk_bytes - at)
                pieces[at // chunk_bytes].append(Piece(i, done, at, n))
                done += n
        end = offset + nbytes
    up_front = _batch()
    for c in range(count):
        # copied before the chunks, in one call (see the module's docstring)
        if sum(v.nbytes for v in small[c].views) < sum(p.nbytes for p in pieces[c]):
            for view, i in zip(small[c].views, small[c].tensors):
                up_front.add(view, i)
            small[c] = _batch()
    chunks = [
        Chunk(c * chunk_bytes, min(size, (c + 1) * chunk_bytes), small[c], tuple(pieces[c]))
        for c in range(count)
    ]
    return ChunkPlan(chunks, large, up_front, empty)


def copy_and_checksum(
    buffer: torch.Tensor,
    dsts: list[torch.Tensor],
    srcs: list[torch.Tensor],
    planned: ChunkPlan,
    *,
    beside_training: bool = False,
) -> list[Future[str]] | None:
    """Copy ``srcs`` into ``dsts`` (views of ``buffer`` as ``planned``) and hash every chunk,
    on this thread and the helper (``beside_training``: on this one only, the sources'
    storages held while they are copied); the hashes, as done futures in chunk order. None,
    having copied nothing, where a large source is not one a memcpy may copy (on a GPU, not
    contiguous). Raises Mismatch where a source's shape or dtype is not its view's: part of
    the slot may have been copied by then (the caller copies it again another way)."""
    planned.empty.copy(srcs)
    held: list[Any] | None = [] if beside_training else None  # until their bytes are copied
    addresses = planned.sources(srcs, held)
    if addresses is None:
        return None
    planned.up_front.copy(srcs)  # before either thread hashes a chunk they are in
    chunks = planned.chunks
    base = buffer.data_ptr()
    data = memoryview(buffer.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
    digests: list[str] = [""] * len(chunks)
    claim = itertools.count().__next__  # the next chunk to fill (atomic: one C call)
    failed: list[BaseException] = []

    def fill() -> None:
        try:
            with torch.no_grad():  # grad mode is per thread: the helper's own
                while not failed and (c := claim()) < len(chunks):
                    digests[c] = _fill_chunk(chunks[c], base, data, addresses, srcs)
        except BaseException as e:  # the other thread stops at its next chunk
            failed.append(e)
            raise

    if beside_training:
        fill()
    else:
        host_copy.side_by_side(fill, fill)
    out = []
    for digest in digests:
        done: Future[str] = Future()
        done.set_result(digest)
        out.append(done)
    return out


def _fill_chunk(
    chunk: Chunk,
    base: int,
    data: memoryview,
    addresses: dict[int, int],
    srcs: list[torch.Tensor],
) -> str:
    """Copy what fills ``chunk`` and hash its bytes (gaps between tensors included) while
    they are still in the CPU's cache."""
    chunk.small.copy(srcs)
    for piece in chunk.pieces:
        _memmove(base + piece.at, addresses[piece.tensor] + piece.offset, piece.nbytes)
    return memory_chunks.hash_bytes(data[chunk.start : chunk.end])
