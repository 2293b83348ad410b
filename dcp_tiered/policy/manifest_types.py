"""What a parsed manifest is, whatever its format version. Pure: no I/O."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorProperties

from ..errors import ManifestError

FORMAT = "dcp-tiered-manifest"
SECTION_FORMAT = "dcp-tiered-manifest-section"
VERSION = 2  # an index and a section per node (1: one document, see manifest_v1)
SHARED = -1  # the section of the items every rank reads, whatever its node
# torch.save's archive around a tensor's own bytes: about 1.5 KiB (docs: item-format findings);
# a stored tensor item is never longer than its chunk's bytes plus this.
MAX_ITEM_FRAMING_BYTES = 1 << 20


@dataclass(frozen=True)
class ItemLocation:
    """Where one saved item lives; travels from each rank to the coordinator in WriteResults."""

    relative_path: str
    offset: int
    length: int
    checksum: str
    rank: int
    file_size: int
    file_checksum: str
    # Offset of a tensor's raw row-major bytes inside the item (torch.save's data record),
    # when the writer located them; None for byte items and for tensors read via torch.load.
    raw_offset: int | None = None


@dataclass(frozen=True)
class SectionRef:
    """One node's section of a version-2 manifest: its files and items, in a file of its own."""

    node: int
    name: str
    size: int
    checksum: str


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest.

    Version 2 keeps each node's files and items in a section of its own: ``files`` and
    ``locations`` (and ``metadata.storage_data``) hold those of the sections merged in so far
    (``loaded``); ``nodes_holding`` says which sections a set of items needs. A version-1
    manifest is one document and always ``complete``.
    """

    step: str
    save_id: str
    world_size: int
    committed_at_ns: int
    files: Mapping[str, Mapping[str, Any]]
    nodes: list[list[int]]  # ranks of each node; node 0 holds rank 0 (the coordinator)
    metadata: Metadata
    locations: Mapping[MetadataIndex, ItemLocation]
    # False: the step was meant to stay local (e.g. a checkpoint manager's remote cadence
    # skipped it), so nothing re-enqueues its promotion after a restart.
    promote: bool = True
    version: int = 1
    sections: Mapping[int, SectionRef] = field(default_factory=dict)
    loaded: frozenset[int] = frozenset()
    # Version 2: for each fqn, the rank that wrote each of its chunks (-1: none); the order of
    # ``metadata.state_dict_metadata`` gives the ids that sections refer to items by.
    writers: Mapping[str, list[int]] = field(default_factory=dict)
    fqns: tuple[str, ...] = ()
    run_id: str | None = None  # the run that saved it (None: saved before run ids)

    @property
    def complete(self) -> bool:
        return self.loaded >= set(self.sections)

    def node_of_rank(self, rank: int) -> int:
        for node, ranks in enumerate(self.nodes):
            if rank in ranks:
                return node
        raise ManifestError(f"rank {rank} is in no node of the manifest of {self.step}")

    def nodes_holding(self, indices: Iterable[MetadataIndex]) -> set[int]:
        """The nodes whose sections locate ``indices`` (none for a version-1 manifest)."""
        if not self.sections:
            return set()
        node_of = {r: n for n, ranks in enumerate(self.nodes) for r in ranks}
        out: set[int] = set()
        for index in indices:
            writers = self.writers.get(index.fqn)
            if not writers:
                raise ManifestError(f"item {index.fqn!r} is not in the manifest of {self.step}")
            if len(writers) == 1:  # replicated (one chunk) or bytes: in the shared section
                out.add(SHARED)
                continue
            rank = writers[chunk_ordinal(self.metadata, index)]
            if rank >= 0:
                out.add(node_of[rank])
        return out

    def missing(self, nodes: Iterable[int]) -> list[int]:
        return sorted(set(nodes) - self.loaded)

    def with_locations(
        self, node: int, files: Mapping[str, Mapping[str, Any]], locs: Mapping[Any, ItemLocation]
    ) -> Manifest:
        all_locs = {**self.locations, **locs}
        return dataclasses.replace(
            self,
            files={**self.files, **files},
            locations=all_locs,
            metadata=dataclasses.replace(self.metadata, storage_data=all_locs),
            loaded=self.loaded | {node},
        )


def chunk_ordinal(metadata: Metadata, index: MetadataIndex) -> int:
    """Which chunk of its tensor ``index`` names (0 for a bytes item). DCP's read items carry
    the ordinal as a hint; it is checked, and the chunks searched when it is wrong."""
    md = metadata.state_dict_metadata.get(index.fqn)
    chunks = getattr(md, "chunks", None)
    if chunks is None:
        return 0
    hint = index.index
    if hint is not None and 0 <= hint < len(chunks) and chunks[hint].offsets == index.offset:
        return hint
    for i, chunk in enumerate(chunks):
        if chunk.offsets == index.offset:
            return i
    raise ManifestError(f"item {index.fqn!r} at {index.offset} is not a chunk of its tensor")


# ---------------------------------------------------------------- tensor properties

_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_LAYOUTS = {str(x): x for x in (torch.strided, torch.sparse_coo)}
_MEMORY_FORMATS = {
    str(x): x for x in (torch.contiguous_format, torch.channels_last, torch.preserve_format)
}


def encode_properties(props: TensorProperties) -> dict[str, Any]:
    return {
        "dtype": str(props.dtype),
        "layout": str(props.layout),
        "requires_grad": bool(props.requires_grad),
        "memory_format": str(props.memory_format),
        "pin_memory": bool(props.pin_memory),
    }


def decode_properties(raw: Mapping[str, Any]) -> TensorProperties:
    return TensorProperties(
        dtype=_pick(_DTYPES, raw.get("dtype"), "dtype"),
        layout=_pick(_LAYOUTS, raw.get("layout"), "layout"),
        requires_grad=bool(raw.get("requires_grad")),
        memory_format=_pick(_MEMORY_FORMATS, raw.get("memory_format"), "memory format"),
        pin_memory=bool(raw.get("pin_memory")),
    )


def _pick(table: Mapping[str, Any], key: Any, what: str) -> Any:
    if key not in table:
        raise ManifestError(f"unknown {what} {key!r}")
    return table[key]


def check_item_length(fqn: str, md: Any, chunk: int, length: int) -> None:
    """A tensor item's stored length is its chunk's bytes (by the metadata's shape and dtype)
    plus torch.save's framing: refuse a longer one before any buffer is sized by it."""
    sizes = getattr(md, "chunks", None)
    if sizes is None:  # a bytes item: bounded by its file's size only
        return
    shape = md.chunks[chunk].sizes
    numel = 1
    for n in shape:
        numel *= n
    limit = numel * md.properties.dtype.itemsize + MAX_ITEM_FRAMING_BYTES
    if length > limit:
        raise ManifestError(
            f"item {fqn!r} is {length} bytes long, but a {md.properties.dtype} chunk of "
            f"{list(shape)} is stored in at most {limit}"
        )
