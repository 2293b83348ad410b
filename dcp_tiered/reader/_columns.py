"""Whole reads by columns: the tensors a TieredLoadPlanner left to the reader (no read item,
see :mod:`dcp_tiered.whole_reads`) located straight from the shared section's columns and
read in blocks, every item checked against its checksum and its archive's storage record
before its bytes are copied into the target.

A restore of 20,000 small tensors spent more on a read item, a key and a location per
tensor (made, hashed, looked up, sorted) than on its reading. Here the rows are found, cut
into blocks (:mod:`dcp_tiered.policy.read_blocks`) and their storage records checked with
numpy, a whole column at a time; per tensor there is a CRC32C and a memmove. Whatever
cannot be copied straight in (a large tensor read in place, an empty one, a file that is not
here, bytes that fail a check) becomes the read item the planner would have made and takes
the general path, which reads it from the remote or names the failure.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from .. import reader_checks
from ..errors import ConfigError, ManifestError
from ..policy import integrity, layout, manifest, read_blocks
from ..policy.manifest_types import SHARED, ManifestLocations
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
        """Copies the items of column read ``r`` (its ``rows``) into their targets, each
        after the checks ``_copy_stored`` makes (its CRC32C; its archive's storage record
        right where the target's bytes end, of that many bytes: checked for the whole block
        at once); an item that fails one goes to the general path (``self.leftover``),
        which reads it again and names what is wrong or reads the remote copy. A block whose
        bytes have the CRC32C its items' CRCs combine to (``r.crc``, taken on the read
        thread) has every item's CRC32C checked at once (:meth:`_copy_checked`)."""
        rows = r.rows
        assert rows is not None  # a column read: planned with its rows
        lo = rows.offsets - r.start
        ends = lo + rows.lengths
        pos = lo + rows.raws + rows.nbytes  # where each target's bytes end in the block
        tails = reader_checks.storage_tails_ok(block, pos, ends, rows.nbytes)
        if r.expected_crc >= 0 and r.crc == r.expected_crc and len(block) == r.end - r.start:
            self._copy_checked(r, block, pos, ends, tails, planner)
            return
        if r.expected_crc >= 0:
            logger.debug(
                "bytes %d-%d of %s fail the CRC32C their items' CRCs combine to; checking "
                "each item",
                r.start,
                r.end,
                r.name,
            )
        base = _local._address(block)
        crc, tail_at = integrity.checksum, reader_checks.storage_tail_at
        copy = _local._straight_copy  # looked up now: tests count the copies
        for fqn, a, b, expected, ok, p, dst, nbytes in zip(
            rows.fqns,
            lo.tolist(),
            ends.tolist(),
            rows.crcs.tolist(),
            tails.tolist(),
            pos.tolist(),
            rows.dst,
            rows.nbytes.tolist(),
        ):
            if (
                b > len(block)  # a short read
                or crc(block[a:b]) != expected
                or not (ok or tail_at(block, p, b, nbytes))  # a zip64 record, or a lie
            ):
                self.leftover.append(self.item_of(fqn))
                continue
            if nbytes:
                copy(dst, base + p - nbytes, nbytes)
            if self.commits:
                planner.commit_tensor(self.item_of(fqn), self.targets[fqn].detach())

    def _copy_checked(
        self,
        r: Read,
        block: memoryview,
        pos: np.ndarray,
        ends: np.ndarray,
        tails: np.ndarray,
        planner: LoadPlanner,
    ) -> None:
        """Copies the items of a block whose bytes matched their items' CRCs (see
        :meth:`deliver`): each item whose storage record ends where its target's bytes do
        (a zip64 record checked on its own; any other item to the general path), one
        memmove apiece, no Python frame between them."""
        rows = r.rows
        assert rows is not None
        nbytes = rows.nbytes
        keep = np.flatnonzero(tails)
        if len(keep) < len(tails):
            tail_at = reader_checks.storage_tail_at
            for i in np.flatnonzero(~tails).tolist():
                if tail_at(block, int(pos[i]), int(ends[i]), int(nbytes[i])):
                    tails[i] = True
                else:
                    self.leftover.append(self.item_of(rows.fqns[i]))
            keep = np.flatnonzero(tails)
        dst = rows.dst if len(keep) == len(tails) else [rows.dst[i] for i in keep.tolist()]
        src = (_local._address(block) + pos[keep] - nbytes[keep]).tolist()
        copy = _local._straight_copy
        if not self.commits:
            list(map(copy, dst, src, nbytes[keep].tolist()))
            return
        for i, to, at, n in zip(keep.tolist(), dst, src, nbytes[keep].tolist()):
            copy(to, at, n)  # each committed as it lands, as DCP's reader does
            fqn = rows.fqns[i]
            planner.commit_tensor(self.item_of(fqn), self.targets[fqn].detach())


class ColumnReads(LocalReads):
    """Reads the planner's column targets (LocalReads does the reading), and merges the
    manifest sections that locate what a load reads."""

    def reads_by_columns(self, metadata: Any) -> bool:
        """See :class:`dcp_tiered.whole_reads.ColumnReader`: the metadata this reader
        returned, of a step with manifest sections (version 2 or 3) held locally (its data
        files are read here)."""
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
        fqns = list(targets)
        tids = section.tensor_ids()
        ids = np.asarray([tids.get(fqn, -1) for fqn in fqns], dtype=np.int64)
        where, rows = section.first_chunks()
        found = np.where(ids >= 0, where[ids], -1)
        if (found < 0).any():
            raise self._unlocated(fqns[int(np.argmax(found < 0))])
        values = list(targets.values())
        dst = [t.data_ptr() for t in values]
        nbytes = np.asarray([t.nbytes for t in values], dtype=np.int64)
        reads: list[Read] = []
        for n in np.unique(found).tolist():
            f = section.files[n]
            mine = np.flatnonzero(found == n)
            if not self._valid_locally(f.name):  # the general path reads it remotely
                batch.leftover.extend(self._item_of(fqns[i]) for i in mine.tolist())
                continue
            blocks, left = read_blocks.plan(
                f,
                rows[ids[mine]],
                [fqns[i] for i in mine.tolist()],
                [dst[i] for i in mine.tolist()],
                nbytes[mine],
                block_bytes=_LOCAL_BLOCK_BYTES,
                gap_bytes=_LOCAL_GAP_BYTES,
                alone_bytes=_IN_PLACE_MIN_BYTES,
            )
            batch.leftover.extend(map(self._item_of, left))
            reads += [
                Read(f.name, b.start, b.end, [], columns=batch, rows=b.rows, expected_crc=b.crc)
                for b in blocks
            ]
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
