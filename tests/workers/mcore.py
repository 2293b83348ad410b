"""megatron-core through dcp_tiered (real megatron-core, CPU, gloo).

    torchrun --nproc_per_node=2 tests/workers/mcore.py --out DIR --phase PHASE [...]

Phases:
- ``strategy`` [--async]: a tiny GPTModel with torch Adam trains 3 iterations and saves with
  ``dist_checkpointing.save(..., sharded_strategy=TieredSaveShardedStrategy())``, trains 2
  more (while an async save is written), then a fresh model and optimizer load the checkpoint
  with mcore's *stock* loader and train the same 2 iterations. ``result-R.json``: the losses
  of both, whether the loaded tensors equal the state at the save call bit for bit, and the
  same for a second load through TieredLoadShardedStrategy.
- ``reshard``: a [4, 6] tensor saved split on axis 0, loaded split on axis 1 (stock and tiered).
- ``legacy-save``: a tensor-parallel (TP = world size) GPTModel trains one iteration and writes
  Megatron-LM's legacy layout (``iter_0000001/mp_rank_XX/model_optim_rng.pt`` + tracker) into
  ``OUT/legacy``, the way ``--ckpt-format torch`` does.
- ``legacy-load``: after ``dcp-tiered convert megatron OUT/legacy OUT/converted``, a fresh TP
  model loads the result with mcore's stock loader; ``result-R.json`` lists the tensors that
  differ from this rank's legacy file.
- ``facade`` [--kill-at N] [--remote URL]: the EasyCkpt-style API over ``--iters`` iterations;
  ``losses-R.jsonl`` gets one line per iteration trained. With ``--kill-at N``, rank 0
  SIGKILLs itself right after iteration N's save call.
- ``trust``: the facade with a scheduler whose state holds an object of the worker's own class
  (weights_only refuses it). Without ``allow_pickle`` its memory and storage saves are refused
  on every rank; with it, iterations 1-3 save (memory, storage, memory) and load back from
  memory, then from storage alone. ``result-R.json`` says what happened.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import (  # also puts the repo on sys.path
    die_while_writing,
    finish,
    remote_arg,
    write_json,
)

from tests import _megatron as mc


def snapshot(model: torch.nn.Module, opt: mc.TorchAdam) -> dict[str, torch.Tensor]:
    out = {
        f"p.{k}": v.detach().clone()
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor)
    }
    for i, p in enumerate(opt.get_parameters()):
        for k, v in opt.optimizer.state.get(p, {}).items():
            out[f"o.{i}.{k}"] = v.detach().clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    if a.keys() != b.keys():
        return [f"keys differ: {sorted(a.keys() ^ b.keys())[:5]}"]
    return [k for k in a if not torch.equal(a[k], b[k])]


def phase_strategy(args: argparse.Namespace, rank: int) -> None:
    from megatron.core import dist_checkpointing

    from dcp_tiered.shims import megatron as shim
    from dcp_tiered.shims.megatron_strategy import (
        TieredLoadShardedStrategy,
        TieredSaveShardedStrategy,
    )

    model = mc.tiny_gpt(seed=1)
    opt = mc.TorchAdam(model)
    for it in range(3):
        mc.train_step(model, opt, it, rank)
    at_save = snapshot(model, opt)
    strategy = TieredSaveShardedStrategy()
    step_dir = os.path.join(args.out, "ckpt", shim.iteration_dir(3))
    if rank == 0:
        os.makedirs(step_dir, exist_ok=True)
    dist.barrier()
    if args.async_save:  # hold the write back until training has moved the weights on
        writer = strategy.writer(os.path.dirname(step_dir))
        write_data = writer.write_data
        writer.write_data = lambda *a, **k: (time.sleep(2), write_data(*a, **k))[1]
    request = dist_checkpointing.save(
        shim.state_dict(3, model, opt, None),
        step_dir,
        sharded_strategy=strategy,
        async_sharded_save=args.async_save,
    )
    reference = [mc.train_step(model, opt, it, rank) for it in (3, 4)]  # while it is written
    in_flight = strategy.in_flight is not None and not strategy.in_flight.done()
    if request is not None:
        for fn in request.finalize_fns:
            fn()
    strategy.close()
    result = {"reference": reference, "trained_while_in_flight": in_flight}
    for name, load_strategy in (("stock", None), ("tiered", TieredLoadShardedStrategy())):
        fresh = mc.tiny_gpt(seed=2)
        fresh_opt = mc.TorchAdam(fresh)
        loaded = dist_checkpointing.load(
            shim.state_dict(0, fresh, fresh_opt, None, is_loading=True),
            step_dir,
            sharded_strategy=load_strategy,
        )
        shim.apply_state(loaded, fresh, fresh_opt, None)
        result[name] = {
            "iteration": loaded["iteration"],
            "mismatches": same(at_save, snapshot(fresh, fresh_opt)),
            "losses": [mc.train_step(fresh, fresh_opt, it, rank) for it in (3, 4)],
        }
    result["files"] = sorted(os.listdir(step_dir))
    write_json(Path(args.out) / f"result-{rank}.json", result)


def phase_reshard(args: argparse.Namespace, rank: int, world: int) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from dcp_tiered.shims.megatron_strategy import (
        TieredLoadShardedStrategy,
        TieredSaveShardedStrategy,
    )

    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    rows, cols = 4 // world, 6 // world
    saved = {
        "w": ShardedTensor.from_rank_offsets(
            "layer.w", full[rank * rows : (rank + 1) * rows].clone(), (0, rank, world)
        )
    }
    step_dir = os.path.join(args.out, "ckpt", "iter_0000001")
    if rank == 0:
        os.makedirs(step_dir, exist_ok=True)
    dist.barrier()
    strategy = TieredSaveShardedStrategy()
    dist_checkpointing.save(saved, step_dir, sharded_strategy=strategy)
    strategy.close()
    result = {}
    for name, load_strategy in (("stock", None), ("tiered", TieredLoadShardedStrategy())):
        target = {
            "w": ShardedTensor.from_rank_offsets("layer.w", torch.zeros(4, cols), (1, rank, world))
        }
        got = dist_checkpointing.load(target, step_dir, sharded_strategy=load_strategy)["w"]
        result[name] = torch.equal(got, full[:, rank * cols : (rank + 1) * cols])
    write_json(Path(args.out) / f"result-{rank}.json", result)


def phase_legacy(args: argparse.Namespace, rank: int, world: int) -> None:
    # Same seed on every rank: with CPU initialisation each rank cuts its shard of one master.
    model = mc.tiny_gpt(seed=1 if args.phase == "legacy-save" else 7)
    legacy = os.path.join(args.out, "legacy")
    own = os.path.join(legacy, "iter_0000001", f"mp_rank_{rank:02d}", "model_optim_rng.pt")
    if args.phase == "legacy-save":
        opt = mc.TorchAdam(model)
        os.makedirs(os.path.dirname(own), exist_ok=True)
        torch.save(
            {
                "args": argparse.Namespace(tensor_model_parallel_size=world),
                "checkpoint_version": 3.0,
                "iteration": 1,
                "model": model.state_dict_for_save_checkpoint(),
                "optimizer": opt.optimizer.state_dict(),
                "opt_param_scheduler": {"num_steps": 1, "max_lr": 0.01},
            },
            own,
        )
        if rank == 0:
            Path(legacy, "latest_checkpointed_iteration.txt").write_text("1")
        return
    from megatron.core import dist_checkpointing

    from dcp_tiered.shims import megatron as shim

    loaded = dist_checkpointing.load(
        shim.state_dict(0, model, None, None), os.path.join(args.out, "converted", "iter_0000001")
    )
    shim.apply_state(loaded, model, None, None)
    source = torch.load(own, weights_only=False)["model"]
    mine = model.state_dict_for_save_checkpoint()
    tensors = [k for k, v in source.items() if isinstance(v, torch.Tensor)]
    write_json(
        Path(args.out) / f"result-{rank}.json",
        {
            "compared": len(tensors),
            "iteration": loaded["iteration"],
            "scheduler": loaded["opt_param_scheduler"],
            "mismatches": [k for k in tensors if not torch.equal(source[k], mine[k])],
        },
    )


class Position:
    """A user's own object (not io.BytesIO: megatron-core allowlists that one)."""

    def __init__(self, text: str) -> None:
        self.text = text


class Scheduler:
    def __init__(self, text: str) -> None:
        self.pos = Position(text)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


def phase_trust(args: argparse.Namespace, rank: int) -> None:
    import shutil

    from dcp_tiered.errors import ConfigError
    from dcp_tiered.shims import megatron as ckpt

    out, result = Path(args.out), {}
    model = mc.tiny_gpt(seed=1)
    opt = mc.TorchAdam(model)
    mc.train_step(model, opt, 0, rank)

    def start(name: str, **kw) -> None:
        ckpt.initialize(
            1,
            2,
            2,
            save=str(out / f"ckpt-{name}"),
            memory=str(out / f"shm-{name}"),
            async_save=False,
            **kw,
        )

    start("plain")
    for it in (1, 2):  # a memory save, then a storage save
        try:
            ckpt.save_checkpoint_if_needed(it, model, opt, Scheduler("p"))
            result[f"refused-{it}"] = None
        except ConfigError as e:
            result[f"refused-{it}"] = str(e)
    ckpt.close()
    result["plain-left"] = sorted(os.listdir(out / "ckpt-plain"))
    start("trusted", allow_pickle=True)
    for it in (1, 2, 3):
        ckpt.save_checkpoint_if_needed(it, model, opt, Scheduler(f"pos {it}"))
    ckpt.close()
    for source in ("memory", "storage"):
        if source == "storage":
            dist.barrier()
            if rank == 0:
                shutil.rmtree(out / "shm-trusted")
            dist.barrier()
        start("trusted", allow_pickle=True)
        back, fresh = Scheduler(""), mc.tiny_gpt(seed=2)
        result[f"from-{source}"] = [
            ckpt.load_checkpoint(fresh, mc.TorchAdam(fresh), back),
            back.pos.text,
        ]
        ckpt.close()
    write_json(out / f"result-{rank}.json", result)


def phase_facade(args: argparse.Namespace, rank: int) -> None:
    from dcp_tiered.shims import megatron as ckpt

    ckpt.initialize(
        1,
        args.storage_every,
        args.max_ckpt,
        args.log_file,
        save=args.ckpt or os.path.join(args.out, "ckpt"),
        memory=os.path.join(args.out, "shm"),
        remote=remote_arg(args.remote, json.loads(args.storage_options or "null"), args.fast_retry),
        async_save=not args.sync,
        storage_options=json.loads(args.storage_options or "null"),
        **({} if args.margin is None else {"free_space_margin_bytes": args.margin}),
    )
    if args.kill_in_storage_save is not None and rank == 0:
        die_while_writing(f"iter_{args.kill_in_storage_save:07d}")
    save_dir = Path(args.ckpt or os.path.join(args.out, "ckpt"))
    if args.foreign_at is not None and rank == 0:  # a user's directory where a save goes
        (save_dir / f"iter_{args.foreign_at:07d}").mkdir()
        (save_dir / f"iter_{args.foreign_at:07d}" / "notes.txt").write_text("my notes")
    model = mc.tiny_gpt(seed=1 + args.attempt)  # a restart starts from other weights
    opt = mc.TorchAdam(model)
    start = ckpt.load_checkpoint(model, opt, None)
    with open(Path(args.out) / f"losses-{rank}.jsonl", "a") as f:
        print(json.dumps({"start": start}), file=f, flush=True)
        for it in range(start, args.iters):
            loss = mc.train_step(model, opt, it, rank)
            print(json.dumps({"iteration": it + 1, "loss": loss}), file=f, flush=True)
            try:
                ckpt.save_checkpoint_if_needed(it + 1, model, opt, None)
            except Exception as e:
                if args.foreign_at is None:
                    raise
                # Recorded, the user's directory moved away (untouched), and training goes on.
                write_json(
                    Path(args.out) / f"failed-{rank}.json",
                    {"iteration": it + 1, "error": f"{type(e).__name__}: {e}"},
                )
                dist.barrier()
                if rank == 0:
                    (save_dir / f"iter_{args.foreign_at:07d}").rename(Path(args.out) / "moved")
                dist.barrier()
            if args.kill_at == it + 1 and rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
    try:
        ckpt.close()  # with a remote tier: returns once the last checkpoint is durable there
    except Exception as e:  # recorded for the test, then the exit says it too
        write_json(Path(args.out) / f"end-{rank}.json", {"error": f"{type(e).__name__}: {e}"})
        raise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--phase",
        choices=("strategy", "reshard", "facade", "trust", "legacy-save", "legacy-load"),
        required=True,
    )
    parser.add_argument("--async", dest="async_save", action="store_true")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--storage-every", type=int, default=4)
    parser.add_argument("--max-ckpt", type=int, default=2)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument(
        "--kill-in-storage-save",
        type=int,
        help="rank 0 is SIGKILLed while writing this iteration's storage save",
    )
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--remote")
    parser.add_argument("--storage-options", help="JSON fsspec options for --remote")
    parser.add_argument(
        "--fast-retry", action="store_true", help="give up on a failing remote soon"
    )
    parser.add_argument("--log-file")
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--ckpt", help="the facade's save directory (default OUT/ckpt)")
    parser.add_argument("--margin", type=int, help="the writer's free_space_margin_bytes")
    parser.add_argument(
        "--foreign-at",
        type=int,
        help="a user's directory sits where this "
        "iteration's storage save goes; the failure is recorded, the "
        "directory moved away, and training goes on",
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mc.patch_cuda_for_cpu()
    mc.init_parallel(tp=world if args.phase.startswith("legacy") else 1)
    if args.phase == "strategy":
        phase_strategy(args, rank)
    elif args.phase == "reshard":
        phase_reshard(args, rank, world)
    elif args.phase.startswith("legacy"):
        phase_legacy(args, rank, world)
    elif args.phase == "trust":
        phase_trust(args, rank)
    else:
        phase_facade(args, rank)
    dist.barrier()
    finish()


if __name__ == "__main__":
    main()
