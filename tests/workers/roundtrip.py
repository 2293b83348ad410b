"""save: train, checkpoint (sync/thread/process), record the full reference state.
load: build a differently initialised model, load 'latest', compare with the reference."""

from __future__ import annotations

import argparse
import json

import common  # noqa: F401  (sets sys.path)
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_tiered import TieredStorageReader, TieredStorageWriter, checkpoint_process_group
from tests._model import AppState, build, full_state, make_opt, mismatches, train_step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=["save", "load"])
    p.add_argument("--root", required=True)
    p.add_argument("--kind", default="fsdp2")
    p.add_argument("--mode", default="sync", choices=["sync", "thread", "process"])
    p.add_argument("--ref", required=True)
    p.add_argument("--out")
    p.add_argument("--nodes", type=int, default=1, help="simulated nodes, each its own root")
    p.add_argument("--train-during-save", action="store_true")
    p.add_argument("--remote", help="remote tier URL")
    p.add_argument("--storage-options", default="{}", help="JSON fsspec options")
    a = p.parse_args()
    remote = (
        dict(remote=a.remote, storage_options=json.loads(a.storage_options)) if a.remote else {}
    )
    rank, world = common.init()
    per_node = max(1, world // a.nodes)
    root = f"{a.root}/node{rank // per_node}" if a.nodes > 1 else a.root

    if a.action == "save":
        model = common.shard(build(seed=1), a.kind, world)
        opt = make_opt(model)
        for step in range(2):
            train_step(model, opt, step)
        ref = full_state(model, opt)
        app = AppState(model, opt, {"step": 2, "note": "saved", "lr": [0.5, 0.25]})
        writer = TieredStorageWriter(root, **remote)
        if a.mode == "sync":
            dcp.save({"app": app}, checkpoint_id="step-2", storage_writer=writer)
        else:
            kind = (
                AsyncCheckpointerType.THREAD
                if a.mode == "thread"
                else AsyncCheckpointerType.PROCESS
            )
            fut = dcp.async_save(
                {"app": app},
                checkpoint_id="step-2",
                storage_writer=writer,
                process_group=checkpoint_process_group(),
                async_checkpointer_type=kind,
            )
            if a.train_during_save:  # FSDP collectives on the default group meanwhile
                for step in range(2, 6):
                    train_step(model, opt, step)
            fut.result()
        if a.remote:
            writer.wait_durable(timeout_secs=120)
        if rank == 0:
            torch.save(ref, a.ref)
        dist.barrier()
    else:
        model = common.shard(build(seed=7), a.kind, world)
        opt = make_opt(model)
        train_step(model, opt, 99)  # materialise optimizer state (different values)
        app = AppState(model, opt)
        reader = TieredStorageReader(root, **remote)
        dcp.load({"app": app}, checkpoint_id="latest", storage_reader=reader)
        got = full_state(model, opt)
        if rank == 0:
            ref = torch.load(a.ref, weights_only=True)
            bad = mismatches(ref, got) + mismatches(
                {"step": 2, "note": "saved", "lr": [0.5, 0.25]}, app.extra, "extra"
            )
            common.write_json(a.out, {"mismatches": bad, "world": world})
        dist.barrier()
    common.finish()


if __name__ == "__main__":
    main()
