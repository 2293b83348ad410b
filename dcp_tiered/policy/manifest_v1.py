"""Manifest format version 1 (dcp_tiered 0.1): one JSON document with every item of every
rank, checksummed over its canonical re-encoding. Still read, so that steps saved before
version 2 restore; written only by tests that prove it. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from ..errors import ManifestError
from . import integrity, records
from .manifest_types import (
    FORMAT,
    ItemLocation,
    Manifest,
    check_item_length,
    decode_properties,
    encode_properties,
)

VERSION = 1

# ---------------------------------------------------------------- encoding helpers


def _index_key(index: MetadataIndex) -> list[Any]:
    offset = list(index.offset) if index.offset is not None else None
    return [index.fqn, offset, index.index]


def _encode_entry(md: TensorStorageMetadata | BytesStorageMetadata) -> dict[str, Any]:
    if isinstance(md, BytesStorageMetadata):
        return {"type": "bytes"}
    return {
        "type": "tensor",
        **encode_properties(md.properties),
        "size": list(md.size),
        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
    }


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ManifestError(f"{what} must be a list of non-negative integers, got {value!r}")
    return value


def _decode_entry(raw: Any) -> TensorStorageMetadata | BytesStorageMetadata:
    if not isinstance(raw, dict) or raw.get("type") not in ("tensor", "bytes"):
        raise ManifestError(f"bad state_dict_metadata entry {raw!r}")
    if raw["type"] == "bytes":
        return BytesStorageMetadata()
    props = decode_properties(raw)
    chunks = [
        ChunkStorageMetadata(
            offsets=torch.Size(_ints(c.get("offsets"), "chunk offsets")),
            sizes=torch.Size(_ints(c.get("sizes"), "chunk sizes")),
        )
        for c in raw.get("chunks", [])
    ]
    return TensorStorageMetadata(
        properties=props, size=torch.Size(_ints(raw.get("size"), "size")), chunks=chunks
    )


def _self_checksum(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return integrity.format_checksum(integrity.checksum(canonical))


# ---------------------------------------------------------------- build / parse


def build(
    *,
    step: str,
    save_id: str,
    world_size: int,
    nodes: list[list[int]],
    committed_at_ns: int,
    metadata: Metadata,
    locations: Mapping[MetadataIndex, ItemLocation],
    versions: Mapping[str, str],
    promote: bool = True,
) -> bytes:
    """Serialise a manifest for ``metadata`` whose items were written at ``locations``."""
    files: dict[str, dict[str, Any]] = {}
    items = []
    for index, loc in sorted(locations.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        files.setdefault(
            loc.relative_path,
            {"size": loc.file_size, "checksum": loc.file_checksum, "rank": loc.rank},
        )
        entry = {
            "index": _index_key(index),
            "file": loc.relative_path,
            "offset": loc.offset,
            "length": loc.length,
            "checksum": loc.checksum,
        }
        if loc.raw_offset is not None:
            entry["raw_offset"] = loc.raw_offset
        items.append(entry)
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    storage_meta = metadata.storage_meta
    body: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "save_id": save_id,
        "world_size": world_size,
        "nodes": nodes,
        "committed_at_ns": committed_at_ns,
        "promote": promote,
        "versions": dict(versions),
        "checksum_algorithm": integrity.ALGORITHM,
        "dcp_version": metadata.version,
        "files": files,
        "items": items,
        "state_dict_metadata": {
            fqn: _encode_entry(md) for fqn, md in metadata.state_dict_metadata.items()
        },
        "planner_data": {fqn: list(path) for fqn, path in planner_data.items()},
        "storage_meta": {
            "checkpoint_id": str(storage_meta.checkpoint_id) if storage_meta else step,
            "save_id": storage_meta.save_id if storage_meta else save_id,
        },
    }
    body["manifest_checksum"] = _self_checksum(body)
    return json.dumps(body, indent=1, sort_keys=True).encode()


def parse(data: bytes, *, where: str, sealed: Collection[int] = ()) -> Manifest:
    """Parse and validate manifest bytes. ``where`` names the file in error messages.
    ``sealed``: the later versions, which are sealed: one of those here lost its seal."""
    hint = "restore the step from another tier or an earlier step; do not edit manifests by hand"
    try:  # bad JSON, 5,000-digit numbers, 1e999, deep nesting, a huge file
        body = records.load_json(data, where=where, max_bytes=records.MAX_MANIFEST_BYTES)
    except ManifestError as e:
        raise ManifestError(f"{e}; {hint}") from e
    if body.get("format") != FORMAT:
        raise ManifestError(f"{where}: not a dcp_tiered manifest; {hint}")
    if body.get("version") in sealed:
        raise ManifestError(
            f"{where}: a version-{body.get('version')} manifest whose seal (its checksum, "
            "written last) is missing or does not match: it was modified (edited or written "
            f"out again) or damaged; {hint}"
        )
    if body.get("version") != VERSION:
        raise ManifestError(
            f"{where}: manifest version {body.get('version')!r} is not supported by this "
            f"dcp_tiered (reads version {VERSION}); upgrade dcp_tiered"
        )
    expected = body.pop("manifest_checksum", None)
    if expected != _self_checksum(body):
        raise ManifestError(f"{where}: manifest checksum mismatch (file was modified); {hint}")
    try:
        return _decode(body)
    except ManifestError as e:
        raise ManifestError(f"{where}: {e}; {hint}") from e
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError) as e:
        raise ManifestError(f"{where}: malformed manifest ({e!r}); {hint}") from e


def _decode(body: dict[str, Any]) -> Manifest:
    files = body["files"]
    locations: dict[MetadataIndex, ItemLocation] = {}
    for item in body["items"]:
        fqn, offset, idx = item["index"]
        index = MetadataIndex(
            fqn=str(fqn),
            offset=torch.Size(_ints(offset, "item offset")) if offset is not None else None,
            index=int(idx) if idx is not None else None,
        )
        path = str(item["file"])
        if path not in files or "/" in path or path.startswith("."):
            raise ManifestError(f"item {fqn!r} points at unlisted or unsafe file {path!r}")
        info = files[path]
        locations[index] = ItemLocation(
            relative_path=path,
            offset=int(item["offset"]),
            length=int(item["length"]),
            checksum=str(item["checksum"]),
            rank=int(info["rank"]),
            file_size=int(info["size"]),
            file_checksum=str(info["checksum"]),
            raw_offset=int(item["raw_offset"]) if item.get("raw_offset") is not None else None,
        )
        loc = locations[index]
        if min(loc.offset, loc.length, loc.file_size, loc.rank) < 0:
            raise ManifestError(f"item {fqn!r} has a negative offset, length, size or rank")
        if loc.offset + loc.length > loc.file_size:
            raise ManifestError(f"item {fqn!r} extends past the end of {path!r}")
        if not 0 <= (loc.raw_offset or 0) < loc.length:
            raise ManifestError(f"item {fqn!r} has a raw offset outside the item")
    sdm = {str(k): _decode_entry(v) for k, v in body["state_dict_metadata"].items()}
    ordinal = {
        (fqn, tuple(c.offsets)): i
        for fqn, md in sdm.items()
        for i, c in enumerate(getattr(md, "chunks", ()))
    }
    for index, loc in locations.items():
        md = sdm.get(index.fqn)
        if md is None:
            raise ManifestError(f"item {index.fqn!r} is not in the state dict metadata")
        if isinstance(md, TensorStorageMetadata):
            chunk = ordinal.get((index.fqn, tuple(index.offset or ())))
            if chunk is None:
                raise ManifestError(f"item {index.fqn!r} at {index.offset} is not a chunk of it")
            check_item_length(index.fqn, md, chunk, loc.length)
    planner_data = {
        str(k): tuple(p if isinstance(p, int) else str(p) for p in v)
        for k, v in body["planner_data"].items()
    }
    metadata = Metadata(
        state_dict_metadata=sdm,
        planner_data=planner_data,
        storage_data=dict(locations),
        storage_meta=StorageMeta(
            checkpoint_id=body["storage_meta"]["checkpoint_id"],
            save_id=body["storage_meta"]["save_id"],
        ),
        version=str(body["dcp_version"]),
    )
    return Manifest(
        step=str(body["step"]),
        save_id=str(body["save_id"]),
        world_size=int(body["world_size"]),
        committed_at_ns=int(body["committed_at_ns"]),
        files=files,
        nodes=[_ints(n, "node ranks") for n in body["nodes"]],
        metadata=metadata,
        locations=locations,
        promote=bool(body.get("promote", True)),
    )
