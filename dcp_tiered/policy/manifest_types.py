"""What a parsed manifest is, whatever its format version. Pure: no I/O."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorProperties

from ..errors import ManifestError

FORMAT = "dcp-tiered-manifest"
SECTION_FORMAT = "dcp-tiered-manifest-section"
# 3: an index (its tensors as columns: manifest_index) and a section per node; 2: the same
# with an index entry per tensor (still read); 1: one document (manifest_v1)
VERSION = 3
SECTION_VERSION = 2  # a node's section: unchanged since version 2
SHARED = -1  # the section of the items every rank reads, whatever its node
# torch.save's archive around a tensor's own bytes: about 1.5 KiB (docs: item-format findings);
# a stored tensor item is never longer than its chunk's bytes plus this.
MAX_ITEM_FRAMING_BYTES = 1 << 20
# What every refusal of a manifest tells its reader to do
REPAIR_HINT = "restore the step from another tier or an earlier step; do not edit manifests by hand"


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
        """``self`` with node ``node``'s files and item locations merged in: a version-2
        section's :class:`SectionLocations` is kept as it is (located on lookup), other
        locations are merged into one dict."""
        if isinstance(locs, SectionLocations):
            known = self.locations if isinstance(self.locations, ManifestLocations) else None
            all_locs: Mapping[Any, ItemLocation] = ManifestLocations(self, known, node, locs)
        else:
            all_locs = {**self.locations, **locs}
        return dataclasses.replace(
            self,
            files={**self.files, **files},
            locations=all_locs,
            metadata=dataclasses.replace(self.metadata, storage_data=all_locs),
            loaded=self.loaded | {node},
        )


@dataclass(frozen=True)
class FileColumns:
    """One data file of a version-2 section and its items, as the section holds them: one
    row per item, in the section's order."""

    name: str
    size: int
    checksum: str  # the file's CRC32C
    rank: int  # the rank that wrote it
    ids: list[int]  # each item's tensor, as its index in Manifest.fqns
    chunks: list[int]  # which chunk of its tensor
    offsets: list[int]
    lengths: list[int]
    raws: list[int]  # offset of the raw tensor bytes within the item; -1: none located
    crcs: str  # each item's CRC32C, 8 hex digits apiece

    def crc(self, row: int) -> str:
        return self.crcs[8 * row : 8 * row + 8]

    def location(self, row: int) -> ItemLocation:
        raw = self.raws[row]
        return ItemLocation(  # positional: a fifth less per item than by name
            self.name,
            self.offsets[row],
            self.lengths[row],
            self.crc(row),
            self.rank,
            self.size,
            self.checksum,
            None if raw < 0 else raw,
        )


class SectionLocations(Mapping[MetadataIndex, ItemLocation]):
    """The item locations of one checked version-2 section, made when looked up (each time:
    callers keep what they use): a restore needs those of the items it reads, which for
    20,000 tensors cost more to make and key all at once (0.25 s) than the restore's own
    reading. A later row for the same chunk wins, as when a section was decoded into one
    dict."""

    def __init__(self, m: Manifest, files: list[FileColumns]) -> None:
        self._fqns = m.fqns
        self._sdm = m.metadata.state_dict_metadata
        self._files = files
        self._rows: dict[tuple[int, int], tuple[int, int]] = {}
        for f, columns in enumerate(files):
            rows = zip(itertools.repeat(f), range(len(columns.ids)))
            self._rows.update(zip(zip(columns.ids, columns.chunks), rows))
        self._ids: dict[str, int] | None = None  # fqn -> tensor id, made at the first lookup
        self._first: tuple[np.ndarray, np.ndarray] | None = None  # see first_chunks

    @property
    def files(self) -> list[FileColumns]:
        return self._files

    def tensor_ids(self) -> dict[str, int]:
        """Each fqn's tensor id (its index in Manifest.fqns)."""
        if self._ids is None:
            self._ids = {fqn: n for n, fqn in enumerate(self._fqns)}
        return self._ids

    def first_chunks(self) -> tuple[np.ndarray, np.ndarray]:
        """For every tensor id, the index in ``files`` and the row of its first chunk's
        item (-1, -1: none here), as lookups by key find them (a later row wins)."""
        if self._first is None:
            where = np.full(len(self._fqns), -1, dtype=np.int64)
            rows = np.full(len(self._fqns), -1, dtype=np.int64)
            for n, columns in enumerate(self._files):
                first = np.flatnonzero(np.asarray(columns.chunks, dtype=np.int64) == 0)
                ids = np.asarray(columns.ids, dtype=np.int64)[first]
                where[ids], rows[ids] = n, first  # an id repeated: its last row is kept
            self._first = where, rows
        return self._first

    def __getitem__(self, key: MetadataIndex) -> ItemLocation:
        f, row = self._rows[self._chunk_of(key)]
        return self._files[f].location(row)

    def _chunk_of(self, key: Any) -> tuple[int, int]:
        """(tensor id, chunk ordinal) of ``key``; KeyError if it names no saved item."""
        ids = self.tensor_ids()
        fqn: Any = getattr(key, "fqn", None)
        offset = getattr(key, "offset", None)
        tid = ids.get(fqn) if type(fqn) is str else None
        if tid is None:
            raise KeyError(key)
        chunks = getattr(self._sdm.get(fqn), "chunks", None)
        if chunks is None:  # a bytes item: its key has no offset at all
            if offset is not None:
                raise KeyError(key)
            return tid, 0
        if not isinstance(offset, torch.Size):
            raise KeyError(key)
        if len(chunks) == 1 and chunks[0].offsets == offset:  # a whole tensor: most items
            return tid, 0
        try:
            return tid, ordinal_in(self._sdm.get(fqn), key)
        except ManifestError:
            raise KeyError(key) from None

    def __iter__(self) -> Iterator[MetadataIndex]:
        for tid, chunk in self._rows:
            fqn = self._fqns[tid]
            chunks = getattr(self._sdm[fqn], "chunks", None)
            yield (
                MetadataIndex(fqn)
                if chunks is None
                else MetadataIndex(fqn, chunks[chunk].offsets, chunk)
            )

    def __len__(self) -> int:
        return len(self._rows)


class ManifestLocations(Mapping[MetadataIndex, ItemLocation]):
    """The locations of every version-2 section merged so far, one lookup each: a key is
    routed to the section of the node whose rank wrote its chunk (the section's checks
    make that the only one that can hold it)."""

    def __init__(
        self,
        m: Manifest,
        known: ManifestLocations | None,
        node: int,
        section: SectionLocations,
    ) -> None:
        self._sections: dict[int, SectionLocations] = {
            **(known._sections if known is not None else {}),
            node: section,
        }
        self._writers = m.writers
        self._metadata = m.metadata
        self._node_of = {r: n for n, ranks in enumerate(m.nodes) for r in ranks}

    def __getitem__(self, key: MetadataIndex) -> ItemLocation:
        writers = self._writers.get(getattr(key, "fqn", None))  # type: ignore[arg-type]
        if not writers:
            raise KeyError(key)
        if len(writers) == 1:
            node = SHARED
        else:
            try:
                rank = writers[chunk_ordinal(self._metadata, key)]
            except ManifestError:
                raise KeyError(key) from None
            node = self._node_of.get(rank, SHARED - 1)
        section = self._sections.get(node)
        if section is None:
            raise KeyError(key)
        return section[key]

    def section(self, node: int) -> SectionLocations | None:
        """Node ``node``'s section, if merged."""
        return self._sections.get(node)

    def __iter__(self) -> Iterator[MetadataIndex]:
        for section in self._sections.values():
            yield from section

    def __len__(self) -> int:
        return sum(len(section) for section in self._sections.values())


def chunk_ordinal(metadata: Metadata, index: MetadataIndex) -> int:
    """Which chunk of its tensor ``index`` names (0 for a bytes item). DCP's read items carry
    the ordinal as a hint; it is checked, and the chunks searched when it is wrong."""
    return ordinal_in(metadata.state_dict_metadata.get(index.fqn), index)


def ordinal_in(md: Any, index: MetadataIndex) -> int:
    """:func:`chunk_ordinal` of ``index`` in its tensor's metadata ``md``."""
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
