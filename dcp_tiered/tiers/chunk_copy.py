"""A memory-tier snapshot copied chunk by chunk, each chunk hashed as it is filled.

The slot is checked by one hash per fixed-size chunk of its bytes (``memory_chunks``). Copied
tensor by tensor, a chunk's bytes come from several tensors, or from part of one, at different
moments, so its hash had to wait until the last of them was in, and then read the chunk back
(from memory, or on a thread that competes with the copy for a core). Here the copy is planned
by chunk instead: every chunk's pieces of tensors, in the slot's byte order, copied by one
thread, which hashes each stretch right after copying it, while it is still in the CPU's
cache (half a megabyte of small tensors, two of a large one's: see the constants below). Two
threads take alternate chunks, so both cores copy and hash, and a snapshot is valid when its
copy ends. Until valid, medians of an A/B on the development VM:
the training benchmark's state (48 tensors, 72 MiB, its 4 MiB tensors each across two chunks)
20.0 -> 11.1 ms; 2,000 tensors (261 MiB) 55.1 -> 38.4 ms; 20,000 tensors 94.5 -> 68.8 ms.

Large tensors are copied by memcpy, so only where ``host_copy`` allows one (plain contiguous
CPU tensors); a state with any other large tensor (on a GPU, not contiguous) goes the
tensor-by-tensor way (``memory_copy``). Small ones go through torch, as there.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import host_copy
from ..policy import memory_chunks

# Small tensors: copied in runs of up to this many bytes, hashed after each run while it is
# still in the core's own cache (L2).
_PIECE_BYTES = 512 * 2**10
# Large tensors: copied by one memcpy per this many bytes, each hashed right after from the
# shared cache (L3). Fewer, larger calls than the small tensors' runs: at 512 KiB a 1 GiB state
# of 32 MiB tensors took 2,048 calls of each kind, whose handovers of the GIL between the two
# copying threads cost more than hashing from L3 instead of L2 (snapshot until valid vs a
# memcpy, the two alternating, medians on the development VM: 32 x 32 MiB 1.50x -> 1.32x,
# 2,000 tensors 1.96x -> 1.65x, 20,000 tensors 1.11x -> 1.08x; a single thread's memcpy is as
# fast in 256 KiB pieces as in 2 MiB ones, so the gain is the calls').
_LARGE_PIECE_BYTES = 2 * 2**20
_memmove = ctypes.memmove  # a foreign call: the GIL is released while it copies


class Piece(NamedTuple):
    """Bytes of one large tensor, copied by memcpy :data:`_LARGE_PIECE_BYTES` at a time."""

    tensor: int  # its number in the state's tensors
    offset: int  # of the bytes in the tensor
    at: int  # their offset in the slot
    nbytes: int


class Run(NamedTuple):
    """Small tensors next to each other inside one chunk, copied by one call."""

    views: list[torch.Tensor]  # their views in the slot
    tensors: list[int]  # their numbers in the state's tensors
    start: int  # slot offsets of the first one's first byte and the last one's end
    end: int


@dataclass(frozen=True)
class Chunk:
    """One chunk of the slot: ``[start, end)`` of its bytes, and what fills it, in byte order:
    pieces of large tensors (copied by memcpy, two megabytes at a time) and runs of small
    ones wholly inside it (copied by one ``torch._foreach_copy_`` each: a call per small
    tensor would cost more than its copy)."""

    start: int
    end: int
    parts: tuple[Piece | Run, ...]


def plan(dsts: list[torch.Tensor], base: int, size: int) -> list[Chunk] | None:
    """The chunks of a slot of ``size`` bytes at address ``base`` whose tensors are views
    ``dsts``; None where they overlap or leave the slot (nothing this plan can copy)."""
    chunk_bytes = memory_chunks.CHUNK_BYTES
    parts: list[list[Piece | Run]] = [[] for _ in range(memory_chunks.count(size, chunk_bytes))]
    spans = sorted((d.data_ptr() - base, d.nbytes, i) for i, d in enumerate(dsts) if d.nbytes)
    end = 0
    for offset, nbytes, i in spans:
        if offset < end or offset + nbytes > size:
            return None
        c = offset // chunk_bytes
        if nbytes < host_copy.MEMCPY_MIN_BYTES and (offset + nbytes - 1) // chunk_bytes == c:
            last = parts[c][-1] if parts[c] else None
            if isinstance(last, Run) and last.end - last.start < _PIECE_BYTES:
                last.views.append(dsts[i])
                last.tensors.append(i)
                parts[c][-1] = last._replace(end=offset + nbytes)
            else:
                parts[c].append(Run([dsts[i]], [i], offset, offset + nbytes))
        else:
            done = 0
            while done < nbytes:  # split where chunks end
                at = offset + done
                n = min(nbytes - done, (at // chunk_bytes + 1) * chunk_bytes - at)
                parts[at // chunk_bytes].append(Piece(i, done, at, n))
                done += n
        end = offset + nbytes
    return [
        Chunk(c * chunk_bytes, min(size, (c + 1) * chunk_bytes), tuple(p))
        for c, p in enumerate(parts)
    ]


def copy_and_checksum(
    buffer: torch.Tensor, dsts: list[torch.Tensor], srcs: list[torch.Tensor], chunks: list[Chunk]
) -> list[Future[str]] | None:
    """Copy ``srcs`` into ``dsts`` (views of ``buffer`` as planned in ``chunks``) and hash
    every chunk; the hashes, as done futures in chunk order. None, having copied nothing,
    where a large tensor is not one a memcpy may copy (on a GPU, not contiguous)."""
    sources: dict[int, int] = {}  # tensor number -> address, of the tensors copied in pieces
    for chunk in chunks:
        for part in chunk.parts:
            if isinstance(part, Piece) and part.tensor not in sources:
                segment = host_copy.as_segment(dsts[part.tensor], srcs[part.tensor])
                if segment is None:
                    return None
                sources[part.tensor] = segment[1]
    base = buffer.data_ptr()
    data = memoryview(buffer.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
    digests: list[str] = [""] * len(chunks)

    def fill(numbers: range) -> None:
        with torch.no_grad():  # grad mode is per thread: the helper's own
            for c in numbers:
                digests[c] = _fill_chunk(chunks[c], base, data, sources, srcs)

    host_copy.side_by_side(
        lambda: fill(range(0, len(chunks), 2)), lambda: fill(range(1, len(chunks), 2))
    )
    out = []
    for digest in digests:
        done: Future[str] = Future()
        done.set_result(digest)
        out.append(done)
    return out


def _fill_chunk(
    chunk: Chunk, base: int, data: memoryview, sources: dict[int, int], srcs: list[torch.Tensor]
) -> str:
    """Copy what fills ``chunk``, hashing its bytes (gaps between tensors included) in
    stretches of about :data:`_PIECE_BYTES` (small tensors) or :data:`_LARGE_PIECE_BYTES`
    (a large one) right after they are copied."""
    hasher = memory_chunks.streaming()
    hashed = chunk.start
    for part in chunk.parts:
        if isinstance(part, Run):
            torch._foreach_copy_(part.views, [srcs[i] for i in part.tensors])
            if part.end - hashed >= _PIECE_BYTES:
                hasher.update(data[hashed : part.end])
                hashed = part.end
            continue
        i, src_offset, at, nbytes = part
        done = 0
        while done < nbytes:
            n = min(nbytes - done, _LARGE_PIECE_BYTES)
            _memmove(base + at + done, sources[i] + src_offset + done, n)
            done += n
            if at + done - hashed >= _LARGE_PIECE_BYTES:
                hasher.update(data[hashed : at + done])
                hashed = at + done
    hasher.update(data[hashed : chunk.end])
    return memory_chunks.hex_digest(hasher)
