"""What a committed step says about itself: its manifest (index and per-node sections) and
DCP's own ``.metadata``, built by the coordinator in ``finish`` from every rank's results."""

from __future__ import annotations

import dataclasses
import pickle
import time
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from .. import _gc, _torch_compat
from .._version import __version__
from ..policy import manifest
from ._datafile import locations
from ._plan import SaveInfo


def describe(
    save: SaveInfo,
    metadata: Metadata,
    results: list[list[WriteResult]],
    timings: dict[str, float] | None = None,
) -> tuple[manifest.Built, bytes]:
    """The step's manifest and the bytes of its DCP ``.metadata``; ``timings`` (if given)
    gets the seconds of each (``manifest_build_s``, ``metadata_pickle_s``: benchmarks/scale.py
    reports them apart)."""
    node_of = save.layout.node_of
    if metadata.storage_meta is not None and metadata.storage_meta.checkpoint_id not in (
        None,
        save.step,
    ):  # DCP's plan caching replays an earlier save's metadata
        metadata = dataclasses.replace(
            metadata,
            storage_meta=dataclasses.replace(
                metadata.storage_meta, checkpoint_id=save.step, save_id=None
            ),
        )
    started = time.perf_counter()
    where = locations(results)
    with _gc.paused():  # one object per item of every rank: see _gc
        built = manifest.build(
            step=save.step,
            save_id=save.save_id,
            world_size=save.world_size,
            nodes=[[r for r, n in enumerate(node_of) if n == k] for k in sorted(set(node_of))],
            committed_at_ns=time.time_ns(),
            metadata=metadata,
            locations=where,
            versions={"dcp_tiered": __version__, "torch": torch.__version__},
            promote=save.promote,
            run_id=save.run_id,
        )
        built_at = time.perf_counter()
        metadata_bytes = vanilla_metadata(metadata, where, save.step)
    if timings is not None:
        timings["manifest_build_s"] = built_at - started
        timings["metadata_pickle_s"] = time.perf_counter() - built_at
    return built, metadata_bytes


def vanilla_metadata(
    metadata: Metadata, locations: dict[Any, manifest.ItemLocation], step: str
) -> bytes:
    """DCP's own ``.metadata`` so the step stays a valid vanilla DCP checkpoint.

    Equal names, offsets and chunk sizes are made one object each, which pickle then writes
    once and refers back to (the gathered results hold one copy per rank): 5.9 MiB instead of
    DCP's 9.3 MiB for FSDP2 at 64 ranks, written in about the time DCP pickles its own
    (``benchmarks/scale.py``). Readers unpickle the same objects.
    """
    one: dict[Any, Any] = {}

    def shared(value: Any) -> Any:
        return one.setdefault((type(value), value), value)

    for md in metadata.state_dict_metadata.values():
        for chunk in getattr(md, "chunks", ()):  # the planner's: equal values, still its own
            chunk.offsets, chunk.sizes = shared(chunk.offsets), shared(chunk.sizes)
    storage_data = {}
    sizes: dict[Any, Any] = {}  # an offset as the torch.Size MetadataIndex holds
    for idx, loc in locations.items():
        key = MetadataIndex(shared(idx.fqn), None, idx.index)
        offset = idx.offset
        if offset is not None and type(offset) is not torch.Size:
            offset = sizes.get(offset) or sizes.setdefault(offset, torch.Size(offset))
        object.__setattr__(key, "offset", shared(offset))  # frozen; __init__ would copy it
        storage_data[key] = _torch_compat.StorageInfo(
            shared(loc.relative_path), loc.offset, loc.length
        )
    vanilla = dataclasses.replace(
        metadata,
        storage_data=storage_data,
        storage_meta=metadata.storage_meta or StorageMeta(checkpoint_id=step),
    )
    return pickle.dumps(vanilla, protocol=4)
