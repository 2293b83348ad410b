"""A rank's data files: its items split into ``thread_count`` files written side by side into
the save's temporary directory, one WriteResult per file, and their removal when the write
fails. The bytes themselves are :mod:`dcp_tiered.item_writer`'s."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from .. import item_writer
from .._priority import lower_this_thread
from ..backends.local import LocalBackend
from ..policy import layout, manifest
from ..tiers import commit
from ..tiers.root import Tiers
from ._plan import SaveInfo, planned_bytes

logger = logging.getLogger("dcp_tiered.writer")  # the writer's one logger, whichever module

FILE_RESULT = "dcp_tiered:data-file:"  # the index of a data file's one WriteResult


def write_items(
    tiers: Tiers,
    save: SaveInfo,
    items: Sequence[WriteItem],
    planner: SavePlanner,
    *,
    thread_count: int,
    sync: bool,
) -> list[WriteResult]:
    """This rank's ``items`` in up to ``thread_count`` files of about equal size, written by
    one thread each (checksumming and torch.save framing are CPU-bound)."""
    buckets = item_writer.split_by_size(items, thread_count, planned_bytes)
    jobs = [
        (layout.data_file_name(save.rank, i), bucket) for i, bucket in enumerate(buckets) if bucket
    ]
    if len(jobs) <= 1:
        return [r for name, b in jobs for r in write_file(tiers, save, name, b, planner, sync)]
    with ThreadPoolExecutor(
        len(jobs), thread_name_prefix="dcp-tiered-write", initializer=lower_this_thread
    ) as pool:
        futures = [pool.submit(write_file, tiers, save, n, b, planner, sync) for n, b in jobs]
        return [r for f in futures for r in f.result()]


def write_file(
    tiers: Tiers,
    save: SaveInfo,
    name: str,
    items: Sequence[WriteItem],
    planner: SavePlanner,
    sync: bool,
) -> list[WriteResult]:
    with tiers.local.backend.open_write(save.tmp, name, sync=sync) as f:
        out = item_writer.write_items(f, items, planner.resolve_data)
    placed = item_writer.FileItems.of(name, save.rank, out)
    if tiers.remote is not None and save.promote:
        tiers.upload_early(
            save.step, save.save_id, name, placed.file_checksum, save.node, save.run_id
        )
    # One result for the whole file (see FileItems); finish() reads it back per item.
    return [
        WriteResult(
            index=MetadataIndex(f"{FILE_RESULT}{name}"),
            size_in_bytes=out.position,
            storage_data=placed,
        )
    ]


def locations(results: list[list[WriteResult]]) -> dict[Any, manifest.ItemLocation]:
    """Every item's location from every rank's results: a FileItems per data file, or (from
    other producers, benchmarks/scale.py) an ItemLocation per item."""
    out: dict[Any, manifest.ItemLocation] = {}
    for rs in results:
        for wr in rs:
            if isinstance(wr.storage_data, item_writer.FileItems):
                out.update(wr.storage_data.locations())
            else:
                out[wr.index] = wr.storage_data
    return out


def abandon_tmp(backend: LocalBackend, save: SaveInfo, lock: int | None, thread_count: int) -> None:
    """After a failed write: free its space now (e.g. after ENOSPC), and remove the
    temporary directory unless another rank of this node still writes into it (the save
    fails on every rank anyway; the next save's sweep takes what is left then)."""
    if lock is not None:
        LocalBackend.unlock(lock)
    try:
        for i in range(thread_count):
            backend.remove_file(save.tmp, layout.data_file_name(save.rank, i))
        if not backend.is_locked(save.tmp):
            commit.discard_tmp(backend, save.tmp, reason=f"the save of {save.step} failed")
    except OSError as e:  # the original error is the one to report
        logger.warning("could not remove the files of the failed save of %s: %s", save.step, e)
