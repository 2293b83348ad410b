"""Local figures of one state shape against the peers, in one process (one rank).

Per run, interleaved so that drift in the shared machine's load hits every figure alike:
memcpy into reused buffers; the caller's stall (ours ``dcp.async_save``, DLRover's save to
shared memory, torch-checkpointing's async save); our memory-tier snapshot until it is valid;
time to committed on local disk (ours, DLRover + fsync, torch-checkpointing + fsync, DCP
``FileSystemWriter(sync_files=True)``, ``dd conv=fdatasync`` of the same bytes); cold restores
(page cache dropped with ``posix_fadvise(DONTNEED)``, no root needed) of ours, DCP's,
torch-checkpointing's and ``torch.load`` of DLRover's file, and a cold read of our files.
Writes ``{"samples": {figure: [seconds, ...]}}`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
import states
from figures import drop_cache, read_files
from peers_lib import (
    DLRover,
    TorchCheckpointing,
    available,
    init_single_rank,
    torch_load_into,
)

from dcp_tiered import (
    CheckpointManager,
    Every,
    SavePolicy,
    TieredLoadPlanner,
    TieredStorageReader,
    TieredStorageWriter,
    checkpoint_process_group,
)
from dcp_tiered.planner import planner_for  # what CheckpointManager and the adapters use

warnings.filterwarnings("ignore")


class Local:
    def __init__(self, state: dict, work: Path, peers: dict) -> None:
        self.state, self.work = state, work
        self.target = states.zeros_like(state)
        self.bytes = states.nbytes(state)
        self.pg = checkpoint_process_group()
        self.writer = TieredStorageWriter(work / "ours")
        shm = Path(tempfile.mkdtemp(prefix="dcp-tiered-peers-", dir="/dev/shm"))
        self.shm = shm
        self.mgr = CheckpointManager(
            memory=shm,
            local=work / "mgr",
            events=None,
            policy=SavePolicy(memory=Every(steps=1), local=None, remote=None),
        )
        self.dlrover = DLRover(work / "dlrover") if peers.get("dlrover") else None
        self.samples: dict[str, list[float]] = {}
        self.errors: dict[str, str] = {}  # a peer that failed: its figures are left out
        self.tc = TorchCheckpointing() if peers.get("torch-checkpointing") else None
        # torch-checkpointing stages each tensor in a shared-memory file whose descriptor it
        # keeps open: past the process's limit its save fails, and the exhausted descriptors
        # then fail everyone else's saves in this process too
        count, limit = len(states.tensors(state)), resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if self.tc and count + 1000 > limit:
            self.tc.close()
            self.tc = None
            self.errors["torch-checkpointing"] = (
                f"not run: it keeps one open file per staged tensor ({count} tensors) and "
                f"RLIMIT_NOFILE here is {limit} (hard limit)"
            )
        self.seq = 0

    def settle_files(self) -> None:
        """settle() before a figure that writes the state's files (or reads them cold)."""
        settle(self.work / "touch.bin", self.bytes + 2**26)

    def record(self, name: str, secs: float) -> None:
        self.samples.setdefault(name, []).append(secs)

    def fresh(self, prefix: str) -> str:
        self.seq += 1
        return f"{prefix}-{self.seq}"

    def blank(self) -> dict:
        for part in self.target.values():
            for t in part.values():
                t.zero_()
        return self.target

    def check(self, who: str) -> None:
        if not states.equal(self.target, self.state):
            raise AssertionError(f"{who} restored different bytes")

    def timed_restore(self, name: str, directory: Path, load) -> None:
        drop_cache(directory)
        target = self.blank()
        t = time.perf_counter()
        load(target)
        self.record(name, time.perf_counter() - t)
        self.check(name)

    # -- the figures ------------------------------------------------------------------------
    def memcpy(self) -> None:
        t = time.perf_counter()
        for key, part in self.state.items():
            dst = self.target[key]
            for name, src in part.items():
                dst[name].copy_(src)
        self.record("memcpy", time.perf_counter() - t)

    def ours_stall(self) -> None:
        step = self.fresh("stall")
        t = time.perf_counter()
        fut = dcp.async_save(
            self.state,
            checkpoint_id=step,
            storage_writer=self.writer,
            planner=planner_for(self.writer),
            process_group=self.pg,
        )
        self.record("ours_stall", time.perf_counter() - t)
        fut.result()
        shutil.rmtree(self.work / "ours" / step)

    def ours_snapshot(self) -> None:
        self.seq += 1
        t = time.perf_counter()
        self.mgr.save(self.seq, {"train": self.state})
        self.record("ours_snapshot_stall", time.perf_counter() - t)
        self.mgr.wait()
        self.record("ours_snapshot", time.perf_counter() - t)

    def dd(self) -> None:
        target = self.work / "dd.bin"
        count = max(1, self.bytes // 2**20)
        t = time.perf_counter()
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={count}", "conv=fdatasync"],
            check=True,
            capture_output=True,
        )
        self.record("dd", time.perf_counter() - t)
        target.unlink()

    def ours_commit_restore(self) -> None:
        step = self.fresh("step")
        t = time.perf_counter()
        dcp.save(
            self.state,
            checkpoint_id=step,
            storage_writer=self.writer,
            planner=planner_for(self.writer),
            process_group=self.pg,
        )
        self.record("ours_commit", time.perf_counter() - t)
        step_dir = self.work / "ours" / step
        drop_cache(step_dir)
        t = time.perf_counter()
        read_files(sorted(p for p in step_dir.rglob("*") if p.is_file()))
        self.record("cold_read", time.perf_counter() - t)
        self.timed_restore(
            "ours_restore",
            step_dir,
            lambda target: dcp.load(
                target,
                checkpoint_id=step,
                storage_reader=TieredStorageReader(self.work / "ours"),
                planner=TieredLoadPlanner(),
                process_group=self.pg,
            ),
        )
        shutil.rmtree(step_dir)

    def dcp(self) -> None:
        path = self.work / self.fresh("dcp")
        t = time.perf_counter()
        dcp.save(
            self.state,
            storage_writer=FileSystemWriter(path, sync_files=True),
            process_group=self.pg,
        )
        self.record("dcp_commit", time.perf_counter() - t)
        self.timed_restore(
            "dcp_restore",
            path,
            lambda target: dcp.load(
                target, storage_reader=FileSystemReader(path), process_group=self.pg
            ),
        )
        shutil.rmtree(path)

    def dlrover_figures(self) -> None:
        self.dlrover.wait()
        self.record("dlrover_stall", self.dlrover.memory(self.state))
        commit, path = self.dlrover.commit(self.state)
        self.record("dlrover_commit", commit)
        self.timed_restore("torchload_restore", path, lambda t: torch_load_into(path, t))
        shutil.rmtree(path.parent)

    def tc_figures(self) -> None:
        path = self.work / self.fresh("tc")
        stall, commit = self.tc.save(path, self.state)
        self.record("tc_stall", stall)
        self.record("tc_commit", commit)
        self.timed_restore("tc_restore", path, lambda target: self.tc.load(path, target))
        shutil.rmtree(path)

    def run(self, runs: int) -> None:
        # warm-up, untimed: the memcpy target's pages, the peers' processes, and our buffers:
        # two saves each, since the staging buffers and the memory tier's slots come in pairs
        # (a save fills one while the other may still be written or sent); a training loop
        # has both warm from its second save on
        self.memcpy()
        for _ in range(2):
            self.ours_stall()
            self.ours_snapshot()
        if self.dlrover:
            self.peer("dlrover", lambda: self.dlrover.commit(self.state))
        if self.tc:
            self.peer(
                "torch-checkpointing", lambda: self.tc.save(self.work / "tc-warm", self.state)
            )
            shutil.rmtree(self.work / "tc-warm", ignore_errors=True)
        self.samples.clear()
        for _ in range(runs):
            # figures in memory only, into buffers made before (nothing for a touch to
            # spare them), then those that write or read files
            for figure in (self.memcpy, self.ours_stall, self.ours_snapshot):
                settle()
                figure()
            for figure in (self.dd, self.ours_commit_restore, self.dcp):
                self.settle_files()
                figure()
            if self.dlrover:
                self.settle_files()
                self.peer("dlrover", self.dlrover_figures)
            if self.tc:
                self.settle_files()
                self.peer("torch-checkpointing", self.tc_figures)

    def peer(self, name: str, figures) -> None:
        """A peer's failure is reported in the table, and does not end the run."""
        try:
            figures()
        except Exception as e:  # noqa: BLE001 - any failure of a peer is its result here
            self.errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
            if name == "dlrover":
                self.dlrover = None
            else:
                self.tc = None

    def close(self) -> None:
        try:
            self.writer.close()
            self.mgr.close()
        finally:  # the memory tier's slots, even after a failure
            shutil.rmtree(self.shm, ignore_errors=True)
        if self.tc:
            try:
                self.tc.close()
            except Exception as e:  # noqa: BLE001
                self.errors.setdefault("torch-checkpointing", f"close: {e}")
        shutil.rmtree(self.shm, ignore_errors=True)


def settle(touch: Path | None = None, touch_bytes: int = 0) -> None:
    """Before each figure: the disk's writeback of earlier figures' files done, and a pause
    for the kernel's freeing of the pages they dropped (a figure right after a gigabyte of
    files was deleted or dropped from the cache measured up to 5x its own time, memcpy too).

    Then twice ``touch_bytes`` written to files named after ``touch`` by a thread per core
    (at most 4), and deleted before any of it goes to the disk. A VM whose balloon device
    reports free memory to the hypervisor (virtio-balloon free page reporting, as on the 2-core
    VM) loses the backing of large free blocks after a few seconds, and whoever allocates one
    next faults it in on the host: the page cache of a new file was written at 0.4 GB/s
    instead of 4 GB/s, in the kernel's time, from wherever such blocks began (256 MiB: 57-60 ms
    within 2 s of freeing 512 MiB of files, 310-690 ms 4-8 s after), so any figure that writes
    or reads files paid up to 10x, in no pattern (our 2,000-tensor commit 0.19-0.48 s, one
    writer thread's 32 MiB writes taking 70-80 ms of CPU each, the other's 7 ms). The blocks of
    files just written and deleted on each core are the ones the next figure takes (memory
    touched and freed by the process does not do: its small pages are not the page cache's
    large blocks; a touch from one thread left one core's writes slow in a third of the
    tries)."""
    os.sync()
    time.sleep(0.5)
    if touch is None or not touch_bytes:
        return
    zeros = bytes(32 * 2**20)
    threads = min(len(os.sched_getaffinity(0)), 4)

    def write(path: Path) -> None:
        with open(path, "wb", buffering=0) as f:
            f.writelines(zeros for _ in range(0, 2 * touch_bytes // threads, len(zeros)))
        path.unlink()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, [touch.with_suffix(f".{i}") for i in range(threads)]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--state", required=True, choices=sorted(states.NAMES))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    logging.getLogger("dcp_tiered").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    init_single_rank()
    state = states.build(a.state, a.quick)
    work = Path(a.dir)
    bench = Local(state, work, available())
    try:
        bench.run(a.runs)
    finally:
        bench.close()
    info = {"tensors": len(states.tensors(state)), "bytes": bench.bytes}
    Path(a.out).write_text(json.dumps({**info, "samples": bench.samples, "errors": bench.errors}))


if __name__ == "__main__":
    main()
