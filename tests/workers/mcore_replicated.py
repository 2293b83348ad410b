"""The Megatron facade with peer replication on simulated nodes (one torchrun per node, one rank
each; the node id is torchrun's GROUP_RANK).

    torchrun --nnodes=2 --node-rank=K --nproc-per-node=1 ... mcore_replicated.py \\
        --out DIR --memory /dev/shm/PREFIX [--remote URL] [--pause-at N] [--attempt A]
        [--no-replication]

Each node has its own save directory ``OUT/node-K/ckpt`` and memory root ``PREFIX-node-K``.
The model is tensor-parallel across the nodes (TP = world size), so every rank holds shards no
other rank has. Memory every iteration, storage every ``--storage-every``; each rank logs to
``OUT/log-R.jsonl`` what it restored (``start``, digest of its model and optimizer shards) and,
per iteration, its loss and digest. With ``--pause-at N`` the job saves through N, waits until
N is copied to the partner and the newest storage checkpoint is on the remote, then trains on to the end without saving (the uninterrupted
continuation), writes ``OUT/ready-R`` and waits to be killed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import finish  # also puts the repo on sys.path
from mcore import snapshot

from tests import _megatron as mc


def digest(model: torch.nn.Module, opt: mc.TorchAdam) -> str:
    h = hashlib.sha256()
    for key, value in sorted(snapshot(model, opt).items()):
        h.update(key.encode())
        h.update(value.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--memory", required=True)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--storage-every", type=int, default=4)
    p.add_argument("--pause-at", type=int)
    p.add_argument("--attempt", type=int, default=0)
    p.add_argument("--no-replication", action="store_true")
    p.add_argument("--remote", help="the remote tier's URL (file://...)")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ["GROUP_RANK"])
    mc.patch_cuda_for_cpu()
    mc.init_parallel(tp=world)

    from dcp_tiered import Replication
    from dcp_tiered.shims import megatron as ckpt

    out = Path(a.out)
    ckpt.initialize(
        1,
        a.storage_every,
        2,
        out / f"node-{node}" / "ckpt.log",
        save=out / f"node-{node}" / "ckpt",
        memory=f"{a.memory}-node-{node}",
        remote=a.remote,
        replication=None if a.no_replication else Replication(),
        collective_timeout_secs=60,
    )
    model = mc.tiny_gpt(seed=1 + a.attempt)  # a restart starts from other weights
    opt = mc.TorchAdam(model)
    start = ckpt.load_checkpoint(model, opt, None)
    log = open(out / f"log-{rank}.jsonl", "a")  # noqa: SIM115 - open until the end or killed

    def record(**fields: object) -> None:
        log.write(json.dumps(fields) + "\n")
        log.flush()

    record(pid=os.getpid(), start=start, digest=digest(model, opt))
    saving = True
    for it in range(start, a.iters):
        # TP = world, so no data-parallel ranks: gradients are not averaged.
        loss = mc.train_step(model, opt, it, rank, average=False)
        if saving:
            ckpt.save_checkpoint_if_needed(it + 1, model, opt, None)
        record(iteration=it + 1, loss=loss, digest=digest(model, opt))
        if it + 1 == a.pause_at:
            ckpt.wait()  # the storage save done, and this iteration copied to the partner
            ckpt.wait_durable()  # and the newest storage checkpoint on the remote
            saving = False
    if a.pause_at is None:
        ckpt.close()
        finish()
    (out / f"ready-{rank}").write_text("ready")
    while True:  # SIGKILLed here, like a node that dies
        time.sleep(1)


if __name__ == "__main__":
    main()
