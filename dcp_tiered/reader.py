"""TieredStorageReader: loads committed steps, verifying every byte against the manifest."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterator
from typing import Any, BinaryIO

import torch
from torch.futures import Future
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, LoadItemType, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from . import integrity, layout
from .backends.local import LocalBackend
from .errors import CheckpointNotFoundError, DcpTieredError, IntegrityError, MissingShardError
from .local_tier import LocalTier, StepInfo
from .manifest import ItemLocation
from .safe_unpickle import load_dcp_metadata

logger = logging.getLogger(__name__)


class TieredStorageReader(StorageReader):
    """Reads a step saved by :class:`TieredStorageWriter` (or a vanilla DCP directory).

    Args:
        root: the directory given to the writer. ``checkpoint_id`` passed to ``dcp.load`` is
            a step name or ``"latest"`` (the default when omitted). ``root`` may also be a
            vanilla DCP checkpoint directory itself.
        allow_pickle: load non-tensor values with full pickle. Only for checkpoints you
            trust: a pickle can run arbitrary code. By default they load with
            ``torch.load(weights_only=True)``.
    """

    def __init__(self, root: str | os.PathLike[str], *, allow_pickle: bool = False) -> None:
        super().__init__()
        self._tier = LocalTier(LocalBackend(root))
        self.allow_pickle = allow_pickle
        self._requested: str | os.PathLike[str] | None = None
        self._step: StepInfo | None = None
        self._dir: tuple[str, ...] = ()
        self._locations: dict[Any, ItemLocation] = {}
        self._deferred_error: DcpTieredError | None = None

    @property
    def root(self) -> str:
        return self._tier.root

    @property
    def checkpoint_id(self) -> str | None:
        return self._step.name if self._step else None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._requested = checkpoint_id
        self._step = None

    # ------------------------------------------------------------ metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP turns any exception raised here into a bare AssertionError ("metadata is None").
        # To hand the caller our typed error, it is raised from set_up_storage_reader instead,
        # which DCP reports per rank in CheckpointException.failures like any other failure.
        self._deferred_error = None
        try:
            return self._read_metadata()
        except DcpTieredError as e:
            self._deferred_error = e
            return Metadata(state_dict_metadata={})

    def _read_metadata(self) -> Metadata:
        backend = self._tier.backend
        if self._requested is None and backend.exists(layout.DCP_METADATA_NAME):
            # The root itself is a vanilla DCP checkpoint directory.
            self._dir, name = (), os.path.basename(self.root)
            self._step = StepInfo(name, 0, verified_format=False)
        else:
            self._step = self._tier.resolve(self._requested)
            self._dir = (self._step.name,)
        if self._step.verified_format:
            md = self._tier.read_manifest(self._step.name).metadata
            self._locations = dict(md.storage_data)
            return md
        return self._read_vanilla_metadata()

    def _read_vanilla_metadata(self) -> Metadata:
        where = os.path.join(self.root, *self._dir, layout.DCP_METADATA_NAME)
        logger.warning(
            "%s is a vanilla DCP checkpoint without a dcp_tiered manifest: its bytes cannot be "
            "verified. Its .metadata is read with a restricted unpickler.",
            where,
        )
        md = load_dcp_metadata(
            self._tier.backend.read_file(*self._dir, layout.DCP_METADATA_NAME), where=where
        )
        self._locations = {
            idx: ItemLocation(info.relative_path, info.offset, info.length, "", -1, -1, "")
            for idx, info in md.storage_data.items()
        }
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._deferred_error is not None:
            raise self._deferred_error
        if self._step is None:  # DCP always reads metadata first; guard direct use
            raise CheckpointNotFoundError("read_metadata() must run before set_up_storage_reader")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # ------------------------------------------------------------ data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self._locations[item.storage_index].relative_path, []).append(item)
        for name, items in sorted(by_file.items()):
            items.sort(key=lambda i: self._locations[i.storage_index].offset)
            with self._open(name) as f:
                for item, payload in self._payloads(f, name, items):
                    self._deliver(item, payload, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _open(self, name: str) -> BinaryIO:
        try:
            f = self._tier.backend.open_read(*self._dir, name)
        except FileNotFoundError as e:
            raise MissingShardError(
                f"data file {name!r} of step {self.checkpoint_id!r} is missing from "
                f"{os.path.join(self.root, *self._dir)}; restore it from another tier or load "
                "an earlier step"
            ) from e
        return f

    def _payloads(
        self, f: BinaryIO, name: str, items: list[ReadItem]
    ) -> Iterator[tuple[ReadItem, bytes]]:
        """Each item's verified bytes; consecutive reads of one saved item share one read."""
        last: tuple[Any, bytes] | None = None
        for item in items:
            loc = self._locations[item.storage_index]
            if last is None or last[0] != item.storage_index:
                f.seek(loc.offset)
                data = f.read(loc.length)
                self._verify(name, item, loc, data)
                last = (item.storage_index, data)
            yield item, last[1]

    def _verify(self, name: str, item: ReadItem, loc: ItemLocation, data: bytes) -> None:
        problem = None
        if len(data) != loc.length:
            problem = f"expected {loc.length} bytes at offset {loc.offset}, file ends early"
        elif loc.checksum:
            actual = integrity.format_checksum(integrity.checksum(data))
            if actual != loc.checksum:
                problem = f"{integrity.ALGORITHM} {actual} != manifest {loc.checksum}"
        if problem:
            raise IntegrityError(
                f"corrupt data in step {self.checkpoint_id!r}, file {name!r} (rank {loc.rank}), "
                f"item {item.storage_index.fqn!r}: {problem}. Nothing from this item was "
                "loaded; restore the file from another tier or load an earlier step."
            )

    def _deliver(self, item: ReadItem, data: bytes, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, self._vetted_bytes(data))
            return
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise IntegrityError(
                f"item {item.storage_index.fqn!r} of step {self.checkpoint_id!r}: saved chunk "
                f"{tuple(tensor.size())} does not fit the requested {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    def _vetted_bytes(self, data: bytes) -> io.BytesIO:
        """Non-tensor values: weights_only unless the caller trusts the checkpoint.

        The value is decoded with the restricted unpickler, then re-encoded, so the planner's
        own unrestricted ``torch.load`` only ever sees objects that passed the restriction.
        """
        if self.allow_pickle:
            return io.BytesIO(data)
        try:
            obj = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise IntegrityError(
                f"a non-tensor value in step {self.checkpoint_id!r} holds objects that "
                f"weights_only loading refuses ({e}). If you trust this checkpoint, construct "
                "TieredStorageReader(..., allow_pickle=True)."
            ) from e
        out = io.BytesIO()
        torch.save(obj, out)
        out.seek(0)
        return out
