"""A restricted unpickler for vanilla DCP ``.metadata`` files.

Used only to read checkpoints that DCP's own FileSystemWriter made (ours carry a JSON
manifest instead). It admits the handful of classes a DCP ``Metadata`` is built from; any
other global, such as ``os.system`` in a tampered file, is refused before it can run.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from .errors import ManifestError

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # Older torch versions pickled the sharded-tensor copy of TensorProperties (and its enum)
    # into .metadata; vanilla DCP still reads them. Both are plain data: a dataclass of dtype,
    # layout, flags and an enum member, whose __setstate__ only assigns those fields.
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def load_dcp_metadata(data: bytes, *, where: str) -> Any:
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise ManifestError(
            f"{where}: DCP .metadata is corrupt or contains disallowed objects ({e}); "
            "it was not executed. Restore the checkpoint from a trusted copy."
        ) from e


__all__ = ["load_dcp_metadata"]
