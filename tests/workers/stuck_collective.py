"""Saves where one rank joins DCP's collectives late: the early rank's writer must log one
error naming the phase and the fix, and the save must then complete normally."""

from __future__ import annotations

import argparse
import logging
import threading
import time

import common
import torch
import torch.distributed.checkpoint as dcp

import dcp_tiered.writer as writer_module
from dcp_tiered import TieredStorageReader, TieredStorageWriter, checkpoint_process_group


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append({"level": record.levelname, "msg": record.getMessage()})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--late-secs", type=float, default=3.0)
    a = p.parse_args()
    rank, _ = common.init()
    records = Records()
    logging.getLogger("dcp_tiered").addHandler(records)
    logging.getLogger("dcp_tiered").setLevel(logging.WARNING)
    group = checkpoint_process_group()
    writer = TieredStorageWriter(a.root, sync_files=False, collective_timeout_warn_secs=1.0)
    original = writer_module.TieredStorageWriter.write_data

    def slow_on_rank1(self, plan, planner):  # step-4: rank 1 writes late
        if self.checkpoint_id == "step-4" and rank == 1:
            time.sleep(a.late_secs)
        return original(self, plan, planner)

    writer_module.TieredStorageWriter.write_data = slow_on_rank1
    per_step = {}
    late = {"step-1": None, "step-2": 1, "step-3": 0, "step-4": None}  # who enters late
    for step, late_rank in late.items():
        if late_rank == rank:
            time.sleep(a.late_secs)
        before = len(records.seen)
        sd = {"w": torch.full((64,), float(len(per_step)))}
        dcp.save(sd, checkpoint_id=step, storage_writer=writer, process_group=group)
        per_step[step] = records.seen[before:]
    writer.close()
    watchers = [t.name for t in threading.enumerate() if "collective-watch" in t.name]
    got = {"w": torch.zeros(64)}
    dcp.load(
        got, checkpoint_id="step-4", storage_reader=TieredStorageReader(a.root), process_group=group
    )
    common.write_json(
        f"{a.out}.{rank}",
        {"records": per_step, "watchers": watchers, "loaded": got["w"].tolist()[0]},
    )
    common.finish()


if __name__ == "__main__":
    main()
