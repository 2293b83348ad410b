"""Vanilla DCP steps (a directory ``FileSystemWriter`` wrote, with no dcp_tiered manifest): their
``.metadata``, read with the restricted unpickler, and the DCP stream extensions their items
were written through, resolved before any byte is read and undone on delivery."""

from __future__ import annotations

import io
import logging
import os

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from .._torch_compat import ZStandard
from ..errors import IntegrityError, UnsupportedExtensionError
from ..policy import layout
from ..policy.manifest import ItemLocation
from ..safe_unpickle import load_dcp_metadata
from ._state import ReaderState

logger = logging.getLogger("dcp_tiered.reader")  # the reader's one logger, whichever module


class VanillaSteps(ReaderState):
    """A vanilla DCP step's metadata and stream extensions."""

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
        self._manifest = None
        self._chunks = {}
        self._locations = {
            idx: ItemLocation(info.relative_path, info.offset, info.length, "", -1, -1, "")
            for idx, info in md.storage_data.items()
        }
        # Older writers have no transform_descriptors field at all.
        self._descriptors = {
            idx: tuple(descs)
            for idx, info in md.storage_data.items()
            if (descs := getattr(info, "transform_descriptors", None))
        }
        self._check_extensions(where)
        return md

    def _check_extensions(self, where: str) -> None:
        """Every stream extension a vanilla step uses resolves, before any byte is read."""
        checked: set[tuple[str, ...]] = set()
        for idx, descs in self._descriptors.items():
            if descs in checked:
                continue
            try:
                self._transforms.extension_registry.from_descriptor_list(descs)
            except Exception as e:  # ValueError today; an extension's own code may raise more
                name = self._locations[idx].relative_path
                if any(d.startswith(ZStandard.registry_name()) for d in descs) and (
                    not ZStandard.is_available()
                ):
                    fix = "install zstandard in this environment (pip install zstandard)"
                else:
                    fix = (
                        "register the extension's class in an ExtensionRegistry and pass it as "
                        "TieredStorageReader(..., extension_registry=registry), as you would "
                        "to FileSystemReader(..., _extension_registry=registry)"
                    )
                raise UnsupportedExtensionError(
                    f"{where}: item {idx.fqn!r} in data file {name!r} was written with the DCP "
                    f"stream extension(s) {list(descs)}, which this reader cannot apply ({e}). "
                    f"To read it, {fix}."
                ) from e
            checked.add(descs)

    def _untransformed(self, item: ReadItem, data: bytes | memoryview) -> bytes:
        """A vanilla item's bytes with its stream extensions undone, as FileSystemReader does."""
        descs = self._descriptors[item.storage_index]
        try:
            return self._transforms.transform_load_stream(item, descs, io.BytesIO(data)).read(-1)
        except Exception as e:  # a corrupt stream, or the extension's own failure
            name = self._locations[item.storage_index].relative_path
            raise IntegrityError(
                f"item {item.storage_index.fqn!r} in data file {name!r} of "
                f"{os.path.join(self.root, *self._dir)}: undoing its DCP stream extension(s) "
                f"{list(descs)} failed ({type(e).__name__}: {e}). The data is corrupt, or the "
                "registered extension is not the one it was written with; restore the "
                "checkpoint from a trusted copy."
            ) from e
