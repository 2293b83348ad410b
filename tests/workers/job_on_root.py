"""One training job's checkpoints through CheckpointManager (run under torchrun): saves steps to
--root (and --remote), then, with --hold, keeps the job alive until --release exists (bounded), so
a test can start a second job beside it. Writes what happened to --report (rank 0): the steps
saved, or the error the manager raised at start."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import common  # before dcp_tiered: puts the repo on sys.path
import torch

from dcp_tiered import CheckpointManager, Every, Retention, RetentionPolicy, SavePolicy


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--remote")
    p.add_argument("--run-id")
    p.add_argument("--value", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--hold", action="store_true")
    p.add_argument("--release")
    p.add_argument("--report", required=True)
    a = p.parse_args()
    rank, world = common.init()
    report: dict = {"rank": rank}
    try:
        mgr = CheckpointManager(
            local=a.root,
            remote=a.remote,
            policy=SavePolicy(memory=None, local=Every(steps=1), remote=Every(steps=1)),
            retention=Retention(local=RetentionPolicy(keep_latest=a.keep)),
            run_id=a.run_id,
        )
    except Exception as e:  # noqa: BLE001 - what the test asserts on
        report.update(error=type(e).__name__, message=str(e))
    else:
        report["run_id"] = mgr.run_id
        state = {"w": torch.full((16, 16), a.value + rank), "n": torch.tensor([rank])}
        for step in range(1, a.steps + 1):
            mgr.save(step, {"app": {**state, "step": step}}, force=True)
        mgr.wait()
        report["saved"] = list(range(1, a.steps + 1))
        if rank == 0:
            Path(a.report).with_suffix(".ready").write_text("ready")
        deadline = time.monotonic() + 120
        while a.hold and not Path(a.release).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        mgr.close()
    if rank == 0:
        Path(a.report).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
