"""The memory tier's snapshot format: where each tensor sits in a slot, and the header that
commits it. Pure: no I/O.

A rank's snapshot is its own local state (the local shards of DTensors and ShardedTensors,
plain tensors, and small non-tensor values), laid out at 64-byte aligned offsets of one
reusable buffer. The JSON header records each tensor's path, dtype, shape, offset and CRC32C,
the non-tensor values (``torch.save`` bytes, read back with ``weights_only=True``), and a
checksum of itself. Restoring fills the application's own state-dict template in place, so it
needs the same ranks and sharding as the save; anything else is left to the disk and remote
tiers, which reshard.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import _gc
from .._torch_compat import ShardedTensor
from ..errors import ConfigError, IntegrityError, ManifestError
from . import integrity, memory_chunks, records

FORMAT = "dcp-tiered-memory"
# 2: checksums over fixed-size chunks of the slot ("chunk_bytes", "chunk_checksums") instead
# of one per tensor, CRC32C. 3: the chunks' hash named ("chunk_algorithm", XXH3-64 today).
# Version 1 headers (per-tensor checksums) and version 2 still read.
VERSION = 3
_READS = (1, 2, 3)
ALIGN = 64
_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}

Path = tuple[str | int, ...]


def leaves(obj: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """(path, leaf) of a nested state dict; a ShardedTensor yields each local shard."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise ConfigError(f"state dict key {k!r} at {list(path)} is not a str or int")
            yield from leaves(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, (*path, i))
    elif isinstance(obj, ShardedTensor):
        for i, shard in enumerate(obj.local_shards()):
            yield (*path, f"#shard{i}"), shard.tensor
    elif isinstance(obj, DTensor):
        yield path, obj.to_local()
    else:
        yield path, obj


def key(path: Path) -> str:
    """The path as a JSON list (the header's key). Keys of plain ASCII names and ints are
    built directly: the snapshot and its restore make one per tensor."""
    parts = []
    for p in path:
        if type(p) is int:
            parts.append(str(p))
        elif type(p) is str and p.isascii() and p.isprintable() and '"' not in p and "\\" not in p:
            parts.append(f'"{p}"')
        else:
            return json.dumps(list(path))
    return "[" + ", ".join(parts) + "]"


@dataclass(frozen=True)
class Region:
    key: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


def layout(tensors: list[tuple[Path, torch.Tensor]]) -> tuple[list[Region], int]:
    """Aligned regions for ``tensors``, and the buffer size they need."""
    regions, offset = [], 0
    for path, t in tensors:
        nbytes = t.numel() * t.element_size()
        regions.append(Region(key(path), str(t.dtype), list(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return regions, max(offset, ALIGN)


def views(buffer: torch.Tensor, regions: list[Region]) -> list[torch.Tensor]:
    """The tensor each region holds, as views of the uint8 ``buffer``."""
    out = []
    for r in regions:
        dtype = _DTYPES.get(r.dtype)
        if dtype is None:
            raise ManifestError(f"unknown dtype {r.dtype!r} for {r.key}")
        out.append(buffer[r.offset : r.offset + r.nbytes].view(dtype).view(r.shape))
    return out


def encode_objects(objects: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(objects, buf)
    return buf.getvalue()


def decode_objects(data: bytes, *, allow_pickle: bool = False, where: str = "") -> dict[str, Any]:
    """Non-tensor values: weights_only unless the caller trusts the snapshot. A value that
    loading refuses (or bytes that are no torch.save output) raise IntegrityError, as the
    disk tier's reader does."""
    try:
        objects = torch.load(io.BytesIO(data), weights_only=not allow_pickle)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError and kin
        raise IntegrityError(
            f"{where or 'a memory snapshot'}: its non-tensor values do not load with "
            f"weights_only ({type(e).__name__}: {str(e)[:300]}). If you trust this snapshot, "
            "construct CheckpointManager(..., allow_pickle=True); else restore from disk."
        ) from e
    if not isinstance(objects, dict):
        raise IntegrityError(f"{where}: its non-tensor values are not a dict")
    return objects


def refused_by_weights_only(value: Any) -> str | None:
    """Why ``value`` would not load back with ``weights_only=True`` (None: it would)."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as e:  # noqa: BLE001 - a lambda, a lock...: an answer, on every rank
        return f"it cannot be pickled at all: {type(e).__name__}: {e}"
    return refused_saved(buf.getvalue())


def refused_saved(data: bytes) -> str | None:
    """Why ``torch.save`` output ``data`` would not load with ``weights_only=True`` (None: it
    would). Loading with ``weights_only`` builds only allowlisted classes: it runs no code."""
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError and kin
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        # torch's message opens with generic advice; the line naming the refused global says
        # what is wrong.
        return next((line for line in lines if "WeightsUnpickler error" in line), lines[0])
    return None


def first_refused(state: Any, trusted: Iterable[type] = ()) -> str | None:
    """Why a value of ``state`` (a nested dict/list of tensors and values) would not load back
    with ``weights_only``, naming its path and type; None when every value would.

    ``trusted``: classes allowed beyond torch's own safe set (and any allowlisted in this
    process), as the loader will allow them.
    """
    pending: list[tuple[str, Any]] = [(str(k), v) for k, v in state.items()]
    with torch.serialization.safe_globals(list(trusted)):
        while pending:
            path, value = pending.pop()
            if isinstance(value, dict):
                pending += [(f"{path}.{k}", v) for k, v in value.items()]
            elif isinstance(value, list) or (
                isinstance(value, tuple) and not hasattr(value, "_fields")
            ):
                pending += [(f"{path}[{i}]", v) for i, v in enumerate(value)]
            elif not isinstance(value, (torch.Tensor, int, float, str, bool, type(None))):
                # A namedtuple is a leaf: its class must load too.
                why = refused_by_weights_only(value)
                if why is not None:
                    return (
                        f"the value at {path!r} ({type(value).__name__}) would not load back "
                        f"with weights_only ({why})"
                    )
    return None


def encode_regions(regions: list[Region]) -> str:
    """The header's tensor list, canonical JSON, for chunk-checksummed (version 2) headers.
    A layout is fixed for as long as the state's structure is, so the memory tier encodes it
    once and passes it to :func:`encode_header` every save: at 20,000 tensors encoding it is
    80 ms, most of what a snapshot costs beyond its copy."""
    return _canonical([_region_entry(r, "") for r in regions])


def _region_entry(r: Region, checksum: str) -> dict[str, Any]:
    return {
        "key": r.key,
        "dtype": r.dtype,
        "shape": r.shape,
        "offset": r.offset,
        "nbytes": r.nbytes,
        "checksum": checksum,
    }


def encode_header(
    *,
    step: str,
    rank: int,
    committed_at_ns: int,
    data_size: int,
    regions: list[Region],
    checksums: list[str],
    objects: bytes,
    run_id: str | None = None,
    world_size: int | None = None,
    chunk_bytes: int = 0,
    chunk_checksums: list[str] | None = None,
    encoded_regions: str | None = None,
) -> bytes:
    """``checksums``: one per region (version 1), or empty with ``chunk_checksums`` of
    ``chunk_bytes`` each over the slot's first ``data_size`` bytes. ``encoded_regions``:
    ``encode_regions(regions)``, made once (version 2 only).

    The header is the body's canonical JSON (the form its checksum covers) with the checksum
    added, built from parts so that the tensor list can be the one encoded already."""
    if chunk_checksums is None and len(checksums) != len(regions):
        raise ValueError("a checksum per region, or chunk checksums")
    if encoded_regions is not None and chunk_checksums is None:
        raise ValueError("encoded regions are for chunk-checksummed headers")
    body: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION if chunk_checksums is not None else 1,
        "step": step,
        "rank": rank,
        "committed_at_ns": committed_at_ns,
        "data_size": data_size,
        "objects": base64.b64encode(objects).decode(),
    }
    if run_id is not None:  # whose snapshot: a restore takes only its own run's
        body["run_id"] = run_id
    if world_size is not None:  # a snapshot fills the state of the same ranks only
        body["world_size"] = world_size
    if chunk_checksums is not None:
        body["chunk_bytes"] = chunk_bytes
        body["chunk_checksums"] = list(chunk_checksums)
        body["chunk_algorithm"] = memory_chunks.ALGORITHM
    if encoded_regions is None:
        entries = zip(regions, checksums or [""] * len(regions))
        encoded_regions = _canonical([_region_entry(r, c) for r, c in entries])
    parts = {k: _canonical(v) for k, v in body.items()}
    parts["tensors"] = encoded_regions
    canonical = "{" + ",".join(f"{_canonical(k)}:{parts[k]}" for k in sorted(parts)) + "}"
    checksum = integrity.format_checksum(integrity.checksum(canonical.encode()))
    return f'{canonical[:-1]},"header_checksum":{_canonical(checksum)}}}'.encode()


@dataclass(frozen=True)
class Header:
    step: str
    rank: int
    committed_at_ns: int
    data_size: int
    regions: list[Region]
    checksums: list[str]
    objects: bytes
    run_id: str | None = None  # None: written before run identities
    world_size: int | None = None
    chunk_bytes: int = 0  # > 0: the slot is checked by chunk_checksums, not per region
    chunk_checksums: tuple[str, ...] = ()
    chunk_algorithm: str = memory_chunks.CRC32C  # version 2's


@_gc.paused_during  # one object per tensor: see _gc
def decode_header(data: bytes, *, where: str) -> Header:
    body = records.load_json(data, where=where, max_bytes=records.MAX_MANIFEST_BYTES)
    try:
        expected = body.pop("header_checksum")
        if body.get("format") != FORMAT or body.get("version") not in _READS:
            raise ManifestError(f"{where}: not a version-{_READS} memory-tier header")
        if expected != _checksum(body):
            raise ManifestError(f"{where}: header checksum mismatch (modified or torn)")
        regions = [
            Region(
                str(t["key"]),
                str(t["dtype"]),
                [int(s) for s in t["shape"]],
                int(t["offset"]),
                int(t["nbytes"]),
            )
            for t in body["tensors"]
        ]
        size = int(body["data_size"])
        if any(r.offset % ALIGN or r.offset + r.nbytes > size for r in regions):
            raise ManifestError(f"{where}: a tensor lies outside the {size}-byte buffer")
        for r in regions:
            _check_region(r, where)
        header = Header(
            str(body["step"]),
            int(body["rank"]),
            int(body["committed_at_ns"]),
            size,
            regions,
            [str(t["checksum"]) for t in body["tensors"]],
            base64.b64decode(body["objects"]),
            _optional(body, "run_id", str),
            _optional(body, "world_size", int),
            int(body.get("chunk_bytes", 0)),
            tuple(str(c) for c in body.get("chunk_checksums", ())),
            str(body.get("chunk_algorithm", memory_chunks.CRC32C)),
        )
        if header.chunk_algorithm not in memory_chunks.KNOWN:
            raise ManifestError(
                f"{where}: chunks hashed with {header.chunk_algorithm!r}, which this version "
                f"does not know ({', '.join(memory_chunks.KNOWN)}): a newer dcp_tiered wrote it"
            )
        if body["version"] >= 2 and (
            header.chunk_bytes <= 0 or len(header.chunk_checksums) != -(-size // header.chunk_bytes)
        ):
            raise ManifestError(f"{where}: chunk checksums do not cover the {size}-byte buffer")
        return header
    except ManifestError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
        raise ManifestError(f"{where}: unreadable memory-tier header ({e!r})") from e


def _optional(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is not None and type(value) is not kind:
        raise ManifestError(f"{name} {value!r} is not a {kind.__name__}")
    return value


def _check_region(r: Region, where: str) -> None:
    """A region's dtype, shape and byte count agree, so viewing it never fails untyped."""
    dtype = _DTYPES.get(r.dtype)
    numel = 1
    for n in r.shape:
        numel *= n
    if dtype is None or min(r.shape, default=0) < 0 or r.offset < 0:
        raise ManifestError(f"{where}: {r.key}: bad dtype {r.dtype!r} or shape {r.shape}")
    if numel * dtype.itemsize != r.nbytes:
        raise ManifestError(
            f"{where}: {r.key} is {r.dtype} {r.shape} ({numel * dtype.itemsize} bytes) but "
            f"the header gives it {r.nbytes} bytes"
        )


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _checksum(body: dict[str, Any]) -> str:
    return integrity.format_checksum(integrity.checksum(_canonical(body).encode()))


def region_checksums(buffer: torch.Tensor, regions: list[Region]) -> list[str]:
    """CRC32C of each region: one view of the buffer, one checksum call per region."""
    data = memoryview(buffer.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
    return [
        integrity.format_checksum(integrity.checksum(data[r.offset : r.offset + r.nbytes]))
        for r in regions
    ]
