"""A tiny megatron-core GPT with EasyCkpt-style tiered checkpoints (CPU, any rank count).

    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/megatron_gpt.py --save /tmp/mg
        [--remote s3://bucket/run] [--iters 20]

Snapshots go to host memory every iteration, to ``--save`` every 5 (in the background, then
to ``--remote``); 2 storage checkpoints are kept. Kill it at any point and run it again: it
resumes from the newest iteration that verifies, in memory, on disk or remote.

megatron-core's GPT forward assumes CUDA in three places; on a CPU-only machine this example
borrows the test suite's patches for them (``tests/_megatron.py``), and its stand-in for
Megatron's optimizers (which cannot be built without CUDA): torch Adam behind Megatron's
optimizer interface. On a GPU machine, pass Megatron's own model and optimizer instead.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from dcp_tiered.shims import megatron as ckpt
from tests import _megatron as cpu


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save", required=True)
    p.add_argument("--remote", default=None, help="fsspec URL of a remote tier (optional)")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cpu.patch_cuda_for_cpu()
    cpu.init_parallel()

    ckpt.initialize(
        save_mem_interval=1,
        save_storage_interval=5,
        max_ckpt_num=2,
        log_file_path=os.path.join(a.save, f"easyckpt-rank{rank}.log"),
        save=a.save,
        memory=os.path.join(a.save, "memory"),
        remote=a.remote,
    )
    model = cpu.tiny_gpt(seed=0)
    optimizer = cpu.TorchAdam(model)
    iteration = ckpt.load_checkpoint(model, optimizer, None)
    if rank == 0:
        print(f"resumed from iteration {iteration}", flush=True)
    while iteration < a.iters:
        loss = cpu.train_step(model, optimizer, iteration, rank)
        iteration += 1
        ckpt.save_checkpoint_if_needed(iteration, model, optimizer, None)
        if rank == 0:
            print(f"iteration {iteration} loss {loss:.4f}", flush=True)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
