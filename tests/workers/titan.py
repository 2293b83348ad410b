"""torchtitan's checkpoint manager on the tiers (real torchtitan, FSDP2, 2 CPU ranks, gloo).

    torchrun --nproc_per_node=2 tests/workers/titan.py --out DIR --folder DIR --mode MODE
        [--remote URL] [--steps 8] [--save-until N] [--attempt A] [--kill-in-save N] [--ft]

The job is what torchtitan's ``Trainer.train`` does around its checkpointer: the configuration
names torchtitan's stock ``CheckpointManager.Config``, the override entry a user lists in
``--override.imports`` replaces it (torchtitan's own ``apply_overrides``), ``build`` makes the
manager with torchtitan's ``OptimizersContainer`` and ``LRSchedulersContainer``, ``load`` runs
at start, then per step: forward/backward, ``maybe_wait_for_staging``, optimizer and scheduler
steps, ``save(step, last_step=...)``; ``close`` at the end. Saves every 2 steps while the step
is at most ``--save-until`` (then training goes on unsaved: the uninterrupted continuation).
``OUT/log-R.jsonl`` gets, per process, ``{"pid", "start", "digest"}`` (what was restored) and,
per step, its loss and the digest of this rank's model and optimizer shards after it.
``--ft``: torchft's ``TorchFTCheckpointManager`` (fault tolerance off), through
``dcp_tiered.shims.torchtitan_ft``. ``--kill-in-save N``: rank 0 is SIGKILLed as it starts
writing step N. ``--model-only-last``: torchtitan's default final save, model only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import (
    die_while_writing,
    finish,
    init,
    remote_arg,
    shard,
    write_json,
)  # puts the repo on sys.path

from tests import _model


class TrainState:
    """What torchtitan's Trainer saves as ``train_state``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def digest(model: torch.nn.Module, optimizers) -> str:
    h = hashlib.sha256()
    tensors = {f"m.{k}": v for k, v in model.state_dict().items()}
    tensors.update({f"o.{k}": v for k, v in optimizers.state_dict().items()})
    for key, value in sorted(tensors.items()):
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            h.update(key.encode())
            h.update(local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{key}={value!r}".encode())
    return h.hexdigest()


def build_checkpointer(args, model, optimizers, schedulers, train_state):
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.config import Configurable, OverrideConfig, apply_overrides

    if args.ft:
        from torchtitan.experiments.torchft.checkpoint import TorchFTCheckpointManager as Stock

        entry = "dcp_tiered.shims.torchtitan_ft.tiered_torchft_checkpoint"
    else:
        Stock, entry = CheckpointManager, "dcp_tiered.shims.torchtitan.tiered_checkpoint"

    @dataclass(kw_only=True, slots=True)
    class Job(Configurable.Config):  # the part of torchtitan's Trainer.Config that matters
        checkpoint: CheckpointManager.Config = field(default_factory=CheckpointManager.Config)

    job = Job(
        checkpoint=Stock.Config(
            enable=True,
            folder=args.folder,
            interval=2,
            keep_latest_k=2,
            async_mode=args.mode,
            last_save_model_only=args.model_only_last,
        )
    )
    remote = remote_arg(args.remote, None, args.fast_retry)  # a RemoteConfig with --fast-retry
    tiers = {"remote": remote, "collective_timeout_secs": 60.0}
    replaced = apply_overrides(OverrideConfig(imports=[(entry, tiers)]), job)
    assert len(replaced) == 1 and type(job.checkpoint).__qualname__.startswith("Tiered"), replaced
    return job.checkpoint.build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder="",
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--folder", required=True)
    p.add_argument("--mode", choices=("disabled", "async", "async_with_pinned_mem"), required=True)
    p.add_argument("--remote")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-until", type=int, default=10**6)
    p.add_argument("--attempt", type=int, default=0)
    p.add_argument("--kill-in-save", type=int)
    p.add_argument("--ft", action="store_true")
    p.add_argument("--model-only-last", action="store_true")
    p.add_argument("--fast-retry", action="store_true", help="give up on a failing remote soon")
    args = p.parse_args()
    rank, world = init()

    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    model = shard(_model.build(seed=1 + args.attempt), "fsdp2", world)  # a restart: other weights
    optimizers = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
        ],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=args.steps
    )
    train_state = TrainState()
    checkpointer = build_checkpointer(args, model, optimizers, schedulers, train_state)
    if args.kill_in_save is not None and rank == 0:
        die_while_writing(f"step-{args.kill_in_save}")

    out = Path(args.out)
    log = open(out / f"log-{rank}.jsonl", "a")  # noqa: SIM115 - open until the end or killed

    def record(**fields) -> None:
        log.write(json.dumps(fields) + "\n")
        log.flush()

    initial = digest(model, optimizers)
    checkpointer.load(step=-1)
    record(
        pid=os.getpid(), initial=initial, start=train_state.step, digest=digest(model, optimizers)
    )
    while train_state.step < args.steps:
        train_state.step += 1
        step = train_state.step
        x = _model.batch(1000 * step + rank)
        optimizers.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        if step <= args.save_until:
            checkpointer.save(step, last_step=step == args.steps)
        record(step=step, loss=loss.item(), digest=digest(model, optimizers))
    try:
        checkpointer.close()  # the trainer's close: waits until every step is durable
    except Exception as e:
        write_json(out / f"end-{rank}.json", {"error": f"{type(e).__name__}: {e}"})
        raise
    finish()


if __name__ == "__main__":
    main()
