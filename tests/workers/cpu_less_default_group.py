"""The checkpoint lifecycle beside a training group that cannot run CPU collectives.

    torchrun --nproc_per_node=2 tests/workers/cpu_less_default_group.py --root DIR --out F.json

An NCCL-only default group cannot reduce a CPU tensor. No GPU here, so this stands in for one:
every torch.distributed collective called on the default group raises, as NCCL would for CPU
tensors, and is counted. A CheckpointManager then saves (memory, disk, remote; async), fails
a save on one rank, restores, and closes: all of it must run on the checkpoint layer's own
gloo groups. Writes what each rank saw to --out.
"""

from __future__ import annotations

import argparse
import functools

import common  # sets sys.path
import torch
import torch.distributed as dist

from dcp_tiered import (
    CheckpointManager,
    Every,
    SaveFailedError,
    SavePolicy,
)
from dcp_tiered.writer import _datafile

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "gather_object",
    "broadcast",
    "broadcast_object_list",
    "scatter_object_list",
    "barrier",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "reduce",
)
refused: list[str] = []


def refuse_the_default_group() -> None:
    for name in COLLECTIVES:
        original = getattr(dist, name)

        @functools.wraps(original)
        def guarded(*args, _original=original, _name=name, **kwargs):
            group = kwargs.get("group")
            if group is None or group is dist.group.WORLD:
                refused.append(_name)
                raise RuntimeError(f"{_name} on the default group: it has no CPU backend")
            return _original(*args, **kwargs)

        setattr(dist, name, guarded)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank, _ = common.init()
    refuse_the_default_group()
    policy = SavePolicy(memory=Every(steps=1), local=Every(steps=2), remote=Every(steps=4))
    tiers = {
        "memory": f"{a.root}/shm",
        "local": f"{a.root}/disk",
        "remote": f"file://{a.root}/remote",
        "policy": policy,
    }
    key = f"w{rank}"  # per rank: a tensor both ranks held would be written by rank 0 alone
    state = {key: torch.full((1024,), float(rank))}
    original = _datafile.write_file  # writes each data file, looked up per call
    failed = None
    mgr = CheckpointManager(**tiers)
    try:
        for step in range(1, 7):
            state[key] += 1
            if step == 6 and rank == 1:  # step 6's disk save fails on rank 1 alone

                def broken(*_a, **_k):
                    raise OSError("injected write failure")

                _datafile.write_file = broken
            mgr.save(step, state)
        mgr.close()
    except SaveFailedError as e:
        failed = str(e)
    finally:
        _datafile.write_file = original
    restored = {key: torch.zeros(1024)}
    with CheckpointManager(**tiers) as mgr:
        mgr.restore(restored)
        step = mgr.restored_step
    common.write_json(
        f"{a.out}.{rank}",
        {
            "refused": refused,
            "failed": failed,
            "restored_step": step,
            "restored": float(restored[key][0]),
        },
    )
    common.finish()


if __name__ == "__main__":
    main()
