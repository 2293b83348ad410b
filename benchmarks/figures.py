"""One configuration of the benchmark suite (a size and a rank count), run under torchrun.

Every rank holds ``gib / world`` GiB of fp32 tensors (its own shard of the state, as FSDP
would). Each figure of ours and each baseline is timed from a barrier to a barrier, so a time
is the slowest rank's; caller stalls are each rank's own, and the slowest is kept. Runs of all
figures are interleaved, so drift in the shared machine's load hits every figure alike.
Rank 0 writes the raw samples as JSON; ``suite.py`` turns them into ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import s3fs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter

from dcp_tiered import (
    RemoteConfig,
    TieredStorageReader,
    TieredStorageWriter,
    checkpoint_process_group,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.s3server import s3fs_options

warnings.filterwarnings("ignore")
TENSOR_MIB = 32
PLAN_TENSORS = 2000  # figures 11 and 12: many small tensors, so that planning is what shows


class _OursPlanner(DefaultSavePlanner):
    """DCP keeps cached plans per planner class: one class per writer kind keeps ours and
    FileSystemWriter's cached plans apart."""


class _DcpPlanner(DefaultSavePlanner):
    pass


def _probe(cls: type) -> type:
    """``cls`` noting when DCP hands it the final plan: planning is over for this rank."""

    class Probe(cls):  # type: ignore[misc, valid-type]
        planned_at = 0.0

        def write_data(self, plan, planner):
            self.planned_at = time.perf_counter()
            return super().write_data(plan, planner)

    return Probe


def make_state(rank: int, per_rank_bytes: int) -> dict[str, torch.Tensor]:
    tensor_bytes = min(TENSOR_MIB * 2**20, per_rank_bytes)
    n = max(1, per_rank_bytes // tensor_bytes)
    gen = torch.Generator().manual_seed(rank)
    return {f"r{rank}.t{i:03d}": torch.randn(tensor_bytes // 4, generator=gen) for i in range(n)}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def drop_cache(directory: Path) -> None:
    """Evict a directory's files from the page cache (clean pages only: they were fsynced)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_files(paths: list[Path]) -> None:
    """The cold-read baseline: each file read once, sequentially, into a reused buffer."""
    buf = bytearray(16 * 2**20)
    view = memoryview(buf)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


class PeakRss:
    """Samples this process's resident memory every few ms; ``peak`` is the highest seen."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.002)

    def __enter__(self) -> PeakRss:
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.work = Path(a.dir)
        self.state = make_state(self.rank, int(a.gib * 2**30) // self.world)
        self.bytes = nbytes(self.state)
        self.pg = checkpoint_process_group()
        self.writer = TieredStorageWriter(self.work / "ours")
        self.part_mib, self.concurrency = a.part_mib, a.concurrency
        self.verify_uploads: bool | str = "auto" if not a.no_verify_uploads else False
        self.seq = 0
        self.samples: dict[str, list[float]] = {}
        # Restores load into one set of tensors, as into a model that already exists; zeroed
        # (untimed) before each load so that every load has to deliver every byte.
        self.target = {k: torch.zeros_like(v) for k, v in self.state.items()}
        self.plan_state = {
            f"r{self.rank}.p{i:04d}": torch.full((256,), float(i)) for i in range(a.plan_tensors)
        }
        self.plan_warm = False

    # -- helpers ---------------------------------------------------------------------------
    def fresh(self, prefix: str) -> str:
        self.seq += 1
        return f"{prefix}-{self.seq}"

    def slowest(self, secs: float) -> float:
        t = torch.tensor([secs], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def timed(self, fn: Callable[[], object]) -> float:
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t

    def record(self, name: str, secs: float) -> None:
        self.samples.setdefault(name, []).append(secs)

    def blank_target(self) -> dict[str, torch.Tensor]:
        for t in self.target.values():
            t.zero_()
        return self.target

    def check_target(self) -> None:
        assert all(torch.equal(self.target[k], v) for k, v in self.state.items())

    def remove(self, path: Path) -> None:
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    # -- figures 1 and 2: the caller's stall -----------------------------------------------
    def copy_baseline(self) -> float:
        """copy_ into preallocated tensors: the restore target serves (it is rewritten anyway)."""
        dist.barrier()
        t = time.perf_counter()
        for k, v in self.state.items():
            self.target[k].copy_(v)
        return self.slowest(time.perf_counter() - t)

    def async_stall(self, writer: object, step: str) -> float:
        dist.barrier()
        t = time.perf_counter()
        fut = dcp.async_save(
            self.state, checkpoint_id=step, storage_writer=writer, process_group=self.pg
        )
        stall = time.perf_counter() - t
        fut.result()
        return self.slowest(stall)

    def ours_stall(self) -> float:
        step = self.fresh("stall")
        stall = self.async_stall(self.writer, step)
        self.remove(self.work / "ours" / step)
        return stall

    def dcp_stall(self) -> float:
        path = self.work / self.fresh("dcp-async")
        stall = self.async_stall(FileSystemWriter(path), str(path))
        self.remove(path)
        return stall

    # -- figures 3, 4 and 7: committed on local disk, restored from it ---------------------
    def dd(self) -> float:
        target = self.work / f"dd-{self.rank}.bin"
        count = max(1, self.bytes // 2**24)
        took = self.timed(
            lambda: subprocess.run(
                [
                    "dd",
                    "if=/dev/zero",
                    f"of={target}",
                    "bs=16M",
                    f"count={count}",
                    "conv=fdatasync",
                ],
                check=True,
                capture_output=True,
            )
        )
        target.unlink()
        return took

    def ours_commit_and_restore(self) -> tuple[float, float, float]:
        """Time to committed-local, then a cold read of this rank's files, then our restore."""
        step = self.fresh("step")
        commit = self.timed(
            lambda: dcp.save(
                self.state, checkpoint_id=step, storage_writer=self.writer, process_group=self.pg
            )
        )
        step_dir = self.work / "ours" / step
        mine = sorted(step_dir.glob(f"__{self.rank}_*.distcp"))
        drop_cache(step_dir)
        cold = self.timed(lambda: read_files(mine))
        drop_cache(step_dir)
        target = self.blank_target()
        restore = self.timed(
            lambda: dcp.load(
                target,
                checkpoint_id=step,
                storage_reader=TieredStorageReader(self.work / "ours"),
                process_group=self.pg,
            )
        )
        self.check_target()
        self.remove(step_dir)
        return commit, cold, restore

    def dcp_save(self) -> float:
        path = self.work / self.fresh("dcp-sync")
        took = self.timed(
            lambda: dcp.save(
                self.state,
                storage_writer=FileSystemWriter(path, sync_files=True),
                process_group=self.pg,
            )
        )
        drop_cache(path)
        target = self.blank_target()
        self.record(
            "dcp_load_cold",
            self.timed(
                lambda: dcp.load(
                    target, storage_reader=FileSystemReader(path), process_group=self.pg
                )
            ),
        )
        self.check_target()
        self.remove(path)
        return took

    # -- figure 10: host memory --------------------------------------------------------------
    def peak_memory(self) -> float:
        """Extra resident memory over the writer's first two async saves (both buffer sets)."""
        with PeakRss() as rss:
            before = rss.peak
            for _ in range(2):
                self.ours_stall()
        extra = torch.tensor([float(rss.peak - before)], dtype=torch.float64)
        dist.all_reduce(extra)  # every rank's extra memory against the whole state
        return float(extra.item())

    # -- figures 5, 6 and 8: S3 --------------------------------------------------------------
    def s3_round(self, endpoint: str, bucket: str, run: int) -> None:
        opts = s3fs_options(endpoint, read_timeout=300)
        prefix = f"{bucket}/w{self.world}-{int(self.bytes * self.world / 2**20)}m-r{run}"
        cfg = RemoteConfig(
            url=f"s3://{prefix}/ours",
            storage_options=opts,
            part_size_bytes=self.part_mib * 2**20,
            max_concurrency=self.concurrency,
            verify_uploads=self.verify_uploads,
        )
        local = self.work / f"s3local-{run}"
        writer = TieredStorageWriter(local, remote=cfg)

        def ours() -> None:
            dcp.save(
                self.state, checkpoint_id="step-1", storage_writer=writer, process_group=self.pg
            )
            writer.wait_durable("step-1")

        self.record("s3_ours_durable", self.timed(ours))

        def bulk_put() -> None:
            if self.rank == 0:
                fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
                fs.put(str(local / "step-1"), f"{prefix}/bulk", recursive=True)

        self.record("s3_bulk_put", self.timed(bulk_put))
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        url = f"s3://{prefix}/fsspec"
        self.record(
            "s3_fsspec_save",
            self.timed(
                lambda: dcp.save(
                    self.state,
                    storage_writer=FsspecWriter(url, sync_files=False, **opts),
                    process_group=self.pg,
                )
            ),
        )
        target = self.blank_target()
        self.record(
            "s3_ours_restore",
            self.timed(
                lambda: dcp.load(
                    target,
                    checkpoint_id="step-1",
                    process_group=self.pg,
                    storage_reader=TieredStorageReader(self.work / f"empty-{run}", remote=cfg),
                )
            ),
        )
        self.check_target()
        target = self.blank_target()
        self.record(
            "s3_fsspec_restore",
            self.timed(
                lambda: dcp.load(
                    target, storage_reader=FsspecReader(url, **opts), process_group=self.pg
                )
            ),
        )
        self.check_target()
        writer.close()
        self.remove(local)
        if self.rank == 0:  # the server keeps objects in RAM: free them for the next sizes
            s3fs.S3FileSystem(skip_instance_cache=True, **opts).rm(prefix, recursive=True)
        dist.barrier()

    # -- figures 11 and 12: planning a repeat save, with DCP's plan caching and without -----
    def planning(self, ours: bool, caching: bool) -> float:
        """From dcp.save to this rank's final plan (the slowest rank's), many small tensors."""
        if ours:
            writer, path = _probe(TieredStorageWriter)(self.work / "plan"), None
            planner_cls = _OursPlanner if caching else DefaultSavePlanner
        else:
            path = self.work / self.fresh("plan-dcp")
            writer, planner_cls = _probe(FileSystemWriter)(path), _DcpPlanner
        step = self.fresh("plan")
        dist.barrier()
        t = time.perf_counter()
        dcp.save(
            self.plan_state,
            checkpoint_id=step if ours else str(path),
            storage_writer=writer,
            planner=planner_cls(enable_plan_caching=caching),
            process_group=self.pg,
        )
        took = self.slowest(writer.planned_at - t)
        self.remove(self.work / "plan" / step if ours else path)
        return took

    def plan_round(self) -> None:
        if not self.plan_warm:  # the first save with caching fills DCP's cache
            self.planning(True, True)
            self.planning(False, True)
            self.plan_warm = True
        self.record("ours_plan_first", self.planning(True, False))
        self.record("ours_plan_cached", self.planning(True, True))
        self.record("dcp_plan_first", self.planning(False, False))
        self.record("dcp_plan_cached", self.planning(False, True))

    # -- the run -----------------------------------------------------------------------------
    def run(self, runs: int, s3: tuple[str, str] | None) -> None:
        self.record("peak_extra_bytes", self.peak_memory())  # also warms both buffer sets
        for run in range(runs):
            self.record("copy", self.copy_baseline())
            self.record("ours_stall", self.ours_stall())
            self.record("dcp_stall", self.dcp_stall())
            self.record("dd", self.dd())
            commit, cold, restore = self.ours_commit_and_restore()
            self.record("ours_commit", commit)
            self.record("cold_read", cold)
            self.record("ours_restore", restore)
            self.record("dcp_save", self.dcp_save())
            self.plan_round()
            if s3:
                self.s3_round(*s3, run)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, required=True, help="state size, all ranks together")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", required=True, help="a directory on the disk under test")
    p.add_argument("--s3-endpoint", default=None)
    p.add_argument("--s3-bucket", default=None, help="an existing bucket on --s3-endpoint")
    p.add_argument("--part-mib", type=int, default=16, help="multipart part size")
    p.add_argument("--concurrency", type=int, default=8, help="parts in flight per file")
    p.add_argument(
        "--no-verify-uploads",
        action="store_true",
        help="RemoteConfig(verify_uploads=False): no read-back of uploaded objects",
    )
    p.add_argument("--plan-tensors", type=int, default=PLAN_TENSORS, help="figures 11 and 12")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    bench = Bench(a)
    try:
        bench.run(a.runs, (a.s3_endpoint, a.s3_bucket) if a.s3_endpoint else None)
    finally:
        bench.writer.close()
    if bench.rank == 0:
        Path(a.out).write_text(
            json.dumps(
                {
                    "world": bench.world,
                    "bytes": bench.bytes * bench.world,
                    "samples": bench.samples,
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
