"""A job whose state is the same on every rank (a replicated model) plus each rank's own data
position, snapshotted to memory every step and to disk every 3 (run under torchrun with 2
ranks, then 1). Reports, on rank 0, the step and tier it restored from and its data position."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import common  # before dcp_tiered: puts the repo on sys.path
import torch

from dcp_tiered import CheckpointManager, Every, RankState, SavePolicy


class Cursor:
    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = int(sd["pos"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--memory", required=True)
    p.add_argument("--disk", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--report", required=True)
    a = p.parse_args()
    rank, world = common.init()
    cursor = Cursor()
    app = {"model": {"w": torch.zeros(8, 8)}, "rank": RankState(data=cursor)}
    mgr = CheckpointManager(
        memory=a.memory,
        local=a.disk,
        policy=SavePolicy(memory=Every(steps=1), local=Every(steps=3), remote=None),
    )
    start = mgr.restore(app) or 0
    for step in range(start, a.steps):
        app["model"]["w"] += 1
        cursor.pos += 1 + rank
        mgr.save(step, app)
    mgr.close()
    events = (Path(a.disk) / ".dcp-tiered-events.jsonl").read_text().splitlines()
    restored = [e for e in map(json.loads, events) if e["event"] == "restored"]
    if rank == 0:
        report = {"start": start, "restored": restored[-1] if restored else None}
        Path(a.report).write_text(json.dumps({**report, "pos": cursor.pos, "world": world}))
    common.finish()


if __name__ == "__main__":
    main()
