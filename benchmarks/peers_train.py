"""Training-loop throughput with each checkpointer against the same loop without one.

The loop of ``bench_manager.py`` (a CPU model, AdamW, a step of about --step-secs). Each
checkpointer saves as its users would, and ours at each peer's cadence: ours and DLRover to
host memory every step and to disk every 10; ``ours-disk`` (no memory tier), torch-checkpointing
(which has none) and DCP (``async_save`` + ``FileSystemWriter``) to disk every 10 steps,
asynchronously. DCP's writer, DLRover's saver and ours fsync what they write;
torch-checkpointing does not (``use_direct_io=False``), so its files are fsynced once each of
its saves ends, on a thread of this benchmark's, off the training thread (the local figures
add the same fsync).

``ours`` and ``ours-disk`` copy beside training (``async_snapshots=True``: memory snapshots
and disk saves' staging) and wait for the copy right before ``optimizer.step()``
(``wait_staged``), as torch-checkpointing's users hold its lock there; ``ours-sync`` is
``ours`` without (each copy within the step).

The unit of time is a *window*: one disk-save cycle, the step that starts a disk save and the
9 after it (--every), then the wait until that save is durable, so a window's throughput is
the loop's steady throughput at that cadence and no window's background work runs into the
next. The VM's own speed moves by 10-30 % over tens of seconds, far more than the
checkpointers differ, so the windows of every checkpointer and of the loop without one are
interleaved, a few seconds each, in an order that rotates from round to round (between two
windows the disk finishes earlier windows' writeback, untimed): a round is one window of
each, and each checkpointer's figure is the median over the rounds of its window's steps/s
over the same round's window without checkpoints, with the spread (min-max), and the ratio of
its total over all rounds to the loop's without checkpoints.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import psutil
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from bench_manager import Train, calibrate
from peers_lib import CADENCE_OF, DLRover, TorchCheckpointing, available, init_single_rank

from dcp_tiered import CheckpointManager, Every, SavePolicy
from dcp_tiered.staging import state_bytes

warnings.filterwarnings("ignore")


class Ours:
    """One manager for the whole run, as a training job has and as the peers here are kept
    (DLRover's saver process and shared memory, torch-checkpointing's manager and its staging
    buffers): every timed loop finds its buffers and slots made. Its steps go on counting
    from loop to loop; its own retention (the newest two) bounds the disk tier."""

    def __init__(self, root: Path, every: int, memory: bool, overlap: bool = False) -> None:
        # memory=False: "ours-disk", the disk cadence of DCP and torch-checkpointing
        self.shm = Path(tempfile.mkdtemp(prefix="dcp-tiered-train-", dir="/dev/shm"))
        self.mgr = CheckpointManager(
            memory=self.shm if memory else None,
            local=root,
            events=None,
            async_snapshots=overlap,
            policy=SavePolicy(
                memory=Every(steps=1) if memory else None,
                local=Every(steps=every),
                remote=None,
            ),
        )
        self.every = every
        self.last = 0

    def save(self, i: int, state: dict) -> None:
        """Window step ``i`` as a step after every earlier window's: step 0 of a window is a
        multiple of ``every``, a disk save."""
        if i == 0:
            self.last = (self.last // self.every + 1) * self.every
        else:
            self.last += 1
        self.mgr.save(self.last, state)

    def __enter__(self) -> None:
        """Around ``optimizer.step()``: the snapshot that copied beside this step's forward
        and backward is copied."""
        self.mgr.wait_staged()

    def __exit__(self, *exc: object) -> None:
        pass

    def wait(self) -> None:
        self.mgr.wait()

    def close(self) -> None:
        try:
            self.mgr.close()
        finally:
            shutil.rmtree(self.shm, ignore_errors=True)


def step(train: Train, lock) -> None:
    loss = train.model(train.x).pow(2).mean()
    train.opt.zero_grad()
    loss.backward()
    with lock:  # torch-checkpointing: no update while its async staging reads the state
        train.opt.step()


def window(name: str, train: Train, every: int, work: Path, peers: dict) -> tuple[float, float]:
    """Steps per second over one disk-save cycle (``every`` steps, the first of which starts
    a disk save, and the wait until that save is durable), and the CPU seconds of background
    work in it (:func:`_background_cpu`)."""
    work.mkdir(parents=True, exist_ok=True)
    lock = nullcontext()
    save, finish = (lambda i: None), (lambda: None)
    if name in ("ours", "ours-sync", "ours-disk"):
        ours = peers[name]
        save, finish = (lambda i: ours.save(i, train.state())), ours.wait
        if ours.mgr.async_snapshots:
            lock = ours
    elif name == "dlrover":
        dl = peers["dlrover"]

        def save(i: int) -> None:
            if i == 0:
                dl.disk_async(train.state())
            else:
                dl.memory(train.state())

        def finish() -> None:
            dl.wait()

    elif name == "torch-checkpointing":
        tc = peers["torch-checkpointing"]
        lock = tc.lock()

        def save(i: int) -> None:
            if i == 0:
                tc.save_async(work / "tc", train.state())

        finish = tc.wait
    elif name == "dcp":
        pending = []

        def save(i: int) -> None:
            if i == 0:
                pending.append(dcp.async_save(train.state(), storage_writer=FileSystemWriter(work)))

        def finish() -> None:
            pending.pop().result()

    try:
        start, cpu = time.perf_counter(), _background_cpu()
        for i in range(every):
            step(train, lock)
            save(i)
        finish()
        return every / (time.perf_counter() - start), _cpu_since(cpu)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if name == "dlrover":
            peers["dlrover"].clear()


def _background_cpu() -> tuple[float, dict[int, float]]:
    """CPU seconds used so far by everything but the training thread: this process's other
    threads (ours, DCP's, torch-checkpointing's staging), and per child process
    (torch-checkpointing's writer, DLRover's saver). Unlike wall time it hardly moves with the
    VM's speed: what a checkpointer's background work takes from a 2-vCPU machine."""
    own = time.process_time() - time.thread_time()  # called on the training thread
    kids = {}
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:  # gone meanwhile
            continue
        kids[child.pid] = times.user + times.system
    return own, kids


def _cpu_since(before: tuple[float, dict[int, float]]) -> float:
    """The background CPU seconds since ``before`` (:func:`_background_cpu`): a child that
    ended meanwhile counts nothing, rather than taking its whole past off the sum."""
    own, kids = _background_cpu()
    return own - before[0] + sum(secs - before[1].get(pid, 0.0) for pid, secs in kids.items())


def settle() -> None:
    """Let the disk finish what earlier loops wrote (their files are gone, their writeback
    may not be), so that it does not run into the next timed loop."""
    os.sync()
    time.sleep(0.2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=30, help="rounds: one window of each")
    p.add_argument("--step-secs", type=float, default=0.3)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--every", type=int, default=10, help="disk saves every N steps")
    p.add_argument("--no-warm-up", action="store_true", help="(the smoke test)")
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    logging.getLogger("dcp_tiered").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    init_single_rank()
    found = available()
    names = ["none", "ours", "ours-sync", "ours-disk", "dcp"] + [
        n for n in ("dlrover", "torch-checkpointing") if found.get(n)
    ]
    peers = {}  # one instance of each for the whole run (they keep processes)
    if found.get("dlrover"):
        peers["dlrover"] = DLRover(Path(a.dir) / "dlrover-all")
    if found.get("torch-checkpointing"):
        peers["torch-checkpointing"] = TorchCheckpointing()
    try:
        for name in ("ours", "ours-sync", "ours-disk"):
            root = Path(a.dir) / f"{name}-all"
            peers[name] = Ours(
                root, a.every, memory=name != "ours-disk", overlap=name != "ours-sync"
            )
        train = Train(a.width, a.layers, calibrate(a.width, a.layers, a.step_secs))
        # one untimed window of each: processes, shared memory and buffers exist before timing
        for name in [] if a.no_warm_up else names:
            window(name, train, a.every, Path(a.dir) / f"w-{name}", peers)
        rates: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, list[float]] = {n: [] for n in names}
        for run in range(a.runs):
            for name in names[run % len(names) :] + names[: run % len(names)]:
                settle()
                rate, secs = window(name, train, a.every, Path(a.dir) / name, peers)
                rates[name].append(rate)
                cpu[name].append(secs)
    finally:  # their processes, and the shared memory of ours
        for name in ("torch-checkpointing", "ours", "ours-sync", "ours-disk"):
            if name in peers:
                peers[name].close()
    paired = {
        n: [r / base for r, base in zip(rates[n], rates["none"], strict=True)]
        for n in names
        if n != "none"
    }
    result = {
        "state_mib": round(state_bytes(train.state()) / 2**20, 1),
        "step_secs": round(statistics.median(1 / r for r in rates["none"]), 3),
        "steps": a.every,
        "every": a.every,
        "steps_per_s": rates,
        "paired_ratios": paired,
        "vs_none": {n: statistics.median(r) for n, r in paired.items()},
        "spread": {n: [min(r), max(r)] for n, r in paired.items()},
        # each peer's windows against ours at its cadence, round by round: how often ours ran
        # faster, and in how many rounds
        "head_to_head": {
            peer: [sum(o > q for o, q in zip(rates[ours], rates[peer], strict=True)), a.runs]
            for peer, ours in CADENCE_OF.items()
            if peer in rates
        },
        # CPU seconds of background work per window (one disk save, and for ours and DLRover
        # nine memory snapshots), medians; "none" shows the floor (other threads' own ticks)
        "background_cpu_s": {n: round(statistics.median(c), 4) for n, c in cpu.items()},
        # the ratio of totals: every window's time, each checkpointer's against none's
        "pooled": {
            n: sum(1 / r for r in rates["none"]) / sum(1 / r for r in rates[n]) for n in paired
        },
    }
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
