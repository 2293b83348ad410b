"""HF Trainer through dcp_tiered.shims.hf: a tiny GPT-2 (dropout 0.1, so RNG state matters).

    [torchrun --nproc_per_node=2] tests/workers/hf_resume.py --out DIR --phase PHASE
        [--mode async|sync] [--remote URL --storage-options JSON]

full: 8 steps, saving every 2 (save_total_limit 2); stop: the same, stopped after the save at
step 4; resume: a fresh Trainer, resume_from_checkpoint=True, to step 8; foreign: a user's
directory where checkpoint-4 goes fails training, then (moved away) it resumes; kill: process
0 is SIGKILLed while it writes step 4's data. Rank 0 writes the
final params to DIR/params-PHASE.pt and DIR/PHASE.json (the checkpoint dirs left).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from common import die_while_writing, finish, remote_arg
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from dcp_tiered.shims.hf import wrap

torch.set_num_threads(1)


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True  # after this step's save


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def foreign_files_in_the_way(trainer, run: Path, out: Path, rank: int) -> None:
    """A user's own directory sits where checkpoint-4 goes: training raises, on every rank, at
    one step; what each rank saw goes to foreign-R.json. The directory is then moved away
    (untouched), and the caller trains again on the same Trainer, resuming."""
    if rank == 0:
        (run / "checkpoint-4").mkdir(parents=True)
        (run / "checkpoint-4" / "notes.txt").write_text("my notes")
    barrier()
    try:
        trainer.train()
        seen = {"error": None}
    except Exception as e:  # noqa: BLE001 - recorded for the test
        seen = {"error": f"{type(e).__name__}: {e}", "at": trainer.state.global_step}
    (out / f"foreign-{rank}.json").write_text(json.dumps(seen))
    barrier()
    if rank == 0:
        (run / "checkpoint-4").rename(out / "moved-checkpoint-4")
    barrier()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--phase", required=True, choices=["full", "stop", "resume", "foreign", "kill"])
    p.add_argument("--mode", default="async")
    p.add_argument("--remote", default=None)
    p.add_argument("--storage-options", default="{}", help="JSON, for an S3 remote")
    p.add_argument("--fast-retry", action="store_true", help="give up on a failing remote soon")
    p.add_argument(
        "--zero",
        type=int,
        default=None,
        help="train under DeepSpeed ZeRO stage N "
        "(checkpoints then go through dcp_tiered.shims.deepspeed)",
    )
    a = p.parse_args()
    out = Path(a.out)
    run = out / ("run-full" if a.phase == "full" else "run")  # stop and resume share one
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    model = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(1)
    data = [
        {"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (64, 16), generator=gen)
    ]
    args = TrainingArguments(
        output_dir=str(run),
        max_steps=8,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=2,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=1,
        use_cpu=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        report_to=[],
        logging_steps=1,
        seed=42,
        dataloader_num_workers=0,
        disable_tqdm=True,
        deepspeed=None
        if a.zero is None
        else {
            "zero_optimization": {"stage": a.zero},
            "zero_allow_untested_optimizer": True,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": "auto", "torch_adam": True, "weight_decay": "auto"},
            },
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "steps_per_print": 10**9,
        },
    )
    trainer = wrap(
        Trainer(
            model=model,
            args=args,
            train_dataset=data,
            callbacks=[StopAt(4)] if a.phase == "stop" else [],
        ),
        mode=a.mode,
        remote=remote_arg(a.remote, json.loads(a.storage_options), a.fast_retry),
        storage_options=json.loads(a.storage_options),
    )
    if a.phase == "foreign":
        foreign_files_in_the_way(trainer, run, out, args.process_index)
    if a.phase == "kill" and args.process_index == 0:
        die_while_writing("checkpoint-4" if a.zero is None else "global_step4")
    try:  # returns once the last step is durable on the remote tier, or raises
        trainer.train(resume_from_checkpoint=True if a.phase in ("resume", "foreign") else None)
    except Exception as e:
        (out / f"{a.phase}-end-{args.process_index}.json").write_text(
            json.dumps({"error": f"{type(e).__name__}: {e}"})
        )
        raise
    if args.process_index == 0:
        torch.save(
            {k: v.detach().clone() for k, v in model.state_dict().items()},
            out / f"params-{a.phase}.pt",
        )
        left = sorted(n for n in os.listdir(run) if n.startswith("checkpoint-"))
        (out / f"{a.phase}.json").write_text(
            json.dumps(
                {
                    "left": left,
                    "step": trainer.state.global_step,
                    "files": sorted(os.listdir(run / left[-1])) if left else [],
                }
            )
        )
    if dist.is_initialized():  # as every multi-rank worker: no interpreter teardown, where
        finish()  # gloo sometimes aborts a finished job (dcp-cpu-findings)


if __name__ == "__main__":
    main()
