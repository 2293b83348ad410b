"""A disk save copied beside training on real ranks (``async_snapshots`` without a memory
tier): rank 1 changes a tensor during its copy, rank 0 does not. Each rank writes what it saw
to <out>/rank<N>.json."""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import common  # before dcp_tiered: puts the repo on sys.path
import torch

from dcp_tiered import CheckpointManager, Every, SaveFailedError, SavePolicy
from dcp_tiered.staging import DoubleBufferStager


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank, _ = common.init()
    entered, opened = threading.Event(), threading.Event()
    copy = DoubleBufferStager._copy

    def held(stager, *args, **kwargs):
        entered.set()
        assert opened.wait(60)
        return copy(stager, *args, **kwargs)

    policy = SavePolicy(local=Every(steps=1), remote=None)
    mgr = CheckpointManager(local=a.root, events=None, policy=policy, async_snapshots=True)
    w = torch.full((1 << 12,), float(rank))
    state = {f"w{rank}": w}
    mgr.save(1, state)
    mgr.wait()
    DoubleBufferStager._copy = held
    mgr.save(2, state)
    assert entered.wait(60)
    if rank == 1:
        w.add_(1.0)  # no wait_staged
    opened.set()
    mgr.wait()  # the failure known, on both ranks
    DoubleBufferStager._copy = copy
    out: dict = {"raised": None}
    try:
        mgr.save(3, state)
    except SaveFailedError as e:
        out["raised"] = str(e)
        mgr.save(3, state)  # the failure is reported once: this one saves
    mgr.close()
    out["steps"] = sorted(p.name for p in Path(a.root).glob("step-*"))
    back = {f"w{rank}": torch.zeros_like(w)}
    with CheckpointManager(local=a.root, events=None) as again:
        out["restored"] = again.restore(back)
    out["equal"] = torch.equal(back[f"w{rank}"], w)
    Path(a.out, f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
