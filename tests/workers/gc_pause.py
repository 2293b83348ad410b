"""Cyclic collection across a save on real ranks: paused from the writer's first hook to the
end of dcp.save on every rank, and given back when another rank's failure ends the save."""

from __future__ import annotations

import argparse
import gc
import json
import time

import common
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import TieredStorageReader, TieredStorageWriter, checkpoint_process_group


class Recording(DefaultSavePlanner):
    """The collector's state in DCP's own planning; a failure on one rank, when asked."""

    def __init__(self, fail_rank: int | None = None) -> None:
        super().__init__()
        self.fail_rank, self.seen = fail_rank, []

    def create_local_plan(self):
        self.seen.append(gc.isenabled())
        if self.fail_rank == torch.distributed.get_rank():
            raise RuntimeError("this rank fails its local plan")
        return super().create_local_plan()

    def finish_plan(self, plan):
        self.seen.append(gc.isenabled())
        return super().finish_plan(plan)


def back_on(secs: float = 5.0) -> float | None:
    """Seconds until the collector is on again (None: it stayed off)."""
    start = time.monotonic()
    while not gc.isenabled():
        if time.monotonic() - start > secs:
            return None
        time.sleep(0.01)
    return time.monotonic() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank, _ = common.init()
    group = checkpoint_process_group()
    # Many small tensors: enough allocations in DCP's plan collectives to collect, unpaused.
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(3000)}
    collections: list[int] = []
    gc.callbacks.append(lambda phase, info: collections.append(info["generation"]))
    out: dict = {}
    with TieredStorageWriter(a.root, sync_files=False) as writer:
        planner = Recording()
        # From no collection due: whether the first young one after the pause escalates to a
        # full one depends on the counts earlier code left (a flaky assertion otherwise)
        gc.collect()
        collections.clear()
        dcp.save(
            state,
            checkpoint_id="step-1",
            storage_writer=writer,
            planner=planner,
            process_group=group,
        )
        out["during_save"], out["collections_in_save"] = planner.seen, list(collections)
        out["back_after_save"] = back_on()
        planner = Recording(fail_rank=1)
        try:
            dcp.save(
                state,
                checkpoint_id="step-2",
                storage_writer=writer,
                planner=planner,
                process_group=group,
            )
            out["failed"] = False
        except CheckpointException:  # every rank sees rank 1's failure
            out["failed"] = True
        out["back_after_failure"] = back_on()
        # An async save: its planning and finish run on DCP's thread, while this one goes on.
        fut = dcp.async_save(
            state, checkpoint_id="step-3", storage_writer=writer, process_group=group
        )
        fut.result()
        out["async_done"] = True
        out["back_after_async"] = back_on()
    back = {k: torch.zeros(4) for k in state}
    gc.collect()
    collections.clear()
    dcp.load(
        back,
        checkpoint_id="step-1",
        storage_reader=TieredStorageReader(a.root),
        process_group=group,
    )
    out["collections_in_load"] = list(collections)
    out["back_after_load"] = back_on()
    out["loaded"] = all(torch.equal(back[k], state[k]) for k in state)
    with open(f"{a.out}.{rank}", "w") as f:
        json.dump(out, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
