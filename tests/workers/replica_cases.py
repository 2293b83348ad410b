"""Peer replication's failure cases on 3 simulated nodes of 1 rank each (run under torchrun
--nproc_per_node=3; the node id comes from $TEST_NODE through Replication(node_key=...)).

Every rank's state is one tensor whose values say which step and rank it is. The job saves
steps 0-7 (disk and remote every 5, memory every step, copies in a ring n0 -> n1 -> n2 -> n0)
and closes. Then each case takes a copy of every tier, breaks it, and restores with a new
manager on the same ranks, recording per rank what it restored:

- ``partners``: n0 and n1 lost together (rank 0's copies were on n1).
- ``own``: rank 1's own snapshot of step 7 has a flipped byte.
- ``replica``: n0 lost, and n1's copy of rank 0's step 7 has a flipped byte.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import common  # before dcp_tiered: puts the repo on sys.path
import torch
import torch.distributed as dist

from dcp_tiered import CheckpointManager, Every, Replication, SavePolicy
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.tiers import memory_slots

STEPS = 8


def flip_a_byte(directory: str, step: str) -> None:
    """Corrupt the data of ``step`` in one rank's (or one copy's) memory slots."""
    backend = LocalBackend(directory)
    for slot, header in memory_slots.read_headers(backend).items():
        if header.step == step:
            path = backend.path_of(f"slot-{slot}.data")
            with open(path, "r+b") as f:
                f.seek(header.regions[0].offset + 5)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
            return
    raise AssertionError(f"{step} is not in {directory}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--memory", required=True)
    p.add_argument("--base", required=True)
    a = p.parse_args()
    rank, _ = common.init()
    os.environ["TEST_NODE"] = f"n{rank}"
    base = Path(a.base)

    def paths(case: str) -> tuple[str, str, str]:
        return f"{a.memory}-{case}-n{rank}", str(base / case / f"n{rank}"), str(base / case / "r")

    def manager(case: str) -> CheckpointManager:
        memory, local, remote = paths(case)
        return CheckpointManager(
            memory=memory,
            local=local,
            remote=remote,
            policy=SavePolicy(local=Every(steps=5), remote=Every(steps=5)),
            collective_timeout_secs=60,
            replication=Replication(node_key="TEST_NODE"),
        )

    state = {f"rank_{rank}": {"w": torch.zeros(1000), "step": -1}}
    mgr = manager("saved")
    for step in range(STEPS):
        state[f"rank_{rank}"] = {"w": torch.full((1000,), rank * 1000.0 + step), "step": step}
        mgr.save(step, state)
        mgr.wait()  # copied before the next step: which steps the copies hold is then fixed
    where = mgr.copies()  # status: where each step's copies are
    if rank == 0:
        common.write_json(base / "copies.json", where)
    mgr.close()

    memory, local, remote = paths("saved")
    for case, lost in (("partners", (0, 1)), ("own", ()), ("replica", (0,))):
        c_memory, c_local, c_remote = paths(case)
        if rank not in lost:  # a lost node comes back empty
            shutil.copytree(memory, c_memory)
            shutil.copytree(local, c_local)
        if rank == 0:
            shutil.copytree(remote, c_remote)
        if case == "own" and rank == 1:
            flip_a_byte(f"{c_memory}/rank-1", "step-7")
        if case == "replica" and rank == 1:
            flip_a_byte(f"{c_memory}/replica-0", "step-7")
        dist.barrier()
        restored = {f"rank_{rank}": {"w": torch.zeros(1000), "step": -1}}
        mgr = manager(case)
        mgr.restore(restored)
        mine = restored[f"rank_{rank}"]
        result = {
            "restored": mgr.restored_step,
            "step": mine["step"],
            "exact": bool(
                torch.equal(mine["w"], torch.full((1000,), rank * 1000.0 + mine["step"]))
            ),
        }
        mgr.close()
        common.write_json(base / f"{case}.rank{rank}.json", result)
        shutil.rmtree(c_memory, ignore_errors=True)
    shutil.rmtree(memory, ignore_errors=True)
    common.finish()


if __name__ == "__main__":
    main()
