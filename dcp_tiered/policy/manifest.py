"""The step manifest: the source of truth for what a step contains. Pure: no I/O.

Version 3 (as 2) is an **index** (``manifest.json``) plus one **section** per node
(``manifest.node-K.json``), so that a node holds, and a rank reads, the index and the sections
that hold its items, not every rank's:

- the index: step, save id, world size, nodes, versions, every tensor's properties and chunk
  geometry (a sharded tensor as its grid of splits), which rank wrote each chunk (as
  progressions: one triple for FSDP's rank ``i`` writing chunk ``i``), and each section's name,
  size and CRC32C. It is sealed: the CRC32C of its own bytes is its last member. Version 3
  writes the tensors saved whole by one rank as columns against a table of shapes
  (:mod:`dcp_tiered.policy.manifest_index`); version 2 wrote an entry per tensor
  (:mod:`dcp_tiered.policy.manifest_entries`) and is still read.
- a section: its node's data files (size, CRC32C, rank) and, per file, its items as columns
  (tensor id, chunk ordinal, length, CRC32C, raw offset); offsets follow from the lengths, as
  items are written back to back.

Readers build DCP's ``Metadata`` from these and never unpickle ``.metadata``. Version 1 (one
document with everything) is still read: :mod:`dcp_tiered.policy.manifest_v1`. This module
parses; :mod:`dcp_tiered.policy.manifest_build` builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)

from .. import _gc
from ..errors import ManifestError
from . import (
    identity,
    layout,
    manifest_codec,
    manifest_columns,
    manifest_entries,
    manifest_index,
    manifest_v1,
    records,
)
from .manifest_types import (
    FORMAT,
    REPAIR_HINT,
    SECTION_FORMAT,
    SHARED,
    VERSION,
    ItemLocation,
    Manifest,
    SectionLocations,
    SectionRef,
    chunk_ordinal,
    decode_properties,
)

__all__ = ["FORMAT", "SECTION_FORMAT", "VERSION", "ItemLocation", "Manifest", "ManifestHead"]
__all__ += ["SHARED", "SectionRef", "chunk_ordinal", "needed_sections", "parse", "parse_head"]
__all__ += ["parse_section"]

_MAX_RANKS = 1 << 24
# Chunks of all tensors of one step: 14.4 M at 16,384 ranks of FSDP2 (docs/scale.md). Counts in
# a manifest are checked against this (and the tensor's own bounds) before they are expanded.
_MAX_ITEMS = 1 << 26
_INDEX_VERSIONS = (2, VERSION)  # 2: an entry per tensor (manifest_entries); 3: columns
_HINT = REPAIR_HINT


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
        return _head_of(manifest_v1.parse(data, where=where, sealed=_INDEX_VERSIONS))
    body = _sealed_body(data, where, head_only=True)
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


def _sealed_body(data: bytes, where: str, *, head_only: bool = False) -> dict[str, Any]:
    """The JSON object of a sealed (version-2) index, its seal, format and version checked.
    ``head_only``: only its members before the tensors (where the writer puts them all), the
    index itself never decoded: a cold listing of a 20,000-tensor step read the whole index
    once for its head and once more for the restore. A member that comes again later with
    another value is refused by :func:`parse`, so both always agree."""
    if not manifest_codec.unseal(data):
        raise ManifestError(f"{where}: manifest checksum mismatch (file was modified); {_HINT}")
    head = _head_members(data, where) if head_only else None
    if head is not None and not _HEAD_KEYS <= head.keys():  # one after the index: read all
        head = None
    body = head if head is not None else _load(data, where)
    if body.get("format") != FORMAT:
        raise ManifestError(f"{where}: not a dcp_tiered manifest; {_HINT}")
    if body.get("version") not in _INDEX_VERSIONS:
        raise ManifestError(
            f"{where}: manifest version {body.get('version')!r} is not supported by this "
            f"dcp_tiered (reads versions 1 to {VERSION}); upgrade dcp_tiered"
        )
    return body


@_gc.paused_during  # one object per chunk of every tensor: see _gc
def parse(data: bytes, *, where: str) -> Manifest:
    """Parse and validate a manifest (a version-2 index, or a version-1 document). A
    version-2 manifest comes back without sections: merge them with :func:`parse_section`."""
    if not manifest_codec.is_sealed(data):
        return manifest_v1.parse(data, where=where, sealed=_INDEX_VERSIONS)
    body = _sealed_body(data, where)
    head = _head_members(data, where)
    if head is not None and any(body.get(k) != v for k, v in head.items()):
        raise ManifestError(
            f"{where}: a member of the manifest's head comes again with another value; {_HINT}"
        )
    try:
        return _decode_index(body)
    except ManifestError as e:
        raise ManifestError(f"{where}: {e}; {_HINT}") from e
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError) as e:
        raise ManifestError(f"{where}: malformed manifest ({e!r}); {_HINT}") from e


# Every member a head is read from (this version's writer puts them all before the tensors)
_HEAD_KEYS = frozenset(
    ("format", "version", "step", "save_id", "world_size", "committed_at_ns", "promote", "run_id")
)


def _head_members(data: bytes, where: str) -> dict[str, Any] | None:
    try:
        return records.load_json_members(
            data, where=where, max_bytes=records.MAX_MANIFEST_BYTES, stop_at="tensors"
        )
    except ManifestError as e:
        raise ManifestError(f"{e}; {_HINT}") from e


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
    props = [decode_properties(p) for p in body["properties"]]
    if body["version"] == VERSION:
        sdm, writers = manifest_index.decode(body["tensors"], props, world_size, _MAX_ITEMS)
        planner_data = manifest_index.decode_paths(body["planner_data"], list(sdm))
    else:
        sdm, writers = _decode_v2_tensors(body["tensors"], props, world_size)
        planner_data = {
            str(k): manifest_entries.path_of(v) for k, v in body["planner_data"].items()
        }
    sections = {}
    for node, name, size, checksum in body["sections"]:
        if name != layout.manifest_section_name(node) or not SHARED <= node < len(nodes):
            raise ManifestError(f"section {name!r} of node {node} is not a section name")
        sections[int(node)] = SectionRef(int(node), str(name), int(size), str(checksum))
    metadata = Metadata(
        state_dict_metadata=sdm,
        planner_data=planner_data,
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
        version=body["version"],
        sections=sections,
        writers=writers,
        fqns=tuple(sdm),
        run_id=_run_id(body.get("run_id")),
    )


def _decode_v2_tensors(
    tensors: Any, props: list[Any], world_size: int
) -> tuple[dict[str, TensorStorageMetadata | BytesStorageMetadata], dict[str, list[int]]]:
    """Each key's metadata and writers from a version-2 index: an entry per tensor."""
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    writers: dict[str, list[int]] = {}
    budget = _MAX_ITEMS  # chunks of every tensor together: counts are checked against it
    shapes: dict[tuple[int, ...], manifest_entries.Shape] = {}
    for fqn, entry, ranks in tensors:
        fqn = str(fqn)
        whole = manifest_entries.whole_tensor(entry, ranks, props, world_size, shapes)
        if whole is not None:  # most entries of a state: checked as strictly, in fewer steps
            sdm[fqn], writers[fqn] = whole
            budget -= 1
            continue
        sdm[fqn] = manifest_entries.decode_entry(entry, fqn, props, budget)
        count = len(getattr(sdm[fqn], "chunks", [None]))
        budget -= count
        writers[fqn] = manifest_codec.unprogressions(
            ranks, f"writers of {fqn!r}", length=count, low=-1, high=world_size
        )
    return sdm, writers


def _run_id(value: Any) -> str | None:
    if value is None or identity.is_run_id(value):
        return value
    raise ManifestError(f"run_id {value!r} is not a run id")


@_gc.paused_during
def parse_section(m: Manifest, node: int, data: bytes, *, where: str) -> Manifest:
    """``m`` with node ``node``'s section merged in, after checking it is the one the index
    names (size and CRC32C) and that every item in it is where the index says."""
    files, columns = manifest_columns.section_columns(m, node, data, where=where)
    return m.with_locations(node, files, SectionLocations(m, columns))


def needed_sections(m: Manifest, indices: Any) -> list[int]:
    """The sections not yet merged into ``m`` that locate ``indices``."""
    return m.missing(m.nodes_holding(indices))
