"""DeepSpeed round trip through dcp_tiered's checkpoint engine (real DeepSpeed, CPU, gloo).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 tests/workers/ds_roundtrip.py --out DIR --stage S
        [--bf16] [--mode sync|async|decoupled]

Trains 3 steps, saves (tag ``global_step3``), then trains 2 more steps while an async save is
written, and records the losses. A second engine, initialised differently, then loads the
checkpoint: its params and per-rank optimizer state must equal the state at the save, and its
next 2 losses must equal the first engine's. Writes ``result-R.json`` per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from common import finish, write_json  # also puts the repo on sys.path

from dcp_tiered.shims import deepspeed as ds_tiers
from tests._model import Tiny, clone, mismatches


def build(seed: int, stage: int, bf16: bool) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(seed)
    model = Tiny()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 32, (4, 8), generator=gen)
    return x, torch.randint(0, 32, (4, 8), generator=gen)


def train_step(engine: deepspeed.DeepSpeedEngine, step: int, rank: int) -> float:
    x, y = batch(step, rank)
    logits = engine(x)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 32), y.reshape(-1))
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def snapshot(engine: deepspeed.DeepSpeedEngine) -> dict:
    """Params (fp32 master copies where ZeRO keeps them) and this rank's optimizer state."""
    from deepspeed.utils import safe_get_full_fp32_param

    params = {}
    for name, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p) if engine.zero_optimization_stage() else None
        params[name] = (full if full is not None else p.detach()).clone().float()
    return {"params": params, "optim": clone(engine.optimizer.state_dict())}


def save_native(save_dir: Path, stage: int, bf16: bool, rank: int, live: Path) -> None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine = build(1, stage, bf16)
    for step in range(3):
        train_step(engine, step, rank)
    engine.save_checkpoint(str(save_dir), tag="global_step3")
    full = {
        name: {
            "param": safe_get_full_fp32_param(p).clone(),
            **{k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")},
        }
        for name, p in engine.module.named_parameters()
    }
    if rank == 0:
        torch.save(full, live)


def kill_while_writing() -> None:
    """SIGKILL this rank as soon as its background write of a data file starts."""
    from dcp_tiered.writer import _datafile  # writes each data file, looked up per call

    original = _datafile.write_file

    def write_then_die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    _datafile.write_file = write_then_die


def existing_tag(save_dir: Path, a: argparse.Namespace, rank: int) -> None:
    """Tag 'last' saved twice (stock DeepSpeed overwrites; we refuse), then two new tags: every
    call's outcome on this rank, and what flush says, go to existing-tag-R.json."""
    engine = build(1, a.stage, a.bf16)
    calls = []
    for step, tag in enumerate(["last", "last", "global_step2", "global_step3"]):
        train_step(engine, step, rank)
        try:
            engine.save_checkpoint(str(save_dir), tag=tag)
            calls.append([tag, None, ""])
        except Exception as e:  # noqa: BLE001 - recorded for the test
            calls.append([tag, type(e).__name__, str(e)])
    try:
        ds_tiers.flush(engine)
        flushed = None
    except Exception as e:  # noqa: BLE001
        flushed = f"{type(e).__name__}: {e}"
    write_json(
        Path(a.out) / f"existing-tag-{rank}.json",
        {"calls": calls, "flush": flushed, "latest": (save_dir / "latest").read_text()},
    )
    finish()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--mode", default="sync", choices=ds_tiers.MODES)
    p.add_argument("--remote", help="remote tier URL")
    p.add_argument("--storage-options", default="{}", help="JSON fsspec options")
    p.add_argument(
        "--phase",
        default="roundtrip",
        choices=[
            "roundtrip",
            "kill",
            "resume",
            "native",
            "existing-tag",
            "remote-save",
            "remote-restore",
            "record-end",
        ],
        help="kill: save global_step3, then SIGKILL every rank during the async "
        "write of global_step5; resume: load 'latest' and train 2 steps; "
        "native: save global_step3 with DeepSpeed's own engine and write the "
        "full fp32 params and Adam state to live.pt (for the converter test); "
        "existing-tag: save tag 'last' twice, then two more tags, recording "
        "what each call raised; remote-save: save global_step3, train 2 steps, "
        "flush (durable), then exit; remote-restore: load into a fresh engine; "
        "record-end: as remote-save, recording what flush raised",
    )
    a = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    save_dir = Path(a.out) / "ckpt"
    if a.phase == "native":
        save_native(save_dir, a.stage, a.bf16, rank, Path(a.out) / "live.pt")
        finish()
    remote = {"remote": a.remote, "storage_options": json.loads(a.storage_options)}
    ds_tiers.install(mode=a.mode, **(remote if a.remote else {}))
    if a.phase == "existing-tag":
        existing_tag(save_dir, a, rank)
    if a.phase == "remote-restore":
        engine = build(2, a.stage, a.bf16)
        path, client = engine.load_checkpoint(str(save_dir))  # nothing local: from the remote
        at_save = torch.load(
            Path(a.out) / f"at-save-{rank}.pt",  # written by this test
            weights_only=False,
        )
        diffs = mismatches(at_save, snapshot(engine))
        write_json(
            Path(a.out) / f"restored-{rank}.json",
            {
                "path": path,
                "diffs": diffs[:20],
                "client": client and client.get("note"),
                "resumed": [train_step(engine, s, rank) for s in (3, 4)],
            },
        )
        finish()

    if a.phase == "resume":
        engine = build(2, a.stage, a.bf16)
        path, _ = engine.load_checkpoint(str(save_dir))
        write_json(
            Path(a.out) / f"resume-{rank}.json",
            {
                "tag": os.path.basename(os.path.dirname(path)),
                "resumed": [train_step(engine, s, rank) for s in (3, 4)],
            },
        )
        finish()
    engine = build(1, a.stage, a.bf16)
    for step in range(3):
        train_step(engine, step, rank)
    at_save = snapshot(engine)
    engine.save_checkpoint(str(save_dir), tag="global_step3", client_state={"note": "hi", "n": 3})
    live = [train_step(engine, step, rank) for step in (3, 4)]  # while the write runs
    if a.phase == "record-end":  # what flush says (a remote that refuses writes, a full disk)
        try:
            ds_tiers.flush(engine)
            error = None
        except Exception as e:  # noqa: BLE001 - recorded for the test
            error = f"{type(e).__name__}: {e}"
        latest_file = save_dir / "latest"
        write_json(
            Path(a.out) / f"end-{rank}.json",
            {"error": error, "latest": latest_file.read_text() if latest_file.exists() else None},
        )
        finish()
    ds_tiers.flush(engine)
    latest = (save_dir / "latest").read_text()
    if a.phase == "remote-save":
        torch.save(at_save, Path(a.out) / f"at-save-{rank}.pt")
        write_json(Path(a.out) / f"live-{rank}.json", {"live": live, "latest": latest})
        finish()
    if a.phase == "kill":
        write_json(Path(a.out) / f"live-{rank}.json", {"live": live})
        dist.barrier()
        kill_while_writing()
        engine.save_checkpoint(str(save_dir), tag="global_step5")
        time.sleep(60)  # the kill comes from the write thread
        raise SystemExit("not killed")

    resumed = build(2, a.stage, a.bf16)
    _, client = resumed.load_checkpoint(str(save_dir))
    loaded = snapshot(resumed)
    diffs = mismatches(at_save, loaded)
    after = [train_step(resumed, step, rank) for step in (3, 4)]
    write_json(
        Path(a.out) / f"result-{rank}.json",
        {
            "latest": latest,
            "diffs": diffs[:20],
            "live": live,
            "resumed": after,
            "client": {k: client.get(k) for k in ("note", "n")},
            "engine": type(engine.checkpoint_engine).__name__,
            "files": sorted(os.listdir(save_dir / "global_step3")),
        },
    )
    finish()


if __name__ == "__main__":
    main()
