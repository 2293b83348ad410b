"""The step manifest: the source of truth for what a step contains. Pure: no I/O.

Version 2 is an **index** (``manifest.json``) plus one **section** per node
(``manifest.node-K.json``), so that a node holds, and a rank reads, the index and the sections
that hold its items, not every rank's:

- the index: step, save id, world size, nodes, versions, every tensor's properties and chunk
  geometry (a sharded tensor as its grid of splits), which rank wrote each chunk (as
  progressions: one triple for FSDP's rank ``i`` writing chunk ``i``), and each section's name,
  size and CRC32C. It is sealed: the CRC32C of its own bytes is its last member.
- a section: its node's data files (size, CRC32C, rank) and, per file, its items as columns
  (tensor id, chunk ordinal, length, CRC32C, raw offset); offsets follow from the lengths, as
  items are written back to back.

Readers build DCP's ``Metadata`` from these and never unpickle ``.metadata``. Version 1 (one
document with everything) is still read: :mod:`dcp_tiered.policy.manifest_v1`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .. import _gc
from ..errors import ManifestError
from . import identity, integrity, layout, manifest_codec, manifest_v1, records
from .manifest_types import (
    FORMAT,
    MAX_ITEM_FRAMING_BYTES,
    SHARED,
    ItemLocation,
    Manifest,
    SectionRef,
    check_item_length,
    chunk_ordinal,
    decode_properties,
    encode_properties,
)

__all__ = ["FORMAT", "SECTION_FORMAT", "VERSION", "Built", "ItemLocation", "Manifest"]
__all__ += [
    "SHARED",
    "SectionRef",
    "build",
    "chunk_ordinal",
    "needed_sections",
    "parse",
    "parse_section",
]

VERSION = 2
SECTION_FORMAT = "dcp-tiered-manifest-section"
_MAX_RANKS = 1 << 24
# Chunks of all tensors of one step: 14.4 M at 16,384 ranks of FSDP2 (docs/scale.md). Counts in
# a manifest are checked against this (and the tensor's own bounds) before they are expanded.
_MAX_ITEMS = 1 << 26
_HINT = "restore the step from another tier or an earlier step; do not edit manifests by hand"


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
    tid, ordinal, chunks_of, entries, props = _described(metadata)
    writers = {fqn: [-1] * len(chunks_of.get(fqn, [None])) for fqn in tid}
    node_of = {r: n for n, ranks in enumerate(nodes) for r in ranks}
    by_file: dict[str, list[tuple[int, int, ItemLocation]]] = {}
    for index, loc in locations.items():
        fqn = index.fqn
        at = ordinal.get((fqn, index.offset))
        if at is None:
            raise ManifestError(f"item {fqn!r} at {index.offset} is not in the metadata")
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
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
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
        "tensors": [
            [fqn, entry, manifest_codec.progressions(writers[fqn])]
            for fqn, entry in entries.items()
        ],
        "properties": props,
        "planner_data": {fqn: list(path) for fqn, path in planner_data.items()},
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
    return Built(manifest_codec.seal(index_body), sections)


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


# ---------------------------------------------------------------- parse


@dataclass(frozen=True)
class ManifestHead:
    """What listing a step needs of its manifest: whose save of which step, and when."""

    step: str
    save_id: str
    run_id: str | None
    committed_at_ns: int
    world_size: int
    promote: bool


@_gc.paused_during  # the index is still one object per chunk to the JSON decoder
def parse_head(data: bytes, *, where: str) -> ManifestHead:
    """A manifest's head, checked as :func:`parse` checks it (seal, format, version, the head's
    own fields), without decoding its index: listing a root of steps of 20,000 tensors each
    must not cost a full parse per step. The index is decoded, and refused if malformed, by
    whatever reads the step's data (a load, ``verify``, a promotion)."""
    if not manifest_codec.is_sealed(data):
        return _head_of(manifest_v1.parse(data, where=where))
    body = _sealed_body(data, where)
    try:
        world_size = body["world_size"]
        if type(world_size) is not int or not 0 < world_size <= _MAX_RANKS:
            raise ManifestError(f"world size {world_size!r} is out of range")
        return ManifestHead(
            step=str(body["step"]),
            save_id=str(body["save_id"]),
            run_id=_run_id(body.get("run_id")),
            committed_at_ns=int(body["committed_at_ns"]),
            world_size=world_size,
            promote=bool(body.get("promote", True)),
        )
    except ManifestError as e:
        raise ManifestError(f"{where}: {e}; {_HINT}") from e
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise ManifestError(f"{where}: malformed manifest ({e!r}); {_HINT}") from e


def _head_of(m: Manifest) -> ManifestHead:
    return ManifestHead(m.step, m.save_id, m.run_id, m.committed_at_ns, m.world_size, m.promote)


def _sealed_body(data: bytes, where: str) -> dict[str, Any]:
    """The JSON object of a sealed (version-2) index, its seal, format and version checked."""
    if not manifest_codec.unseal(data):
        raise ManifestError(f"{where}: manifest checksum mismatch (file was modified); {_HINT}")
    body = _load(data, where)
    if body.get("format") != FORMAT:
        raise ManifestError(f"{where}: not a dcp_tiered manifest; {_HINT}")
    if body.get("version") != VERSION:
        raise ManifestError(
            f"{where}: manifest version {body.get('version')!r} is not supported by this "
            f"dcp_tiered (reads versions 1 and {VERSION}); upgrade dcp_tiered"
        )
    return body


@_gc.paused_during  # one object per chunk of every tensor: see _gc
def parse(data: bytes, *, where: str) -> Manifest:
    """Parse and validate a manifest (a version-2 index, or a version-1 document). A
    version-2 manifest comes back without sections: merge them with :func:`parse_section`."""
    if not manifest_codec.is_sealed(data):
        return manifest_v1.parse(data, where=where)
    body = _sealed_body(data, where)
    try:
        return _decode_index(body)
    except ManifestError as e:
        raise ManifestError(f"{where}: {e}; {_HINT}") from e
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError) as e:
        raise ManifestError(f"{where}: malformed manifest ({e!r}); {_HINT}") from e


def _load(data: bytes, where: str) -> dict[str, Any]:
    """The JSON object of an index or section, under the guards every record read back gets."""
    try:
        return records.load_json(data, where=where, max_bytes=records.MAX_MANIFEST_BYTES)
    except ManifestError as e:
        raise ManifestError(f"{e}; {_HINT}") from e


def _decode_index(body: dict[str, Any]) -> Manifest:
    world_size = body["world_size"]
    if type(world_size) is not int or not 0 < world_size <= _MAX_RANKS:
        raise ManifestError(f"world size {world_size!r} is out of range")
    nodes = [[int(r) for r in n] for n in body["nodes"]]
    ranks_listed = sorted(r for n in nodes for r in n)
    if len(ranks_listed) != world_size or ranks_listed != list(range(world_size)):
        raise ManifestError(f"nodes {nodes} do not cover ranks 0..{world_size - 1}")
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    writers: dict[str, list[int]] = {}
    props = [decode_properties(p) for p in body["properties"]]
    budget = _MAX_ITEMS  # chunks of every tensor together: counts are checked against it
    for fqn, entry, ranks in body["tensors"]:
        fqn = str(fqn)
        sdm[fqn] = _decode_entry(entry, fqn, props, budget)
        count = len(getattr(sdm[fqn], "chunks", [None]))
        budget -= count
        writers[fqn] = manifest_codec.unprogressions(
            ranks, f"writers of {fqn!r}", length=count, low=-1, high=world_size
        )
    sections = {}
    for node, name, size, checksum in body["sections"]:
        if name != layout.manifest_section_name(node) or not SHARED <= node < len(nodes):
            raise ManifestError(f"section {name!r} of node {node} is not a section name")
        sections[int(node)] = SectionRef(int(node), str(name), int(size), str(checksum))
    metadata = Metadata(
        state_dict_metadata=sdm,
        planner_data={
            str(k): tuple(p if isinstance(p, int) else str(p) for p in v)
            for k, v in body["planner_data"].items()
        },
        storage_data={},
        storage_meta=StorageMeta(
            checkpoint_id=body["storage_meta"]["checkpoint_id"],
            save_id=body["storage_meta"]["save_id"],
        ),
        version=str(body["dcp_version"]),
    )
    return Manifest(
        step=str(body["step"]),
        save_id=str(body["save_id"]),
        world_size=world_size,
        committed_at_ns=int(body["committed_at_ns"]),
        files={},
        nodes=nodes,
        metadata=metadata,
        locations={},
        promote=bool(body.get("promote", True)),
        version=VERSION,
        sections=sections,
        writers=writers,
        fqns=tuple(sdm),
        run_id=_run_id(body.get("run_id")),
    )


def _run_id(value: Any) -> str | None:
    if value is None or identity.is_run_id(value):
        return value
    raise ManifestError(f"run_id {value!r} is not a run id")


def _decode_entry(
    raw: Any, fqn: str, props: list[TensorProperties], max_chunks: int
) -> TensorStorageMetadata | BytesStorageMetadata:
    if not isinstance(raw, dict) or raw.get("type") not in ("tensor", "bytes"):
        raise ManifestError(f"bad entry for {fqn!r}: {raw!r}")
    if raw["type"] == "bytes":
        return BytesStorageMetadata()
    size = raw.get("size")
    if not isinstance(size, list) or not all(type(v) is int and v >= 0 for v in size):
        raise ManifestError(f"{fqn!r}: bad size {size!r}")
    chunks = manifest_codec.decode_chunks(
        raw, size, f"chunks of {fqn!r}", max_chunks=max(max_chunks, 0)
    )
    which = raw.get("props")
    if type(which) is not int or not 0 <= which < len(props):
        raise ManifestError(f"{fqn!r}: bad properties reference {which!r}")
    return TensorStorageMetadata(
        properties=props[which],
        size=torch.Size(size),
        chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )


@_gc.paused_during
def parse_section(m: Manifest, node: int, data: bytes, *, where: str) -> Manifest:
    """``m`` with node ``node``'s section merged in, after checking it is the one the index
    names (size and CRC32C) and that every item in it is where the index says."""
    ref = m.sections.get(node)
    if ref is None:
        raise ManifestError(f"{where}: the manifest of {m.step} has no section for node {node}")
    crc = integrity.format_checksum(integrity.checksum(data))
    if len(data) != ref.size or crc != ref.checksum:
        raise ManifestError(
            f"{where}: section of node {node} does not match the index ({len(data)} bytes, "
            f"{integrity.ALGORITHM} {crc}; index says {ref.size} bytes, {ref.checksum}); {_HINT}"
        )
    body = _load(data, where)
    try:
        if (
            body.get("format") != SECTION_FORMAT
            or body.get("version") != VERSION
            or (body.get("step"), body.get("save_id"), body.get("node"))
            != (m.step, m.save_id, node)
        ):
            raise ManifestError("not this step's section of this node")
        files: dict[str, dict[str, Any]] = {}
        locs: dict[MetadataIndex, ItemLocation] = {}
        for entry in body["files"]:
            _decode_file(m, node, entry, files, locs)
    except ManifestError as e:
        raise ManifestError(f"{where}: {e}; {_HINT}") from e
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError) as e:
        raise ManifestError(f"{where}: malformed manifest section ({e!r}); {_HINT}") from e
    return m.with_locations(node, files, locs)


def _decode_file(
    m: Manifest,
    node: int,
    entry: dict[str, Any],
    files: dict[str, dict[str, Any]],
    locs: dict[MetadataIndex, ItemLocation],
) -> None:
    name, size, rank = str(entry["name"]), int(entry["size"]), int(entry["rank"])
    if "/" in name or name.startswith(".") or name in files:
        raise ManifestError(f"unsafe or repeated file name {name!r}")
    if not (0 <= rank < m.world_size if node == SHARED else rank in m.nodes[node]) or size < 0:
        raise ManifestError(f"file {name!r} of rank {rank} (size {size}) is not node {node}'s")
    checksum = str(entry["checksum"])
    if name in m.files and (m.files[name]["size"], m.files[name]["checksum"]) != (size, checksum):
        raise ManifestError(f"file {name!r} has another size or checksum in another section")
    files[name] = {"size": size, "checksum": checksum, "rank": rank}
    ids, chunks, lengths, raws = entry["ids"], entry["chunks"], entry["lengths"], entry["raw"]
    crcs = str(entry["crcs"])
    count = len(ids)
    offsets = entry.get("offsets")
    if not len(chunks) == len(lengths) == len(raws) == count or len(crcs) != 8 * count:
        raise ManifestError(f"file {name!r}: item columns of different lengths")
    if offsets is not None and len(offsets) != count:
        raise ManifestError(f"file {name!r}: item columns of different lengths")
    pos = int(entry.get("start", 0))
    for i in range(count):
        fqn = m.fqns[ids[i]] if 0 <= ids[i] < len(m.fqns) else None
        if fqn is None or not 0 <= chunks[i] < len(m.writers[fqn]):
            raise ManifestError(f"file {name!r}: item {i} names no chunk of the index")
        if m.writers[fqn][chunks[i]] != rank or (len(m.writers[fqn]) == 1) != (node == SHARED):
            raise ManifestError(f"file {name!r}: {fqn!r} was not written by rank {rank} here")
        md = m.metadata.state_dict_metadata[fqn]
        offset = int(offsets[i]) if offsets is not None else pos
        length, raw = int(lengths[i]), int(raws[i])
        if offset < 0 or length < 0 or offset + length > size or not -1 <= raw < max(length, 1):
            raise ManifestError(f"item {fqn!r} lies outside {name!r} or its raw offset is bad")
        if length > MAX_ITEM_FRAMING_BYTES:  # any shorter one is within any tensor's bound
            check_item_length(fqn, md, chunks[i], length)
        if isinstance(md, TensorStorageMetadata):
            index = MetadataIndex(fqn, md.chunks[chunks[i]].offsets, chunks[i])
        else:
            index = MetadataIndex(fqn)
        locs[index] = ItemLocation(
            relative_path=name,
            offset=offset,
            length=length,
            checksum=crcs[8 * i : 8 * i + 8],
            rank=rank,
            file_size=size,
            file_checksum=checksum,
            raw_offset=None if raw < 0 else raw,
        )
        pos = offset + length


def needed_sections(m: Manifest, indices: Any) -> list[int]:
    """The sections not yet merged into ``m`` that locate ``indices``."""
    return m.missing(m.nodes_holding(indices))
