"""Commit step-1, then SIGKILL ranks at a chosen point of saving step-2.

Kill points are reached by wrapping the function that marks the point; the victim kills itself
(or every rank, for 'all') with SIGKILL, so nothing gets to clean up.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import threading
import time

import common  # noqa: F401  (sets sys.path)
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dcp_tiered.item_writer
import dcp_tiered.staging
from dcp_tiered import TieredStorageWriter, checkpoint_process_group
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.tiers import commit
from tests._model import AppState, build, full_state, make_opt, train_step

POINTS = {}


def point(name):
    def register(fn):
        POINTS[name] = fn
        return fn

    return register


def die(pids: list[int]) -> None:
    for pid in pids:
        if pid != os.getpid():
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def wrap(owner, attr, kill, *, after=False, when=lambda *a, **k: True):
    original = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        if not after and when(*args, **kwargs):
            kill()
        result = original(*args, **kwargs)
        if after and when(*args, **kwargs):
            kill()
        return result

    setattr(owner, attr, wrapper)


@point("stage")
def _(kill):
    wrap(dcp_tiered.staging._torch_compat, "copy_state_dict", kill)
    wrap(dcp_tiered.staging.batch_copy, "copy_into", kill)


@point("local-plan")
def _(kill):
    wrap(TieredStorageWriter, "prepare_local_plan", kill)


@point("global-plan")
def _(kill):
    wrap(TieredStorageWriter, "prepare_global_plan", kill)


@point("write-first-byte")
def _(kill):
    wrap(LocalBackend, "write_vectors", kill)


@point("write-middle")
def _(kill):
    # the data files' writes (batched writev, made small here so that there are many) once a
    # file holds more than 150 kB
    dcp_tiered.item_writer._BATCH_BYTES = 64 * 2**10
    wrap(LocalBackend, "write_vectors", kill, when=lambda f, views: f.tell() > 150_000)


@point("fsync-data")
def _(kill):
    wrap(os, "fsync", kill)


@point("after-write-data")
def _(kill):
    wrap(TieredStorageWriter, "write_data", kill, after=True)


@point("before-manifest")
def _(kill):
    wrap(commit, "write_step_files", kill)


@point("between-manifest-and-metadata")
def _(kill):
    wrap(LocalBackend, "write_file", kill, when=lambda self, d, name, *a, **k: name == ".metadata")


@point("before-rename")
def _(kill):
    wrap(LocalBackend, "publish", kill)


@point("after-rename")
def _(kill):
    wrap(LocalBackend, "publish", kill, after=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--refdir", required=True)
    p.add_argument("--point", required=True)
    p.add_argument("--victim", required=True, help="a rank, or 'all'")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rank, world = common.init()
    pids: list[int] = [0] * world
    dist.all_gather_object(pids, os.getpid())
    group = checkpoint_process_group()

    model = common.shard(build(seed=1), "fsdp2", world)
    opt = make_opt(model)
    app = AppState(model, opt)
    writer = TieredStorageWriter(a.root)
    train_step(model, opt, 0)
    dcp.save({"app": app}, checkpoint_id="step-1", storage_writer=writer, process_group=group)
    ref1 = full_state(model, opt)
    train_step(model, opt, 1)
    ref2 = full_state(model, opt)
    if rank == 0:
        torch.save(ref1, f"{a.refdir}/step-1.pt")
        torch.save(ref2, f"{a.refdir}/step-2.pt")
    dist.barrier()

    victim = a.victim == "all" or int(a.victim) == rank
    kill = (lambda: die(pids)) if a.victim == "all" else (lambda: die([os.getpid()]))
    if a.point == "random":
        if rank == 0:
            delay = random.Random(a.seed).uniform(0.0, 1.5)
            threading.Timer(delay, kill).start()
    elif victim:
        POINTS[a.point](kill)
    fut = dcp.async_save(
        {"app": app}, checkpoint_id="step-2", storage_writer=writer, process_group=group
    )
    fut.result()
    time.sleep(2.0)  # let a pending random kill land inside or after the save
    dist.barrier()
    common.finish()


if __name__ == "__main__":
    main()
