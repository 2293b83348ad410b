"""Building a step's manifest (its index and a section per node) from DCP's metadata and where
the writer put each item. Pure: no I/O. The format is described in
:mod:`dcp_tiered.policy.manifest`, which parses it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..errors import ManifestError
from . import integrity, layout, manifest_codec, manifest_index
from .manifest_types import (
    FORMAT,
    SECTION_FORMAT,
    SECTION_VERSION,
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


class FileColumns(Protocol):
    """One data file and its items as columns (the writer's ``FileItems``): item ``k`` is
    ``keys[k]`` = (fqn, chunk offset, index) at ``offsets[k]``, ``lengths[k]`` bytes long,
    its CRC32C the 8 hex digits at ``checksums[8k:8k+8]``."""

    @property
    def name(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def file_size(self) -> int: ...
    @property
    def file_checksum(self) -> str: ...
    @property
    def keys(self) -> Sequence[tuple[str, Any, Any]]: ...
    @property
    def offsets(self) -> list[int]: ...
    @property
    def lengths(self) -> list[int]: ...
    @property
    def checksums(self) -> str: ...
    @property
    def raw_offsets(self) -> list[int | None]: ...


@dataclass
class _Columns:
    """FileColumns of per-item locations (``build``'s callers that have no columns)."""

    name: str
    rank: int
    file_size: int
    file_checksum: str
    keys: list[tuple[str, Any, Any]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    checksums: str = ""
    raw_offsets: list[int | None] = field(default_factory=list)


@dataclass(frozen=True)
class FilePlan:
    """What a manifest's sections hold that only the files' layouts decide (which items of
    which file go in which section, in what order): one per structure, kept by the writer
    for the next save of the same layouts (:func:`build_files`'s ``plan``)."""

    writers: dict[str, list[int]]
    # node -> each file's (name, its entry's members before "crcs" and after it as JSON text,
    # its items' positions)
    parts: dict[int, list[tuple[str, tuple[str, str], list[int] | slice]]]


def build(*, locations: Mapping[MetadataIndex, ItemLocation], **kwargs: Any) -> Built:
    """Serialise the manifest of ``metadata`` whose items were written at ``locations``
    (see :func:`build_files` for the other arguments)."""
    files: dict[str, _Columns] = {}
    for key, loc in sorted(locations.items(), key=lambda kv: kv[1].offset):
        f = files.get(loc.relative_path)
        if f is None:
            f = files[loc.relative_path] = _Columns(
                loc.relative_path, loc.rank, loc.file_size, loc.file_checksum
            )
        offset = None if key.offset is None else tuple(key.offset)
        f.keys.append((key.fqn, offset, key.index))
        f.offsets.append(loc.offset)
        f.lengths.append(loc.length)
        f.checksums += loc.checksum
        f.raw_offsets.append(loc.raw_offset)
    return build_files(files=list(files.values()), **kwargs)[0]


def build_files(
    *,
    step: str,
    save_id: str,
    world_size: int,
    nodes: list[list[int]],
    committed_at_ns: int,
    metadata: Metadata,
    files: Sequence[FileColumns],
    versions: Mapping[str, str],
    promote: bool = True,
    run_id: str | None = None,
    plan: FilePlan | None = None,
) -> tuple[Built, FilePlan]:
    """Serialise the manifest of ``metadata`` whose items were written into ``files``;
    ``plan``: the one returned for the same metadata, nodes and file layouts (the same
    names, ranks, keys, offsets, lengths and raw offsets), which skips the per-item work."""
    if plan is None:
        plan = plan_files(metadata, files, nodes)
    by_name = {f.name: f for f in files}
    writers = plan.writers
    sections = {
        node: _section(
            {
                "format": SECTION_FORMAT,
                "version": SECTION_VERSION,
                "step": step,
                "save_id": save_id,
                "node": node,
            },
            [_entry(by_name[name], fixed, at) for name, fixed, at in plan.parts[node]],
        )
        for node in plan.parts
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
    return Built(manifest_codec.seal_text(index), sections), plan


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
    members = {
        "tensors": manifest_index.encode(entries, writers),
        "properties": props,
        "planner_data": manifest_index.encode_paths(list(entries), metadata.planner_data),
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


def plan_files(
    metadata: Metadata, files: Sequence[FileColumns], nodes: list[list[int]]
) -> FilePlan:
    """Which items of each file go in which section, in file order (see :class:`FilePlan`)."""
    tid, ordinal, chunks_of, _, _ = _described(metadata)
    writers = {fqn: [-1] * len(chunks_of.get(fqn, [None])) for fqn in tid}
    node_of = {r: n for n, ranks in enumerate(nodes) for r in ranks}
    rows_of: dict[str, list[tuple[int, int, int]]] = {}  # file -> (tensor id, chunk, position)
    for f in files:
        rows = rows_of.setdefault(f.name, [])
        for k, (fqn, offset, _) in enumerate(f.keys):
            at = ordinal.get((fqn, offset))
            if at is None:
                raise ManifestError(f"item {fqn!r} at {offset} is not in the metadata")
            writers[fqn][at] = f.rank
            rows.append((tid[fqn], at, k))
    # Items every rank reads (one-chunk tensors and bytes items: replicated state that DCP
    # spread over the ranks) go in the shared section, the chunks of sharded tensors in the
    # writer's node's section: so a rank reads the shared section and its own node's.
    parts: dict[int, list[Any]] = {n: [] for n in [SHARED, *range(len(nodes))]}
    one_chunk = {tid[fqn] for fqn, w in writers.items() if len(w) == 1}
    by_name = {f.name: f for f in files}
    for name in sorted(rows_of):
        f = by_name[name]
        rows = sorted(rows_of[name], key=lambda r: f.offsets[r[2]])
        shared = [r for r in rows if r[0] in one_chunk]
        own = [r for r in rows if r[0] not in one_chunk]
        for node, part in ((SHARED, shared), (node_of[f.rank], own)):
            if part:
                parts[node].append(_file_part(f, part))
    return FilePlan(writers, parts)


def _file_part(
    f: FileColumns, rows: list[tuple[int, int, int]]
) -> tuple[str, tuple[str, str], list[int] | slice]:
    at = [r[2] for r in rows]
    before = {
        "rank": f.rank,
        "ids": [r[0] for r in rows],
        "chunks": [r[1] for r in rows],
        "lengths": [f.lengths[k] for k in at],
    }
    after: dict[str, Any] = {
        "raw": [-1 if f.raw_offsets[k] is None else f.raw_offsets[k] for k in at]
    }
    first = f.offsets[at[0]]
    pos, offsets = first, []
    for k in at:
        offsets.append(f.offsets[k])
        pos = f.offsets[k] + f.lengths[k] if pos == f.offsets[k] else -1
    if pos < 0:  # not back to back: say where each item starts
        after["offsets"] = offsets
    elif first:
        after["start"] = first
    in_order = at == list(range(at[0], at[0] + len(at)))
    fixed = (_members(before), _members(after))
    return f.name, fixed, slice(8 * at[0], 8 * (at[0] + len(at))) if in_order else at


# JSON as json.dumps writes it here: compact, UTF-8 as it is
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _members(members: dict[str, Any]) -> str:
    """``members`` as the JSON text between an object's braces."""
    return _encode(members)[1:-1]


def _section(head: dict[str, Any], entries: list[str]) -> bytes:
    """``head`` with a last member ``files``, the list of ``entries`` (JSON texts)."""
    return f'{_encode(head)[:-1]},"files":[{",".join(entries)}]}}'.encode()


def _entry(f: FileColumns, fixed: tuple[str, str], at: list[int] | slice) -> str:
    """A file's entry in a section, as JSON: its name, size and checksum, the members only
    the layout decides (``fixed``: those before its items' CRCs, those after, as JSON text
    made once per layout: 20,000 items, 30 -> 5 ms a save), and the CRCs."""
    if isinstance(at, slice):
        crcs = f.checksums[at]
    else:
        crcs = "".join(f.checksums[8 * k : 8 * k + 8] for k in at)
    before, after = fixed
    head = _members({"name": f.name, "size": f.file_size, "checksum": f.file_checksum})
    return "{" + ",".join(p for p in (head, before, _members({"crcs": crcs}), after) if p) + "}"
