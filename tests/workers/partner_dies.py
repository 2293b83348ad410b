"""A rank dies: 2 processes (two simulated nodes, started without torchrun, whose agent would
stop the survivor), with or without peer replication. Both save steps 0-2 to memory; rank 1
then SIGKILLs itself; rank 0 saves again and records what ``save`` raised.

Usage: partner_dies.py RANK PORT BASE replication|plain (rendezvous on 127.0.0.1:PORT).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import common  # before dcp_tiered: puts the repo on sys.path
import torch
import torch.distributed as dist

from dcp_tiered import CheckpointManager, Every, Replication, SavePolicy


def main() -> None:
    rank, port, base = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    replicated = sys.argv[4] == "replication"
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        TEST_NODE=f"n{rank}",
    )
    dist.init_process_group("gloo")
    mgr = CheckpointManager(
        memory=str(base / f"shm-{rank}"),
        local=str(base / f"disk-{rank}"),
        policy=SavePolicy(memory=Every(steps=1), local=Every(steps=100), remote=None),
        collective_timeout_secs=30,
        replication=Replication(node_key="TEST_NODE") if replicated else None,
    )
    state = {"w": torch.full((256,), float(rank))}
    for step in range(3):
        mgr.save(step, state)
        mgr.wait()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(2)  # the partner is gone
    outcome = {"raised": None}
    try:
        mgr.save(3, state)
        mgr.wait()
        mgr.save(4, state)
    except BaseException as e:  # noqa: BLE001 - what the caller gets is the answer
        outcome = {
            "raised": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__],
            "message": str(e),
        }
    common.write_json(base / "outcome.json", outcome)
    os._exit(0)  # the dead partner would make a clean shutdown wait


if __name__ == "__main__":
    main()
