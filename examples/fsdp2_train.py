"""FSDP2 training on CPU ranks with asynchronous tiered checkpoints.

Run under torchrun, e.g. ``torchrun --nproc_per_node=2 examples/fsdp2_train.py --root runs/x``.
Resumes from the newest committed step if there is one. ``--kill-at N`` SIGKILLs every rank
at step N (a node failure), to show the resume.
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
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dcp_tiered import (
    CheckpointNotFoundError,
    TieredStorageReader,
    TieredStorageWriter,
    checkpoint_process_group,
)

warnings.filterwarnings("ignore", category=UserWarning)
DIM = 128


class TrainState(Stateful):
    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt, self.step = model, opt, 0

    def state_dict(self):
        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd, "step": self.step}

    def load_state_dict(self, sd) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.step = sd["step"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True, help="local checkpoint directory")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
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
    state = TrainState(model, opt)

    try:
        reader = TieredStorageReader(a.root, remote=a.remote)
        dcp.load({"train": state}, checkpoint_id="latest", storage_reader=reader)
        if rank == 0:
            print(f"resumed from {reader.checkpoint_id} (step {state.step})", flush=True)
    except BaseException as e:  # CheckpointException is a BaseException
        if not _is_not_found(e):
            raise
        if rank == 0:
            print("no checkpoint yet: starting from scratch", flush=True)

    # Steps committed locally but not yet uploaded by a crashed run are re-enqueued here.
    writer = TieredStorageWriter(a.root, remote=a.remote)
    group = checkpoint_process_group()  # async saves never share the training group
    pending = None
    losses = {}
    while state.step < a.steps:
        if state.step == a.kill_at:
            if rank == 0:
                print(f"step {state.step}: simulating a node failure (SIGKILL)", flush=True)
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(state.step)
        x = torch.randn(32, DIM, generator=g)
        loss = (model(x) - x.roll(1, dims=1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.step += 1
        losses[state.step] = loss.item()
        if state.step % a.save_every == 0:
            if pending is not None:
                pending.result()  # errors of the previous save surface here
            pending = dcp.async_save({"train": state}, checkpoint_id=f"step-{state.step}",
                                     storage_writer=writer, process_group=group)
            if rank == 0:
                print(f"step {state.step}: loss {loss.item():.6f}  async save started "
                      f"(stall {writer.last_stall_secs * 1e3:.1f} ms)", flush=True)
    if pending is not None:
        pending.result()
    if a.remote:
        writer.wait_durable(timeout_secs=300)  # only at the end: training never waited for it
    dist.barrier()
    if rank == 0:
        with open(a.losses, "w") as f:
            json.dump(losses, f)
        if a.remote:
            for step in sorted(os.listdir(a.root), key=lambda s: (len(s), s)):
                if not step.startswith("."):
                    print(f"  {step}: {writer.durability(step).value}", flush=True)
    dist.destroy_process_group()
    # torch 2.13's gloo can abort during interpreter teardown on CPU after all work is done;
    # everything is saved and flushed, so leave without it.
    sys.stdout.flush()
    os._exit(0)


def _is_not_found(e: BaseException) -> bool:
    failures = getattr(e, "failures", {})
    return isinstance(e, CheckpointNotFoundError) or any(
        isinstance(f[0] if isinstance(f, tuple) else f, CheckpointNotFoundError)
        for f in failures.values()
    )


if __name__ == "__main__":
    main()
