"""The only module that imports private torch symbols; each use says why.

It is also the only place that may ask which torch it runs on: the rest of the package uses
what it exports, tested on every torch in the supported range (tests/test_torch_versions.py).
Today's exports resolve the same way on 2.13, 2.14 and 2.15.
"""

from __future__ import annotations

import inspect
import logging
import pickle
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

# FSDP1's SHARDED_STATE_DICT type: still under a private module path in every supported torch.
from torch.distributed._shard.sharded_tensor import ShardedTensor  # noqa: F401

# DCP's own CPU-copy helpers understand DTensor and ShardedTensor; re-implementing their
# reconstruction logic would drift with torch.
from torch.distributed._state_dict_utils import _copy_state_dict as copy_state_dict  # noqa: F401
from torch.distributed._state_dict_utils import (  # noqa: F401
    _create_cpu_state_dict as create_cpu_state_dict,
)

# DCP's stream extensions (experimental, private): vanilla checkpoints written with
# FileSystemWriter(_extensions=[...]) are read back through torch's own registry and its own
# read-side transform stack, so that we read exactly what FileSystemReader reads.
from torch.distributed.checkpoint._extension import (  # noqa: F401
    ExtensionRegistry,
    ZStandard,
)

# Written into `.metadata` so that a vanilla FileSystemReader can read our steps.
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo  # noqa: F401
from torch.distributed.checkpoint.filesystem import (  # noqa: F401
    _StorageReaderTransforms as StorageReaderTransforms,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

logger = logging.getLogger(__name__)


def pin_host_memory(t: torch.Tensor) -> bool:
    """Page-lock the host memory under ``t`` (a mapping the caller owns) for the GPU to copy
    into by DMA, until ``t`` is collected: a copy from CUDA into pageable memory goes through
    the driver's bounce buffer at a fraction of the speed. torch's own helper for pinning
    memory it did not allocate (what ``_create_cpu_state_dict`` uses for shared memory).
    False, with a warning and nothing changed, where CUDA refuses."""
    import torch.cuda._pin_memory_utils as pinning  # CUDA builds only; asked for with a GPU

    ptr = t.data_ptr()
    try:
        pinning.pin_memory(ptr, t.numel() * t.element_size())
    except RuntimeError as e:
        logger.warning("copies from the GPU go through pageable memory: %s", e)
        return False
    weakref.finalize(t, _unpin, pinning.unpin_memory, ptr)
    return True


def _unpin(unpin: Callable[[int], None], ptr: int) -> None:
    try:
        unpin(ptr)
    except (AssertionError, RuntimeError):  # a finalizer has no one to raise to
        logger.debug("unpinning host memory at %#x failed", ptr, exc_info=True)


def load_keys(out: dict[str, Any], keys: set[str], storage_reader: Any) -> None:
    """Load just ``keys`` of a checkpoint into the empty dict ``out``, shaped from its metadata.

    DCP's public ``load`` needs a template of every value; its own template-free planner
    (what ``dcp_to_torch_save`` uses) is private. Not collective.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(
        out,
        storage_reader=storage_reader,
        no_dist=True,
        planner=_EmptyStateDictLoadPlanner(keys=keys),
    )


def upload_future(response: Future[Any] | AsyncSaveResponse) -> Future[Any]:
    """``dcp.async_save``'s future. Our callers pass synchronous stagers (the writer, DCP's
    default, the shims'): the state is copied when async_save returns, and DCP hands back a plain
    Future. An AsyncSaveResponse means staging still runs, which these callers do not wait for
    before the training step changes the state."""
    if isinstance(response, AsyncSaveResponse):
        raise TypeError("dcp.async_save staged asynchronously; dcp_tiered expects a plain Future")
    return response


def default_store() -> Any | None:
    """The c10d store of the default process group (None without one).

    Used for the cross-node commit handshake: store operations never interleave with the
    collectives DCP runs on its process group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _zip_writer_without_crc() -> Callable[[Any, Any], None] | None:
    """torch.save's own format, minus the CRC32 it computes for every zip record.

    That CRC costs about 0.17 s per GiB on one core (a third of a local commit here) and adds
    nothing for us: every item is already CRC32C-checked against the manifest, and torch.load
    does not check zip CRCs. torch exposes the switch only as a process-wide setting
    (``set_crc32_options``) that would also change the caller's own torch.save calls, so the
    writer is built directly. None when this torch's private API has another shape.
    """
    try:
        from torch.serialization import DEFAULT_PROTOCOL, _get_storage_alignment, _save

        params = list(inspect.signature(_save).parameters)
        writer_cls = torch._C.PyTorchFileWriter
    except (ImportError, AttributeError, ValueError):
        return None
    if params != [
        "obj",
        "zip_file",
        "pickle_module",
        "pickle_protocol",
        "_disable_byteorder_record",
    ]:
        return None

    def save(obj: Any, stream: Any) -> None:
        writer = writer_cls(stream, False, _get_storage_alignment())
        _save(obj, writer, pickle, DEFAULT_PROTOCOL, False)
        writer.write_end_of_file()

    return save


_save_without_crc = _zip_writer_without_crc()


def save_tensor(tensor: torch.Tensor, stream: Any) -> None:
    """``torch.save(tensor, stream)``, loadable by torch.load, without zip CRCs when possible."""
    if _save_without_crc is None:
        torch.save(tensor, stream)
    else:
        _save_without_crc(tensor, stream)


# DCP's plan caching (DefaultSavePlanner(enable_plan_caching=True)) keeps its caches in private
# class attributes of SavePlanner, one entry per planner class, for the life of the process.
# The writer reads them to lay out a partly replayed plan, and clears them when a replayed plan
# was made for another writer; no public API does either.
_PLAN_CACHES = (
    "_cached_save_plan",
    "_cached_final_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
)


def _plan_cache(name: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.planner import SavePlanner

    cache = getattr(SavePlanner, name, None)
    return cache if isinstance(cache, dict) else {}


def plan_cache_in_use() -> bool:
    """Whether some planner of this process has cached a global save plan (the coordinator)."""
    return bool(_plan_cache("_cached_global_plan"))


def cached_local_plan(key: str) -> Any | None:
    """The local save plan DCP's plan caching holds for planners keyed ``key`` (None: none)."""
    return _plan_cache("_cached_save_plan").get(key)


def cached_global_plan(delta: list[Any]) -> list[Any] | None:
    """The full global plan of which ``delta`` is DCP's delta: DCP sends each rank whose final
    plan did not change an empty unusable plan, and the changed ones as the very objects it
    cached. None if no cached plan matches."""
    fresh = [(i, p) for i, p in enumerate(delta) if getattr(p, "usable", True)]
    for full in _plan_cache("_cached_global_plan").values():
        if len(full) == len(delta) and all(full[i] is p for i, p in fresh):
            return list(full)
    return None


def forget_save_plans() -> None:
    """Drop every cached save plan of this process: the next save plans afresh."""
    for name in _PLAN_CACHES:
        _plan_cache(name).clear()


def global_rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def storage_alignment() -> int:
    """The alignment torch.save gives each record's data (64 unless configured otherwise).
    Read for item framing (:mod:`dcp_tiered.item_frame`), which checks its frames against
    torch's own writer anyway."""
    from torch.serialization import _get_storage_alignment

    return int(_get_storage_alignment())


def tensor_metadata(tensor: torch.Tensor) -> dict[str, Any]:
    """What torch.save records about ``tensor`` beyond dtype, shape and stride (its conj and
    neg bits, ...): a tensor with any is written by torch's own writer, not framed."""
    from torch._utils import get_tensor_metadata

    return dict(get_tensor_metadata(tensor))
