"""What a committed step says about itself: its manifest (index and per-node sections) and
DCP's own ``.metadata``, built by the coordinator in ``finish`` from every rank's results."""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from .. import _gc, _torch_compat, item_writer, metadata_broadcast
from .._version import __version__
from ..policy import manifest, manifest_build
from ._datafile import locations
from ._plan import SaveInfo


@dataclass
class KeptMetadata:
    """The last save's ``.metadata`` pickled with its step name left open, and what it was
    pickled from: a save of the same structure (DCP's plan cache hands back the same metadata
    object, and every item lands where it did) writes the same bytes but for the step's name.
    Owned by one writer."""

    state_dict_metadata: Any = None
    planner_data: Any = None
    version: str | None = None
    where: list[tuple[Any, str, int, int]] | None = None
    pickled: bytes = b""
    # the data files' layouts of the last save, and the manifest's plan of them for the
    # metadata objects and nodes in plan_of: the next save of the same layouts reuses both
    layouts: list[tuple[Any, ...]] | None = None
    file_plan: manifest_build.FilePlan | None = None
    plan_of: tuple[Any, Any] | None = None


def _files(results: list[list[WriteResult]]) -> list[item_writer.FileItems] | None:
    """Every rank's data files, or None where a result is per item (benchmarks/scale.py)."""
    files = [wr.storage_data for rs in results for wr in rs]
    if all(isinstance(f, item_writer.FileItems) for f in files):
        return files
    return None


def describe(
    save: SaveInfo,
    metadata: Metadata,
    results: list[list[WriteResult]],
    timings: dict[str, float] | None = None,
    kept: KeptMetadata | None = None,
) -> tuple[manifest_build.Built, bytes]:
    """The step's manifest and the bytes of its DCP ``.metadata``; ``timings`` (if given)
    gets the seconds of each (``manifest_build_s``, ``metadata_pickle_s``: benchmarks/scale.py
    reports them apart); ``kept``: the writer's last ``.metadata``, reused where it holds."""
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
    files = _files(results)
    with _gc.paused():  # one object per item of every rank: see _gc
        args: dict[str, Any] = {
            "step": save.step,
            "save_id": save.save_id,
            "world_size": save.world_size,
            "nodes": [[r for r, n in enumerate(node_of) if n == k] for k in sorted(set(node_of))],
            "committed_at_ns": time.time_ns(),
            "metadata": metadata,
            "versions": {"dcp_tiered": __version__, "torch": torch.__version__},
            "promote": save.promote,
            "run_id": save.run_id,
        }
        same = False
        where: dict[Any, manifest.ItemLocation] | None = None
        if files is None:  # per-item results (benchmarks/scale.py)
            where = locations(results)
            built = manifest_build.build(locations=where, **args)
        else:
            layouts = [(f.name, f.rank, f.keys, f.offsets, f.lengths, f.raw_offsets) for f in files]
            plan_of = (metadata.state_dict_metadata, args["nodes"])
            same = kept is not None and kept.layouts == layouts and kept.plan_of == plan_of
            plan = kept.file_plan if same and kept is not None else None
            built, plan = manifest_build.build_files(files=files, plan=plan, **args)
            if kept is not None and not same:
                kept.layouts, kept.file_plan, kept.plan_of = layouts, plan, plan_of
                kept.pickled = b""  # pickled for other layouts
            elif kept is not None:  # equal: the newest keys, packed where they came packed
                kept.layouts = layouts
        built_at = time.perf_counter()
        metadata_bytes = vanilla_metadata(
            metadata,
            (lambda: where) if where is not None else (lambda: locations(results)),
            save.step,
            kept,
            same_files=same,
        )
    if timings is not None:
        timings["manifest_build_s"] = built_at - started
        timings["metadata_pickle_s"] = time.perf_counter() - built_at
    return built, metadata_bytes


# Where the step's name goes in a kept pickle: no step name holds a NUL (layout checks), so
# the string occurs once, as the one storage_meta.checkpoint_id. Protocol 2 has no frames
# whose lengths a longer or shorter name would break.
_STEP_SLOT = "\x00dcp-tiered:step-name\x00"
_PROTOCOL = 2


def _pickled_str(value: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")
    return b"X" + len(data).to_bytes(4, "little") + data  # BINUNICODE


def vanilla_metadata(
    metadata: Metadata,
    locations_of: Callable[[], dict[Any, manifest.ItemLocation]],
    step: str,
    kept: KeptMetadata | None = None,
    *,
    same_files: bool = False,
) -> bytes:
    """DCP's own ``.metadata`` so the step stays a valid vanilla DCP checkpoint.

    Equal names, offsets and chunk sizes are made one object each, which pickle then writes
    once and refers back to (the gathered results hold one copy per rank): 5.9 MiB instead of
    DCP's 9.3 MiB for FSDP2 at 64 ranks, written in about the time DCP pickles its own
    (``benchmarks/scale.py``). Readers unpickle the same objects. With ``kept``, a save of the
    same structure as the last reuses its bytes, with only the step's name written anew (a
    quarter of a second at 20,000 tensors). ``locations_of`` makes every item's location, called
    only where needed: not when ``same_files`` says the data files' layouts are those the kept
    bytes were made for.
    """
    storage_meta = metadata.storage_meta or StorageMeta(checkpoint_id=step)
    if kept is None or storage_meta != StorageMeta(checkpoint_id=step):
        return pickle.dumps(_vanilla(metadata, locations_of(), storage_meta), protocol=4)
    holds = (
        kept.state_dict_metadata is metadata.state_dict_metadata  # DCP's cached plan's own
        and kept.planner_data is metadata.planner_data
        and kept.version == metadata.version
    )
    if not (holds and same_files and kept.pickled):
        locations = locations_of()
        where = [(i, loc.relative_path, loc.offset, loc.length) for i, loc in locations.items()]
        if not (holds and kept.where == where):
            open_name = StorageMeta(checkpoint_id=_STEP_SLOT)
            pickled = pickle.dumps(_vanilla(metadata, locations, open_name), protocol=_PROTOCOL)
            if pickled.count(_pickled_str(_STEP_SLOT)) != 1:  # cannot be: then keep nothing
                return pickle.dumps(_vanilla(metadata, locations, storage_meta), protocol=4)
            kept.state_dict_metadata, kept.planner_data = (
                metadata.state_dict_metadata,
                metadata.planner_data,
            )
            kept.version, kept.where, kept.pickled = metadata.version, where, pickled
    return kept.pickled.replace(_pickled_str(_STEP_SLOT), _pickled_str(step), 1)


def _vanilla(
    metadata: Metadata, locations: dict[Any, manifest.ItemLocation], storage_meta: Any
) -> Metadata:
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
    return dataclasses.replace(
        metadata_broadcast.plain(metadata), storage_data=storage_data, storage_meta=storage_meta
    )
