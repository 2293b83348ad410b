"""Delivery: one item's verified bytes handed to the planner, as a tensor copied into its
target (a view of the raw bytes where the manifest locates them, else ``torch.load`` with
``weights_only``) or as a non-tensor value that passed the restricted unpickler."""

from __future__ import annotations

import io
import math
import warnings

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from .. import reader_checks
from ..errors import IntegrityError
from ._vanilla import VanillaSteps


class Delivery(VanillaSteps):
    """Verified bytes to the planner; a vanilla item's extensions undone first (VanillaSteps)."""

    def _deliver(
        self,
        item: ReadItem,
        data: bytes | memoryview,
        planner: LoadPlanner,
        target: torch.Tensor | None = None,
    ) -> None:
        """Hands one item's verified bytes to the planner (``target``: already resolved)."""
        if item.storage_index in self._descriptors:
            data = self._untransformed(item, data)
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, self._vetted_bytes(data))
            return
        tensor = self._raw_view(item.storage_index, data)
        if tensor is None:
            tensor = self._loaded_tensor(item.storage_index, data)
        if any(item.storage_offsets) or list(item.lengths) != list(tensor.size()):
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                tensor = tensor.narrow(dim, start, length)
        if target is None:
            target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise IntegrityError(
                f"item {item.storage_index.fqn!r} of step {self.checkpoint_id!r}: saved chunk "
                f"{tuple(tensor.size())} does not fit the requested {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    def _raw_view(self, index: MetadataIndex, data: bytes | memoryview) -> torch.Tensor | None:
        """The stored chunk as a view of its verified raw bytes (no torch.load, no copy), when
        the manifest says where they are. The shape and dtype come from the manifest too."""
        loc = self._locations[index]
        chunk = self._chunk(index)
        if loc.raw_offset is None or chunk is None:
            return None
        sizes, dtype = chunk
        count = math.prod(sizes)
        if loc.raw_offset + count * dtype.itemsize > len(data):
            raise IntegrityError(
                f"item {index.fqn!r} of step {self.checkpoint_id!r}: the manifest places "
                f"{count} x {dtype} past the end of the item's {len(data)} bytes; the manifest "
                "does not match the data. Restore the step from another tier."
            )
        reader_checks.check_raw_storage(
            data, loc.raw_offset, count * dtype.itemsize, self._what(index)
        )
        if isinstance(data, memoryview) and not data.readonly:  # a local block of ours
            raw = torch.frombuffer(data, dtype=torch.uint8, count=count * dtype.itemsize,
                                   offset=loc.raw_offset)  # fmt: skip
        else:
            with warnings.catch_warnings():  # remote bytes are read-only; we only read them
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                raw = torch.frombuffer(data, dtype=torch.uint8, count=count * dtype.itemsize,
                                       offset=loc.raw_offset)  # fmt: skip
        if raw.data_ptr() % min(dtype.itemsize, 16):
            # Items lie back to back in the file, so a tensor's bytes need not be aligned for
            # its dtype; some kernels (complex128 copies) crash on such a view. Copy them
            # (as bytes: even cloning a misaligned complex view crashes).
            raw = raw.clone()
        return raw.view(dtype).view(sizes)

    def _loaded_tensor(self, index: MetadataIndex, data: bytes | memoryview) -> torch.Tensor:
        """A tensor item read with torch.load (weights_only), checked against the manifest."""
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # verified bytes that are no tensor archive
            raise IntegrityError(
                f"{self._what(index)}: its stored bytes do not load as a tensor "
                f"({type(e).__name__}: {str(e)[:200]}); restore the step from another tier"
            ) from e
        chunk = self._chunk(index)
        if chunk is not None:
            sizes, dtype = chunk
            return reader_checks.check_loaded_tensor(tensor, sizes, dtype, self._what(index))
        return tensor

    def _vetted_bytes(self, data: bytes | memoryview) -> io.BytesIO:
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
