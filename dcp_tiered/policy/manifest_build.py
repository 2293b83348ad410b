"""Building a step's manifest (its index and a section per node) from DCP's metadata and where
the writer put each item. Pure: no I/O. The format is described in
:mod:`dcp_tiered.policy.manifest`, which parses it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..errors import ManifestError
from . import integrity, layout, manifest_codec
from .manifest_types import (
    FORMAT,
    SECTION_FORMAT,
    SHARED,
    VERSION,
    ItemLocation,
    encode_properties,
)


@dataclass(frozen=True)
class Built:
    """A serialised manifest: the index and each node's section, by file name."""

    index: bytes
    sections: dict[int, bytes]

    def files_for(self, node: int | None) -> dict[str, bytes]:
        """The manifest files a node's directory holds (``None``: all, as the remote does)."""
        nodes = self.sections if node is None else [SHARED, node]
        out = {layout.manifest_section_name(n): self.sections[n] for n in nodes}
        out[layout.MANIFEST_NAME] = self.index  # last: a reader trusts sections through it
        return out


# ---------------------------------------------------------------- build


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
    run_id: str | None = None,
) -> Built:
    """Serialise the manifest of ``metadata`` whose items were written at ``locations``."""
    tid, ordinal, chunks_of, _, _ = _described(metadata)
    writers = {fqn: [-1] * len(chunks_of.get(fqn, [None])) for fqn in tid}
    node_of = {r: n for n, ranks in enumerate(nodes) for r in ranks}
    by_file: dict[str, list[tuple[int, int, ItemLocation]]] = {}
    for key, loc in locations.items():
        fqn = key.fqn
        at = ordinal.get((fqn, key.offset))
        if at is None:
            raise ManifestError(f"item {fqn!r} at {key.offset} is not in the metadata")
        writers[fqn][at] = loc.rank
        by_file.setdefault(loc.relative_path, []).append((tid[fqn], at, loc))
    # Items every rank reads (one-chunk tensors and bytes items: replicated state that DCP
    # spread over the ranks) go in the shared section, the chunks of sharded tensors in the
    # writer's node's section: so a rank reads the shared section and its own node's.
    files_of: dict[int, list[dict[str, Any]]] = {n: [] for n in [SHARED, *range(len(nodes))]}
    one_chunk = {tid[fqn] for fqn, w in writers.items() if len(w) == 1}
    for name in sorted(by_file):
        rows = sorted(by_file[name], key=lambda r: r[2].offset)
        shared = [r for r in rows if r[0] in one_chunk]
        own = [r for r in rows if r[0] not in one_chunk]
        for node, part in ((SHARED, shared), (node_of[rows[0][2].rank], own)):
            if part:
                files_of[node].append(_encode_file(name, part))
    sections = {
        node: json.dumps(
            {
                "format": SECTION_FORMAT,
                "version": VERSION,
                "step": step,
                "save_id": save_id,
                "node": node,
                "files": files,
            },
            separators=(",", ":"),
            ensure_ascii=False,
        ).encode()
        for node, files in files_of.items()
    }
    storage_meta = metadata.storage_meta
    index_body = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "save_id": save_id,
        "world_size": world_size,
        "nodes": nodes,
        "committed_at_ns": committed_at_ns,
        "promote": promote,
        **({"run_id": run_id} if run_id is not None else {}),
        "versions": dict(versions),
        "checksum_algorithm": integrity.ALGORITHM,
        "dcp_version": metadata.version,
        "storage_meta": {
            "checkpoint_id": str(storage_meta.checkpoint_id) if storage_meta else step,
            "save_id": storage_meta.save_id if storage_meta else save_id,
        },
        "sections": [
            [
                node,
                layout.manifest_section_name(node),
                len(data),
                integrity.format_checksum(integrity.checksum(data)),
            ]
            for node, data in sections.items()
        ],
    }
    # the members only the structure decides, spliced in as JSON (see tensors_fragment)
    head = json.dumps(index_body, separators=(",", ":"), ensure_ascii=False)
    index = f"{head[:-1]},{tensors_fragment(metadata, writers)}}}"
    return Built(manifest_codec.seal_text(index), sections)


# (state_dict_metadata, planner_data, writers, fragment) of the last index: DCP's plan caching
# hands every save of one structure the same metadata objects (20,000 tensors: 40 ms a save)
_fragment_last: tuple[Any, Any, dict[str, list[int]], str] | None = None


def tensors_fragment(metadata: Metadata, writers: dict[str, list[int]]) -> str:
    """The index's members that only the state's structure decides (its tensors, their
    properties, the flattening's paths, which ranks wrote each chunk), as JSON text to splice
    in; the last one again for the same metadata objects and writers."""
    global _fragment_last
    last = _fragment_last  # one read: another thread's save may replace it
    sdm, planner_data = metadata.state_dict_metadata, metadata.planner_data
    if last is not None and last[0] is sdm and last[1] is planner_data and last[2] == writers:
        return last[3]
    fragment = _fragment(metadata, writers)
    _fragment_last = (sdm, planner_data, writers, fragment)
    return fragment


def _fragment(metadata: Metadata, writers: Mapping[str, list[int]]) -> str:
    _, _, _, entries, props = _described(metadata)
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    members = {
        "tensors": [
            [fqn, entry, manifest_codec.progressions(writers[fqn])]
            for fqn, entry in entries.items()
        ],
        "properties": props,
        "planner_data": {fqn: list(path) for fqn, path in planner_data.items()},
    }
    return json.dumps(members, separators=(",", ":"), ensure_ascii=False)[1:-1]


_described_last: tuple[Any, tuple[Any, ...]] | None = None  # (state_dict_metadata, its description)


def _described(metadata: Metadata) -> tuple[Any, ...]:
    """What the manifest says of ``metadata``'s tensors whoever wrote them: ids, chunk
    ordinals, chunks in row-major order, encoded entries, distinct properties. Kept for the
    last metadata object: DCP's plan caching hands the same one to every save of a
    structure, whose manifests then skip this per-item work."""
    global _described_last
    sdm = metadata.state_dict_metadata
    last = _described_last  # one read: another thread's save may replace it
    if last is not None and last[0] is sdm:
        return last[1]
    tid = {fqn: i for i, fqn in enumerate(sdm)}
    ordinal: dict[tuple[str, Any], int] = {}
    # Each tensor's chunks in row-major order of their offsets, whatever order DCP's plans
    # gave them (TP + FSDP on one dim interleaves them by rank): so a sharded tensor is always
    # its grid of splits, and its writers a few progressions.
    chunks_of: dict[str, list[Any]] = {}
    for fqn, md in sdm.items():
        if isinstance(md, TensorStorageMetadata):
            chunks_of[fqn] = sorted(md.chunks, key=lambda c: c.offsets)
        for i, c in enumerate(chunks_of.get(fqn, [None])):  # torch.Size hashes as a tuple
            ordinal[(fqn, c.offsets if c is not None else None)] = i
    props: list[dict[str, Any]] = []  # each distinct set of tensor properties, once
    entries = {fqn: _encode_entry(md, chunks_of.get(fqn, []), props) for fqn, md in sdm.items()}
    described = (tid, ordinal, chunks_of, entries, props)
    _described_last = (sdm, described)
    return described


def _encode_entry(
    md: TensorStorageMetadata | BytesStorageMetadata,
    chunks: list[ChunkStorageMetadata],
    props: list[dict[str, Any]],
) -> dict[str, Any]:
    if isinstance(md, BytesStorageMetadata):
        return {"type": "bytes"}
    encoded = encode_properties(md.properties)
    if encoded not in props:
        props.append(encoded)
    return {
        "type": "tensor",
        "props": props.index(encoded),
        "size": list(md.size),
        **manifest_codec.encode_chunks(md.size, [(c.offsets, c.sizes) for c in chunks]),
    }


def _encode_file(name: str, rows: list[tuple[int, int, ItemLocation]]) -> dict[str, Any]:
    first = rows[0][2]
    entry: dict[str, Any] = {
        "name": name,
        "size": first.file_size,
        "checksum": first.file_checksum,
        "rank": first.rank,
        "ids": [r[0] for r in rows],
        "chunks": [r[1] for r in rows],
        "lengths": [r[2].length for r in rows],
        "crcs": "".join(r[2].checksum for r in rows),
        "raw": [-1 if r[2].raw_offset is None else r[2].raw_offset for r in rows],
    }
    pos, offsets = first.offset, []
    for _, _, loc in rows:
        offsets.append(loc.offset)
        pos = loc.offset + loc.length if pos == loc.offset else -1
    if pos < 0:  # not back to back: say where each item starts
        entry["offsets"] = offsets
    elif first.offset:
        entry["start"] = first.offset
    return entry
