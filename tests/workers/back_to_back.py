"""Several async saves issued back to back, mutating the state in between, then checked."""

from __future__ import annotations

import argparse

import common
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_tiered import TieredStorageReader, TieredStorageWriter, checkpoint_process_group


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--mode", choices=["thread", "process"], required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank, world = common.init()
    kind = AsyncCheckpointerType.THREAD if a.mode == "thread" else AsyncCheckpointerType.PROCESS
    writer = TieredStorageWriter(a.root, staging_share_memory=a.mode == "process")
    group = checkpoint_process_group()
    sd = {"w": torch.zeros(256, 256), "meta": {"n": 0}}  # replicated: same on every rank
    futures = []
    for i in range(4):
        futures.append(
            dcp.async_save(
                sd,
                checkpoint_id=f"step-{i}",
                storage_writer=writer,
                process_group=group,
                async_checkpointer_type=kind,
            )
        )
        sd["w"].add_(1)  # the staged copy must not see this
        sd["meta"]["n"] += 1
    for f in futures:
        f.result()
    bad = []
    for i in range(4):
        got = {"w": torch.zeros(256, 256), "meta": {"n": -1}}
        dcp.load(got, checkpoint_id=f"step-{i}", storage_reader=TieredStorageReader(a.root))
        if not torch.equal(got["w"], torch.full((256, 256), float(i))) or got["meta"]["n"] != i:
            bad.append(i)
    if rank == 0:
        common.write_json(a.out, {"bad": bad})
    common.finish()


if __name__ == "__main__":
    main()
