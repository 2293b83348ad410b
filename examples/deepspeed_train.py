"""DeepSpeed training with tiered DCP checkpoints: one line added to a DeepSpeed script.

    DS_ACCELERATOR=cpu .venv/bin/torchrun --standalone --nproc_per_node=2 \\
        examples/deepspeed_train.py --save-dir /tmp/ds-run [--remote s3://bucket/run] [--steps 20]

Run it twice: the second run resumes from the newest published checkpoint. ZeRO stage 2 on
CPU with gloo; ``--stage`` picks another.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from dcp_tiered.shims import deepspeed as ds_tiers


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save-dir", required=True)
    p.add_argument("--remote", default=None, help="fsspec URL of a remote tier (optional)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--stage", type=int, default=2)
    a = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")

    # The one added line: every engine built after it checkpoints through dcp_tiered.
    ds_tiers.install(mode="async", remote=a.remote)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 8,
            "zero_optimization": {"stage": a.stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        },
    )
    # The newest checkpoint on either tier: with --remote, also on a fresh node whose save_dir
    # is empty. (None, None) on a first run.
    path, client = engine.load_checkpoint(a.save_dir)
    start = client["next_step"] if path else 0
    rank = dist.get_rank()
    for step in range(start, a.steps):
        gen = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 8, (8,), generator=gen)
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        if (step + 1) % a.save_every == 0:
            # Returns once the state is staged; 'latest' moves when every rank's data is on disk.
            engine.save_checkpoint(a.save_dir, client_state={"next_step": step + 1})
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    ds_tiers.flush(engine)  # the last checkpoint is committed, published and durable
    if rank == 0:
        latest = Path(a.save_dir, "latest").read_text()
        print(f"done at step {a.steps}; latest = {latest}", flush=True)
    # Before the interpreter exits: a gloo group left to the C++ teardown can abort a finished
    # job ("terminate called without an active exception").
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
