"""Whole reads by columns: the tensors a TieredLoadPlanner left to the reader (no read item,
see :mod:`dcp_tiered.whole_reads`) located straight from the shared section's columns and
read in blocks, every item checked against its checksum and its archive's storage record
before its bytes are copied into the target.

A restore of 20,000 small tensors spent more on a read item, a key and a location per
tensor (made, hashed, looked up, sorted) than on its reading. Here a tensor costs a row
lookup; whatever cannot be copied straight in (a large tensor read in place, an empty one,
a file that is not here, bytes that fail a check) becomes the read item the planner would
have made and takes the general path, which reads it from the remote or names the failure.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from .. import reader_checks
from ..errors import ConfigError, ManifestError
from ..policy import integrity, layout, manifest
from ..policy.manifest_types import SHARED, FileColumns, ManifestLocations
from ..tiers.remote import RemoteTier
from . import _local
from ._local import (
    _IN_PLACE_MIN_BYTES,
    _LOCAL_BLOCK_BYTES,
    _LOCAL_GAP_BYTES,
    LocalReads,
    Read,
)

logger = logging.getLogger("dcp_tiered.reader")


@dataclass
class ColumnBatch:
    """The whole reads a planner left to the reader (see reader._columns): each fqn's
    target, whether the planner's commit_tensor must see each, the read items of those
    left to the general path, and how to make one."""

    targets: dict[str, torch.Tensor]
    commits: bool
    leftover: list[ReadItem]
    item_of: Callable[[str], ReadItem]

    def deliver(self, r: Read, block: memoryview, planner: LoadPlanner) -> None:
        """Copies the items of column read ``r`` (fqn, offset, length, CRC32C, raw offset) into
        their targets, each after the checks ``_copy_stored`` makes; an item that fails one goes
        to the general path (``self.leftover``), which reads it again and names what is wrong
        or reads the remote copy."""
        targets, leftover = self.targets, self.leftover
        base = _local._address(block)
        crc, tail_at = integrity.checksum, reader_checks.storage_tail_at
        copy = _local._straight_copy  # looked up now: tests count the copies
        start = r.start
        for fqn, offset, length, expected, raw in r.groups:  # type: ignore[misc]
            lo = offset - start
            data = block[lo : lo + length]
            target = targets[fqn]
            nbytes = target.nbytes
            if (
                len(data) != length
                or (expected and f"{crc(data):08x}" != expected)
                or raw + nbytes > length
                or not tail_at(block, lo + raw + nbytes, lo + length, nbytes)
            ):
                leftover.append(self.item_of(fqn))
                continue
            if nbytes:
                copy(target.data_ptr(), base + lo + raw, nbytes)
            if self.commits:
                planner.commit_tensor(self.item_of(fqn), target.detach())


class ColumnReads(LocalReads):
    """Reads the planner's column targets (LocalReads does the reading), and merges the
    manifest sections that locate what a load reads."""

    def reads_by_columns(self, metadata: Any) -> bool:
        """See :class:`dcp_tiered.whole_reads.ColumnReader`: the metadata this reader
        returned, of a version-2 step held locally (its data files are read here)."""
        return (
            metadata is self._offered
            and self._manifest is not None
            and bool(self._manifest.sections)
            and self._step is not None
            and self._step.local
            and not self._descriptors
        )

    def _read_by_columns(self, planner: LoadPlanner) -> list[ReadItem]:
        """Reads the planner's column targets (if it has any); returns the read items of
        those left to the general path."""
        found = getattr(planner, "column_targets", None)
        targets = found() if found is not None else None
        if not targets:
            return []
        if not self.reads_by_columns(getattr(planner, "metadata", None)):
            raise ConfigError(  # the planner's load is not this one: never skip a tensor
                "the load planner left whole tensors to a reader that did not offer to read "
                "them (a planner planned for another load?); give dcp.load the planner and "
                "the reader of one load"
            )
        m = self._manifest
        assert m is not None  # reads_by_columns
        if SHARED not in m.loaded:
            self._manifest = m = self._merge_section(m, SHARED)
        section = (
            m.locations.section(SHARED) if isinstance(m.locations, ManifestLocations) else None
        )
        if section is None:  # no shared section (every tensor sharded): nothing to read here
            raise ManifestError(f"step {m.step!r} has no shared section for whole tensors")
        batch = ColumnBatch(
            targets,
            type(planner).commit_tensor is not DefaultLoadPlanner.commit_tensor,
            [],
            self._item_of,
        )
        ids = section.tensor_ids()
        rows: dict[int, list[tuple[int, int, str]]] = {}  # file -> (offset, row, fqn)
        files = {id(f): f for f in section.files}
        for fqn in targets:
            where = section.row_of(ids.get(fqn, -1), 0)
            if where is None:
                raise self._unlocated(fqn)
            f, row = where
            rows.setdefault(id(f), []).append((f.offsets[row], row, fqn))
        reads: list[Read] = []
        for key, placed in rows.items():
            f = files[key]
            if not self._valid_locally(f.name):  # the general path reads it remotely
                batch.leftover.extend(self._item_of(fqn) for _, _, fqn in placed)
                continue
            placed.sort()
            reads.extend(_blocks(f, placed, batch))
        self._run_reads(reads, planner)
        return batch.leftover

    def _merge_section(self, m: manifest.Manifest, node: int) -> manifest.Manifest:
        assert self._step is not None
        name = layout.manifest_section_name(node)
        if self._index_is_local and self._tier.backend.is_regular_file(self._step.name, name):
            try:
                return self._tier.merge_sections(self._step.name, m, [node])
            except (ManifestError, OSError) as e:
                if self._remote is None:
                    raise
                logger.warning("%s of %s is unusable (%s); using the remote one", name, m.step, e)
        if self._remote is None or not self._step.remote:
            raise ManifestError(
                f"{os.path.join(self.root, self._step.name)} holds this node's part of step "
                f"{m.step!r}, but the items asked for were saved by node {node}, whose manifest "
                "section is only in that node's directory and there is no remote copy to read "
                "it from. Load on the same nodes, or configure the remote tier the step was "
                "promoted to."
            )
        return RemoteTier(self._remote).merge_sections(self._remote_keys(), m, [node])

    def _item_of(self, fqn: str) -> ReadItem:
        """The whole read the planner would have made for ``fqn``."""
        assert self._manifest is not None
        md = self._manifest.metadata.state_dict_metadata[fqn]
        assert isinstance(md, TensorStorageMetadata)
        offsets = md.chunks[0].offsets
        index = MetadataIndex(fqn, offsets, 0)
        return ReadItem(LoadItemType.TENSOR, index, offsets, index, offsets, md.size)


def _blocks(f: FileColumns, placed: list[tuple[int, int, str]], batch: ColumnBatch) -> list[Read]:
    """The block reads of file ``f``'s rows ``placed`` (sorted by offset); a row whose
    tensor is large (read in place) or has no located raw bytes goes to the general path."""
    reads: list[Read] = []
    block: Read | None = None
    lengths, raws = f.lengths, f.raws
    for start, row, fqn in placed:
        length = lengths[row]
        if length >= _IN_PLACE_MIN_BYTES or raws[row] < 0:
            batch.leftover.append(batch.item_of(fqn))
            continue
        end = start + length
        entry = (fqn, start, length, f.crc(row), raws[row])
        if (
            block is not None
            and block.end <= start <= block.end + _LOCAL_GAP_BYTES
            and end - block.start <= _LOCAL_BLOCK_BYTES
        ):
            block.end = end
            block.groups.append(entry)  # type: ignore[arg-type]
        else:
            block = Read(f.name, start, end, [entry], columns=batch)  # type: ignore[list-item]
            reads.append(block)
    return reads
