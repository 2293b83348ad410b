"""Whole tensors and raw non-tensor items of one committed step, a few at a time, each byte
checked against the manifest: the CLI's ``diff`` and ``export`` read through here.

It drives :class:`TieredStorageReader` itself (``read_data`` with a plan for the wanted
items), so it gets the reader's guarantees: every item's CRC32C checked, a sharded tensor
assembled from its chunks, and a file the local tier lacks (or holds corrupt) read from the
remote with ranged GETs. Memory: the tensors of one batch (``batch_bytes``, or one tensor when
it is larger), never the whole step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..config import RemoteConfig
from ..errors import IntegrityError
from ..reader import TieredStorageReader

BATCH_BYTES = 16 * 2**20  # small tensors share one read_data call (and its coalesced GETs)


class StepItems:
    """The items of committed step ``step`` of ``root`` (its remote: ``remote``)."""

    def __init__(
        self, root: str | os.PathLike[str], step: str, remote: RemoteConfig | None = None
    ) -> None:
        # allow_pickle=True only so that the reader hands non-tensor items over as their raw,
        # verified bytes instead of unpickling them (weights_only) and re-encoding them: nothing
        # here unpickles them; diff compares them byte for byte, export leaves them out.
        self._reader = TieredStorageReader(root, remote=remote, allow_pickle=True)
        self._reader.reset(step)
        self.metadata: Metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, True)  # raises the typed error
        self.step = self._reader.checkpoint_id

    def tensor_metadata(self, fqn: str) -> TensorStorageMetadata | None:
        md = self.metadata.state_dict_metadata.get(fqn)
        return md if isinstance(md, TensorStorageMetadata) else None

    def tensors(
        self, fqns: Iterable[str], batch_bytes: int = BATCH_BYTES
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(fqn, the whole tensor) for each of ``fqns``, in order, read a batch at a time."""
        batch: list[str] = []
        size = 0
        for fqn in fqns:
            md = self.tensor_metadata(fqn)
            if md is None:
                raise KeyError(f"{fqn!r} is not a tensor of step {self.step!r}")
            nbytes = math.prod(md.size) * md.properties.dtype.itemsize
            if batch and size + nbytes > batch_bytes:
                yield from self._read_tensors(batch)
                batch, size = [], 0
            batch.append(fqn)
            size += nbytes
        if batch:
            yield from self._read_tensors(batch)

    def raw_bytes(self, fqn: str) -> bytes:
        """The stored bytes of non-tensor item ``fqn`` (a torch.save blob), verified."""
        index = MetadataIndex(fqn)
        zero = torch.Size((0,))
        item = ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero)
        planner = _Collect({})
        self._reader.read_data(LoadPlan([item]), planner).wait()
        return planner.blobs[fqn]

    def _read_tensors(self, fqns: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        targets: dict[str, torch.Tensor] = {}
        items: list[ReadItem] = []
        for fqn in fqns:
            md = self.tensor_metadata(fqn)
            assert md is not None
            target = torch.empty(md.size, dtype=md.properties.dtype)
            whole = ChunkStorageMetadata(offsets=torch.Size([0] * len(md.size)), sizes=md.size)
            wanted = create_read_items_for_chunk_list(fqn, md, [whole])
            covered = sum(math.prod(i.lengths) for i in wanted)
            if covered != target.numel():  # chunks that leave a gap: bytes nobody wrote
                raise IntegrityError(
                    f"tensor {fqn!r} of step {self.step!r}: its saved chunks cover {covered} "
                    f"of its {target.numel()} elements; the manifest does not describe a "
                    "whole tensor. Restore the step from another tier."
                )
            targets[fqn] = target
            items.extend(wanted)
        self._reader.read_data(LoadPlan(items), _Collect(targets)).wait()
        for fqn in fqns:
            yield fqn, targets.pop(fqn)


class _Collect(LoadPlanner):
    """Receives what the reader delivers: tensor chunks into ``targets``, raw bytes items
    into ``blobs`` (never unpickled). Only ``read_data`` drives it, never ``dcp.load``."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.blobs: dict[str, bytes] = {}

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise NotImplementedError

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        raise NotImplementedError

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.blobs[read_item.dest_index.fqn] = value.read()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self.targets[read_item.dest_index.fqn]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, start, length)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass
