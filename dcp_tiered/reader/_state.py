"""What every part of the reader shares: the state of the step being loaded (which
``read_metadata`` sets and ``read_data`` grows), how the reader names what it reads, and the one
check every item's bytes pass, from whichever tier.

:class:`ReaderState` is the base of the roles :class:`~dcp_tiered.reader.TieredStorageReader`
inherits (``_vanilla``, ``_deliver``, ``_remote``, ``_local``): each role inherits the roles it
calls, so that its methods type-check on their own; the reader's ``__init__`` sets the state.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from .._torch_compat import StorageReaderTransforms
from ..backends.remote import RemoteBackend
from ..errors import DcpTieredError, IntegrityError, ManifestError
from ..policy import integrity, layout, manifest, manifest_types
from ..policy.manifest import ItemLocation
from ..tiers.local import LocalTier
from ..tiers.step_record import CommittedStep


class ReaderState:
    """The state every role of the reader reads, and the names and checks they share."""

    # Set by TieredStorageReader.__init__; see there.
    _tier: LocalTier
    _remote: RemoteBackend | None
    hydrate: bool
    allow_pickle: bool
    _transforms: StorageReaderTransforms
    _descriptors: dict[MetadataIndex, tuple[str, ...]]
    _requested: str | os.PathLike[str] | None
    _step: CommittedStep | None
    _dir: tuple[str, ...]
    _manifest: manifest.Manifest | None
    _index_is_local: bool
    _locations: dict[Any, ItemLocation]
    _own_keys: dict[Any, Any]
    _offered: Metadata | None
    _chunks: dict[MetadataIndex, tuple[torch.Size, torch.dtype]]
    _read_buffers: list[bytearray]
    _deferred_error: DcpTieredError | None
    _keys: layout.RemoteKeys | None
    files_read_remotely: set[str]
    _remote_checked: bool

    def _chunk(self, index: MetadataIndex) -> tuple[torch.Size, torch.dtype] | None:
        """The stored shape and dtype of tensor item ``index`` (None: no chunk of a tensor of
        our manifest; an index without offsets names no chunk), looked up when first asked: a restore into plain tensors never asks for
        most items, and 20,000 eager lookups cost a tenth of its time."""
        got = self._chunks.get(index)
        if got is None and self._manifest is not None and index.offset is not None:
            metadata = self._manifest.metadata
            md = metadata.state_dict_metadata.get(index.fqn)
            if isinstance(md, TensorStorageMetadata):
                chunk = md.chunks[manifest.chunk_ordinal(metadata, index)]
                got = self._chunks[index] = (chunk.sizes, md.properties.dtype)
        return got

    @property
    def root(self) -> str:
        return self._tier.root

    @property
    def checkpoint_id(self) -> str | None:
        return self._step.name if self._step else None

    def _unlocated(self, fqn: str, chunk: str = "") -> ManifestError:
        """The error for an item the index lists that no section of its manifest locates."""
        step = self._manifest.step if self._manifest else self.checkpoint_id
        return ManifestError(
            f"item {fqn!r}{chunk} of step {step!r} is located by no section of its manifest "
            f"in {self.root}; {manifest_types.REPAIR_HINT}"
        )

    def _what(self, index: MetadataIndex) -> str:
        return f"item {index.fqn!r} of step {self.checkpoint_id!r} in {self.root}"

    @staticmethod
    def _problem(loc: ItemLocation, parts: list[memoryview] | list[bytes]) -> str | None:
        """Why the item's bytes (consecutive ``parts``) do not match the manifest, or None."""
        got = sum(map(len, parts))
        if got != loc.length:
            return f"expected {loc.length} bytes at offset {loc.offset}, got {got}"
        if loc.checksum:
            crc = 0
            for part in parts:
                crc = integrity.checksum(part, crc)
            actual = integrity.format_checksum(crc)
            if actual != loc.checksum:
                return f"{integrity.ALGORITHM} {actual} != manifest {loc.checksum}"
        return None

    def _integrity_error(
        self, name: str, fqn: str, loc: ItemLocation, problem: str, remote: bool = False
    ) -> IntegrityError:
        tier = self._remote.config.url if remote and self._remote else self.root
        return IntegrityError.proof(
            f"corrupt data in step {self.checkpoint_id!r}, file {name!r} (rank {loc.rank}) on "
            f"{tier}, item {fqn!r}: {problem}. The load failed and the state it was loading into is incomplete; restore "
            "the file from another tier or load an earlier step."
        )


def by_storage_index(items: list[ReadItem]) -> Iterator[tuple[Any, list[ReadItem]]]:
    """Consecutive read items of one saved item share one read (resharding reads it k times)."""
    group: list[ReadItem] = []
    for item in items:
        if group and group[0].storage_index is not item.storage_index:
            yield group[0].storage_index, group
            group = []
        group.append(item)
    if group:
        yield group[0].storage_index, group
