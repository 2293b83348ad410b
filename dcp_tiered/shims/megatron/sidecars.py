"""The files megatron-core keeps beside a ``torch_dist`` step (``metadata.json``, and
``common.pt`` before 0.19), written back from the committed step's own verified data so stock
mcore and Megatron-LM load it, and the pending directory they are written into before the
step is committed."""

from __future__ import annotations

import io
import json
import logging
import os
from typing import Any

import torch

from ...errors import ForeignPathError
from ...lifecycle.roots import local_tier, write_file_atomically
from ...reader import TieredStorageReader
from . import compat as _mcore_compat

logger = logging.getLogger(__package__)  # one logger per adapter, as before its split

COMMON_NAME = _mcore_compat.COMMON_NAME
CONFIG_NAME = "metadata.json"


def write_sidecars(
    root: str,
    step: str,
    *,
    backend: str = "torch_dist",
    version: int = 1,
    remote: Any = None,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
) -> None:
    """Writes mcore's ``metadata.json`` and ``common.pt`` into ``root/step``, the latter from
    the committed step's own verified data (any tier), so stock mcore can load the directory.
    Not collective. A step saved without ``dist_checkpointing.save`` has no ``common.pt``."""
    step_dir = os.path.join(root, step)
    claim_step_dir(root, step)
    config = {
        "sharded_backend": backend,
        "sharded_backend_version": version,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    write_file_atomically(os.path.join(step_dir, CONFIG_NAME), json.dumps(config).encode())
    reader = TieredStorageReader(
        root, remote=remote, storage_options=storage_options, allow_pickle=allow_pickle
    )
    reader.reset(step)
    common = _mcore_compat.read_common_state(reader)
    if common is None:
        logger.warning(
            "%s holds no mcore common state (not saved through "
            "dist_checkpointing.save): no %s written",
            step_dir,
            COMMON_NAME,
        )
        return
    data = io.BytesIO()
    torch.save(common, data)
    write_file_atomically(os.path.join(step_dir, COMMON_NAME), data.getvalue())


def claim_step_dir(root: str, step: str) -> None:
    """Make ``root/step`` ready for mcore's sidecars: a committed step as it is, else a
    directory marked pending (created if missing), which the commit replaces and a sweep
    removes after a crash. Refuses a directory holding anything but mcore's own files."""
    tier = local_tier(root)
    if not tier.has_step(step) and not tier.claim_pending(step, [COMMON_NAME, CONFIG_NAME]):
        raise ForeignPathError(
            f"{os.path.join(root, step)} holds files that are not a checkpoint of dcp_tiered "
            f"nor mcore's {COMMON_NAME}/{CONFIG_NAME}; it was left untouched. Move it away "
            "or save under another directory."
        )


def remove_sidecars(root: str, step: str) -> None:
    """Removes the pending directory made for ``step`` (mcore's sidecars written to load a step
    from the remote tier, or of a save that failed): only the files it was made for."""
    tier = local_tier(root)
    if tier.is_pending(step):
        tier.discard_pending(step, reason=f"{step} is not committed in {root}")


__all__ = ["COMMON_NAME", "CONFIG_NAME", "claim_step_dir", "remove_sidecars", "write_sidecars"]
