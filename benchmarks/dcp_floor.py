"""DCP's own per-item cost: the floor under any storage plugin's save and load.

``dcp.save`` and ``dcp.load`` plan, flatten and hand over every item of the state before a
storage plugin sees a byte, and a plugin must answer each item (a ``WriteResult`` per write
item; the planner's ``resolve_tensor``/``commit_tensor`` per read item). This measures that
share alone, with plugins that store nothing: ``NullWriter`` writes no byte and ``NullReader``
reads none, under DCP's ``DefaultSavePlanner`` (plan caching on: the cheapest repeated save)
and ``DefaultLoadPlanner``. Beside it, in the same interleaved runs: ``dd`` of the same bytes,
a cold read of our files, our time to committed and our cold restore.

Where ``floor / dd`` or ``floor / cold read`` is already near an issue's target, the target is
out of reach of any plugin for that state shape; what is ours is ``ours - floor``.

    .venv/bin/python benchmarks/dcp_floor.py --state 20k --runs 5
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
import states
from figures import drop_cache, read_files
from peers_lib import init_single_rank

from dcp_tiered import (
    TieredLoadPlanner,
    TieredStorageReader,
    TieredStorageWriter,
    checkpoint_process_group,
)
from dcp_tiered.planner import TieredSavePlanner, planner_for

warnings.filterwarnings("ignore")


class NullWriter(StorageWriter):
    """Stores nothing; answers each write item as DCP requires (the planner resolves its
    data, as any writer must to get at the bytes). Keeps the metadata for ``NullReader``."""

    metadata: Metadata | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def write_data(self, plan, planner) -> Future[list[WriteResult]]:
        results = []
        for item in plan.items:
            planner.resolve_data(item)
            results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
        fut: Future[list[WriteResult]] = Future()  # DCP waits on a torch future
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results) -> None:
        NullWriter.metadata = metadata

    def storage_meta(self) -> StorageMeta | None:
        return None


class NullReader(StorageReader):
    """Reads nothing; DCP's load planning and item hand-over run as for any reader."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future[None]:
        for _item in plan.items:  # a reader visits each item at least once
            pass
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--state", default="20k", choices=sorted(states.NAMES))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", help="write the samples here")
    # on the disk the figures are about (not a tmpfs /tmp): benchmarks/results is ignored by git
    p.add_argument("--dir", default=str(HERE / "results"), help="where to write the steps")
    a = p.parse_args()
    logging.getLogger("dcp_tiered").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    init_single_rank()
    state = states.build(a.state, a.quick)
    target = states.zeros_like(state)
    nbytes = states.nbytes(state)
    pg = checkpoint_process_group()
    samples: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:
        os.sync()
        time.sleep(0.3)
        t = time.perf_counter()
        fn()
        samples.setdefault(name, []).append(time.perf_counter() - t)

    Path(a.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dcp-floor-", dir=a.dir) as tmp:
        work = Path(tmp)
        writer = TieredStorageWriter(work / "ours")
        save_planner = DefaultSavePlanner(enable_plan_caching=True)

        def floor_save() -> None:
            dcp.save(state, storage_writer=NullWriter(), planner=save_planner, process_group=pg)

        def ours_save(step: str) -> None:
            dcp.save(
                state,
                checkpoint_id=step,
                storage_writer=writer,
                planner=planner_for(writer),
                process_group=pg,
            )

        def dd() -> None:
            subprocess.run(
                ["dd", "if=/dev/zero", f"of={work / 'dd.bin'}", "bs=1M"]
                + [f"count={max(1, nbytes // 2**20)}", "conv=fdatasync"],
                check=True,
                capture_output=True,
            )
            (work / "dd.bin").unlink()

        def planners_save() -> None:  # our planner, no storage: what is left is DCP's and ours
            dcp.save(state, storage_writer=NullWriter(), planner=planners_planner, process_group=pg)

        planners_planner = TieredSavePlanner(enable_plan_caching=True, cache_key="null")
        for i in range(2):  # warm: plan caches, staging buffers, the page allocator
            floor_save()
            planners_save()
            ours_save(f"warm-{i}")
        assert NullWriter.metadata is not None
        step_dir = work / "ours" / "warm-1"
        files = sorted(q for q in step_dir.rglob("*") if q.is_file())
        for run in range(a.runs):
            timed("dcp_save_floor", floor_save)
            timed("planners_save", planners_save)
            timed("ours_commit", lambda run=run: ours_save(f"s{run}"))
            timed("dd", dd)
            for name, planner in (
                ("dcp_load_floor", DefaultLoadPlanner),
                ("planners_load", TieredLoadPlanner),
            ):
                null = NullReader(NullWriter.metadata)
                timed(
                    name,
                    lambda null=null, planner=planner: dcp.load(
                        target, storage_reader=null, planner=planner(), process_group=pg
                    ),
                )
            drop_cache(step_dir)
            timed("cold_read", lambda: read_files(files))
            drop_cache(step_dir)
            timed(
                "ours_restore",
                lambda: dcp.load(
                    target,
                    checkpoint_id="warm-1",
                    storage_reader=TieredStorageReader(work / "ours"),
                    planner=TieredLoadPlanner(),
                    process_group=pg,
                ),
            )
        writer.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"{states.NAMES[a.state]}, {nbytes / 2**20:.0f} MiB, medians of {a.runs} (seconds):")
    for k, v in med.items():
        print(f"  {k:16s} {v:8.4f}")
    r = {k: v / med["dd"] for k, v in med.items()}
    c = {k: v / med["cold_read"] for k, v in med.items()}
    print(
        f"  DCP save floor / dd          {r['dcp_save_floor']:.2f}   (ours / dd {r['ours_commit']:.2f})"
    )
    print(
        f"  DCP load floor / cold read   {c['dcp_load_floor']:.2f}   (ours {c['ours_restore']:.2f})"
    )
    print(
        f"  our planners, no storage     {r['planners_save']:.2f} x dd, {c['planners_load']:.2f} x cold read"
    )
    if a.json:
        Path(a.json).write_text(json.dumps({"state": a.state, "samples": samples}))


if __name__ == "__main__":
    main()
