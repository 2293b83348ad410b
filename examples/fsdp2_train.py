"""FSDP2 training on CPU ranks with a CheckpointManager: memory, local disk and remote tiers.

Run under torchrun, e.g. ``torchrun --nproc_per_node=2 examples/fsdp2_train.py --root runs/x``.
A snapshot goes to host memory every step, to the local disk every --save-every steps and to
the remote tier every 2 x --save-every steps. At start it resumes from the newest step that
verifies in any tier. ``--kill-at N`` SIGKILLs every rank at step N (a node failure): the
restart then resumes from the newest in-memory snapshot.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dcp_tiered import CheckpointManager, Every, RankState, SavePolicy

warnings.filterwarnings("ignore", category=UserWarning)
DIM = 128


class TrainState(Stateful):
    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self):
        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd) -> None:
        set_state_dict(
            self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True, help="local checkpoint directory")
    p.add_argument("--memory", help="memory-tier directory (default: under /dev/shm)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3, help="local-disk cadence in steps")
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--remote", help="remote tier: any fsspec URL (s3://..., file://...)")
    p.add_argument("--losses", required=True, help="JSON file for this run's losses")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(4)))
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1 + rank)  # each rank draws its own batches: its RNG state is saved
    app_state = {"train": TrainState(model, opt), "rank": RankState()}

    memory = a.memory or f"/dev/shm/dcp-tiered-{os.path.basename(os.path.abspath(a.root))}"
    mgr = CheckpointManager(
        memory=memory,
        local=a.root,
        remote=a.remote,
        policy=SavePolicy(
            memory=Every(steps=1),
            local=Every(steps=a.save_every),
            remote=Every(steps=2 * a.save_every),
        ),
        async_snapshots=True,  # a snapshot copies beside the next step: wait_staged() below
    )
    start = mgr.restore(app_state)  # newest step that verifies in memory, on disk or remote
    if rank == 0:
        print(
            "no checkpoint yet: starting from scratch"
            if start is None
            else f"resumed from step-{mgr.restored_step}",
            flush=True,
        )
    losses = {}
    for step in range(start or 0, a.steps):
        if step == a.kill_at:
            mgr.wait()  # let step-{kill_at - 1}'s snapshot land, so the demo shows it restored
            if rank == 0:
                print(f"step {step}: simulating a node failure (SIGKILL of every rank)", flush=True)
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(32, DIM)
        loss = (model(x) - x.roll(1, dims=1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        mgr.wait_staged()  # the last snapshot is copied: the state may change now
        opt.step()
        losses[step] = loss.item()
        where = mgr.save(step, app_state)  # returns once staged; the I/O runs in the background
        if rank == 0:
            tiers = "+".join(t for t in ("memory", "local", "remote") if getattr(where, t))
            print(
                f"step {step}: loss {loss.item():.6f}  saved to {tiers or 'nothing'} "
                f"(stall {mgr.last_stall_secs * 1e3:.1f} ms)",
                flush=True,
            )
    mgr.close()  # waits for saves and uploads; any rank's failure is raised on every rank
    if rank == 0:
        with open(a.losses, "w") as f:
            json.dump(losses, f)
    dist.barrier()
    dist.destroy_process_group()
    # torch 2.13's gloo can abort during interpreter teardown on CPU after all work is done;
    # everything is saved and flushed, so leave without it.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
