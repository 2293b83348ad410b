"""Five saves with DCP's plan caching and one state structure, values changing every step; the
fourth has rank 1 name another step. Each rank records (in --plan-log.RANK) whether DCP sent its
local plan or replayed the cached one; rank 0 writes what it found to --out."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import common
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_tiered import (
    SaveRequest,
    TieredStorageReader,
    TieredStorageWriter,
    checkpoint_process_group,
)


class LoggingPlanner(DefaultSavePlanner):
    """DCP's caching planner; appends "1" when this rank sent its local plan, "0" when DCP
    found it unchanged and replays the cached one (in a file: PROCESS mode plans elsewhere)."""

    def __init__(self, log: str) -> None:
        super().__init__(enable_plan_caching=True)
        self.log = log

    def create_local_plan(self):
        plan = super().create_local_plan()
        with open(self.log, "a") as f:
            f.write("1" if plan.usable else "0")
        return plan


def state(rank: int, i: int) -> dict:
    return {
        f"r{rank}": torch.full((128, 32), 10.0 * i + rank),  # this rank's own
        "shared": torch.arange(64.0) * (i + 1),  # replicated: DCP keeps one rank's
        "meta": {"step": i},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--nodes", type=int, default=1, help="simulated nodes, each its own root")
    p.add_argument("--mode", default="sync", choices=["sync", "thread", "process"])
    p.add_argument("--remote", help="remote tier URL; step-2 is kept local")
    p.add_argument("--plan-log", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank, world = common.init()
    roots = [f"{a.root}/node{n}" for n in range(a.nodes)] if a.nodes > 1 else [a.root]
    root = roots[rank * len(roots) // world]
    writer = TieredStorageWriter(root, remote=a.remote)
    planner = LoggingPlanner(f"{a.plan_log}.{rank}")
    pg = checkpoint_process_group() if a.mode != "sync" else None
    errors: dict[str, str] = {}
    for i in range(1, 6):
        step = "step-x" if i == 4 and rank == 1 else f"step-{i}"
        request = SaveRequest(step, promote=i != 2)
        try:
            if a.mode == "sync":
                dcp.save(
                    state(rank, i), checkpoint_id=request, storage_writer=writer, planner=planner
                )
            else:
                kind = (
                    AsyncCheckpointerType.THREAD
                    if a.mode == "thread"
                    else AsyncCheckpointerType.PROCESS
                )
                dcp.async_save(
                    state(rank, i),
                    checkpoint_id=request,
                    storage_writer=writer,
                    planner=planner,
                    process_group=pg,
                    async_checkpointer_type=kind,
                ).result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported to the test
            errors[step] = f"{type(e).__name__}: {e}"
    durability = {}
    if a.remote:
        writer.wait_durable(timeout_secs=120)
        dist.barrier()
        try:
            durability = {f"step-{i}": writer.durability(f"step-{i}").value for i in (1, 2, 3, 5)}
        except Exception as e:  # the saves' own errors say why a step is missing
            raise AssertionError(f"rank {rank}: {e}; the saves' errors: {errors}") from e
    writer.close(wait_durable=False)
    bad = []
    for i in (1, 2, 3, 5):  # each committed step loads back exactly
        # Another node's shards come from the remote tier; step-2 was kept local.
        full = a.nodes == 1 or (a.remote is not None and i != 2)
        want = {k: v for k, v in state(rank, i).items() if k == f"r{rank}" or full}
        if full:
            want.update({f"r{r}": state(r, i)[f"r{r}"] for r in range(world)})
        got = {
            k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": -1}
            for k, v in want.items()
        }
        dcp.load(
            got,
            checkpoint_id=f"step-{i}",
            planner=DefaultLoadPlanner(allow_partial_load=True),
            storage_reader=TieredStorageReader(root, remote=a.remote),
        )
        for k, v in want.items():
            same = torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
            if not same:
                bad.append(f"rank {rank} step-{i} {k}")
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"errors": errors, "bad": bad})
    if rank == 0:
        manifests = {
            f"{Path(r).name}/{d.name}": json.loads((d / "manifest.json").read_text())
            for r in roots
            for d in sorted(Path(r).iterdir())
            if (d / "manifest.json").exists()
        }
        common.write_json(
            a.out,
            {
                "ranks": gathered,
                "entries": {
                    Path(r).name: sorted(
                        x.name for x in Path(r).iterdir() if not x.name.startswith(".")
                    )
                    for r in roots
                },
                "save_ids": {k: m["save_id"] for k, m in manifests.items()},
                "steps": {k: m["step"] for k, m in manifests.items()},
                "durability": durability,
            },
        )
    dist.barrier()
    common.finish()


if __name__ == "__main__":
    main()
