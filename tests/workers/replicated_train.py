"""managed_train's job on simulated nodes with peer replication (one torchrun per node).

Each node (torchrun's GROUP_RANK) has its own local root ``<disk>/node-<K>`` and its own memory
root ``<memory>-node-<K>``. Every rank logs, after each step, its loss and a digest of its whole
state (weights and optimizer shards, RNG streams, data cursor, scheduler), and after a restore
the digest of what it restored. With ``--pause-at K`` the job saves through step K, waits until
K is committed and replicated, then trains on to the end without saving (the continuation an
uninterrupted run would take), writes ``<log>.ready<rank>`` and waits to be killed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import time

import common  # before dcp_tiered: puts the repo on sys.path
import numpy as np
import torch
import torch.nn.functional as F
from managed_train import Cursor, every

from dcp_tiered import CheckpointManager, RankState, Replication, SavePolicy
from dcp_tiered.policy import memory_format as fmt
from tests._model import DIM, AppState, build, make_opt


def digest(app_state: dict) -> str:
    h = hashlib.sha256()
    resolved = {k: v.state_dict() for k, v in app_state.items()}
    for path, leaf in fmt.leaves(resolved):
        h.update(fmt.key(path).encode())
        if isinstance(leaf, torch.Tensor):
            h.update(str(leaf.dtype).encode())
            h.update(leaf.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--memory", required=True, help="memory root prefix: <memory>-node-<K>")
    p.add_argument("--disk", required=True, help="local roots: <disk>/node-<K>")
    p.add_argument("--remote")
    p.add_argument("--steps", type=int, default=17)
    p.add_argument("--disk-every", default="steps:5")
    p.add_argument("--remote-every", default="steps:10")
    p.add_argument("--factor", type=int, default=1)
    p.add_argument("--grouping", default="ring")
    p.add_argument("--no-replication", action="store_true")
    p.add_argument("--pause-at", type=int)
    p.add_argument("--records", required=True)
    a = p.parse_args()
    rank, world = common.init()
    node = int(os.environ["GROUP_RANK"])
    log = open(f"{a.records}.rank{rank}", "a")  # noqa: SIM115 - open until killed

    def record(**fields: object) -> None:
        log.write(json.dumps({**fields, "t": round(time.time(), 3)}) + "\n")
        log.flush()

    record(pid=os.getpid(), node=node)
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    model = common.shard(build(seed=0), "fsdp2", world)
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.9)
    cursor = Cursor()
    app_state = {
        "train": AppState(model, opt, extra={"note": "replicated"}),
        "rank": RankState(data=cursor, lr_scheduler=sched),
    }
    mgr = CheckpointManager(
        memory=f"{a.memory}-node-{node}",
        local=f"{a.disk}/node-{node}",
        remote=a.remote,
        policy=SavePolicy(local=every(a.disk_every), remote=every(a.remote_every)),
        collective_timeout_secs=60,
        replication=None if a.no_replication else Replication(factor=a.factor, grouping=a.grouping),
    )
    start = mgr.restore(app_state) or 0
    record(restored=mgr.restored_step, digest=digest(app_state))
    saving = True
    for step in range(start, a.steps):
        x = torch.randn(16, DIM) + cursor.next() * 1e-3
        loss = model(F.dropout(x, p=0.2, training=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if saving:
            mgr.save(step, app_state)
        record(step=step, loss=loss.item(), digest=digest(app_state))
        if step == a.pause_at:
            mgr.wait()  # committed here and copied to the partners
            saving = False
    if saving:
        mgr.close()
        common.write_json(f"{a.records}.done{rank}", True)
        common.finish()
    common.write_json(f"{a.records}.ready{rank}", True)
    while True:  # killed here, like a node that dies
        time.sleep(1)


if __name__ == "__main__":
    main()
