"""A deterministic FSDP2 training job driven by CheckpointManager (run under torchrun).

Every step draws its input from each rank's own RNG, applies dropout, and advances a per-rank
data cursor and an LR scheduler, so a resume is bit-exact only if weights, optimizer state,
RNG streams and data positions of every rank all come back. Rank 0 writes the step it is on
to --progress (the test kills the job there), and the final full state to --out.
"""

from __future__ import annotations

import argparse
import os
import random

import common  # before dcp_tiered: puts the repo on sys.path
import numpy as np
import torch
import torch.nn.functional as F

from dcp_tiered import CheckpointManager, Every, RankState, SaveFailedError, SavePolicy
from tests._model import DIM, AppState, build, full_state, make_opt


class Cursor:
    """A data loader's position (per rank)."""

    def __init__(self) -> None:
        self.pos = 0

    def next(self) -> int:
        self.pos += 1
        return self.pos

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = int(sd["pos"])


def every(spec: str) -> Every | None:
    if spec == "off":
        return None
    kind, _, value = spec.partition(":")
    return Every(steps=int(value)) if kind == "steps" else Every(secs=float(value))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--memory")
    p.add_argument("--disk", required=True)
    p.add_argument("--disk-per-rank", action="store_true", help="one local root per rank (nodes)")
    p.add_argument("--remote")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--memory-every", default="steps:1")
    p.add_argument("--disk-every", default="steps:5")
    p.add_argument("--remote-every", default="steps:10")
    p.add_argument("--progress")
    p.add_argument("--async-snapshots", action="store_true", help="wait_staged before updates")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank, world = common.init()
    if a.progress:
        common.write_json(f"{a.progress}.pid{rank}", os.getpid())
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    model = common.shard(build(seed=0), "fsdp2", world)
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.9)
    cursor = Cursor()
    app_state = {
        "train": AppState(model, opt, extra={"note": "managed"}),
        "rank": RankState(data=cursor, lr_scheduler=sched),
    }
    storage = None
    if os.environ.get("TEST_S3_ENDPOINT"):
        from tests.s3server import s3fs_options

        storage = s3fs_options(os.environ["TEST_S3_ENDPOINT"], "testing", "testing", 10)
    local = f"{a.disk}/rank{rank}" if a.disk_per_rank else a.disk
    mgr = CheckpointManager(
        memory=a.memory,
        local=local,
        remote=a.remote,
        storage_options=storage,
        policy=SavePolicy(
            memory=every(a.memory_every), local=every(a.disk_every), remote=every(a.remote_every)
        ),
        collective_timeout_secs=120,
        async_snapshots=a.async_snapshots,
    )
    result: dict = {"rank": rank}
    try:
        start = mgr.restore(app_state) or 0
        result["restored"] = mgr.restored_step
        for step in range(start, a.steps):
            if rank == 0 and a.progress:
                common.write_json(a.progress, step)
            x = torch.randn(16, DIM) + cursor.next() * 1e-3
            loss = model(F.dropout(x, p=0.2, training=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            mgr.wait_staged()  # the snapshot copying beside this step (async_snapshots)
            opt.step()
            sched.step()
            mgr.save(step, app_state)
        mgr.close()
    except SaveFailedError as e:
        result["error"] = str(e)
        result["failures"] = e.failures
    state = full_state(model, opt)
    if rank == 0 and "error" not in result:
        torch.save(state, a.out)
    common.write_json(f"{a.out}.rank{rank}.json", result)
    common.finish()


if __name__ == "__main__":
    main()
