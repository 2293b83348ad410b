"""HF Trainer with tiered DCP checkpoints: one added line (``wrap``) around a stock Trainer.

    .venv/bin/python examples/hf_trainer.py --output-dir /tmp/hf-run [--remote s3://bucket/run]
    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/hf_trainer.py --output-dir ...

Run it twice: the second run resumes from the newest committed checkpoint (local, or remote on a
fresh machine). Saves go through DCP async_save; save_total_limit never deletes a checkpoint
that is not yet on the remote tier.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from dcp_tiered.shims.hf import wrap


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--remote", default=None, help="fsspec URL of a remote tier (optional)")
    p.add_argument("--max-steps", type=int, default=20)
    a = p.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    )
    ids = torch.randint(0, 64, (256, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.max_steps,
        save_steps=2,
        save_total_limit=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        disable_tqdm=True,
    )
    # The added line: Trainer's checkpoints now go through dcp_tiered.
    trainer = wrap(Trainer(model=model, args=args, train_dataset=data), remote=a.remote)

    resume = trainer.dcp_tiered.latest()  # newest committed step on any tier, or None
    if args.process_index == 0:
        print(f"resumed from: {resume or 'none'}", flush=True)
    trainer.train(resume_from_checkpoint=resume is not None)
    if args.process_index == 0:
        print(
            f"done at step {trainer.state.global_step}; newest checkpoint: "
            f"{trainer.dcp_tiered.latest()}",
            flush=True,
        )


if __name__ == "__main__":
    main()
