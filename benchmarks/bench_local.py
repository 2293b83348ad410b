"""Local-tier benchmark: caller stall of async_save and local commit throughput.

Every figure is a ratio against a baseline measured in the same run on the same data, so the
noisy shared machine cancels out. Usage: ``.venv/bin/python benchmarks/bench_local.py [--gib 1]``.
Targets (issue 2): stall <= 1.2 x copy_ into preallocated buffers and <= 0.5 x DCP's own
async_save stall with FileSystemWriter; commit throughput >= 0.8 x dd conv=fdatasync.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_tiered import TieredStorageWriter

warnings.filterwarnings("ignore")
TENSOR_MIB = 32


def make_state(gib: float) -> dict:
    n = int(gib * 1024 / TENSOR_MIB)
    return {f"t{i:03d}": torch.randn(TENSOR_MIB * 2**18) for i in range(n)}


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def median_range(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", default=None, help="directory on the disk to test (default: tmp)")
    p.add_argument("--out", default="benchmarks/results/local.json")
    a = p.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(dir=a.dir, prefix="dcp-tiered-bench-"))
    state = make_state(a.gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    bufs = {k: torch.empty_like(v) for k, v in state.items()}
    res: dict[str, dict] = {}

    def copy_baseline():
        for k, v in state.items():
            bufs[k].copy_(v)

    writer = TieredStorageWriter(work / "ours")
    seq = iter(range(10**6))

    def ours_async() -> float:
        step = f"step-{next(seq)}"
        t = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=step, storage_writer=writer, no_dist=True)
        stall = time.perf_counter() - t
        fut.result()
        shutil.rmtree(work / "ours" / step)
        return stall

    def dcp_async() -> float:
        path = work / f"dcp-{next(seq)}"
        t = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=FileSystemWriter(path), no_dist=True)
        stall = time.perf_counter() - t
        fut.result()
        shutil.rmtree(path)
        return stall

    def dd() -> float:
        target = work / "dd.bin"
        t = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M",
                        f"count={nbytes // 2**24}", "conv=fdatasync"],
                       check=True, capture_output=True)
        took = time.perf_counter() - t
        target.unlink()
        return took

    def ours_commit() -> float:
        step = f"step-{next(seq)}"
        took = timed(lambda: dcp.save(state, checkpoint_id=step, storage_writer=writer,
                                      no_dist=True))
        shutil.rmtree(work / "ours" / step)
        return took

    ours_async(), ours_async(), copy_baseline()  # warm both staging buffer sets
    samples: dict[str, list[float]] = {k: [] for k in ("copy", "ours_stall", "dcp_stall", "dd",
                                                        "ours_commit")}
    for _ in range(a.runs):  # interleaved, so drift in machine load hits every figure alike
        samples["copy"].append(timed(copy_baseline))
        samples["ours_stall"].append(ours_async())
        samples["dcp_stall"].append(dcp_async())
        samples["dd"].append(dd())
        samples["ours_commit"].append(ours_commit())
    res = {k: median_range(v) for k, v in samples.items()}
    med = {k: v["median"] for k, v in res.items()}
    ratios = {
        "stall_vs_copy": (med["ours_stall"] / med["copy"], 1.2, "<="),
        "stall_vs_dcp_async": (med["ours_stall"] / med["dcp_stall"], 0.5, "<="),
        "commit_throughput_vs_dd": (med["dd"] / med["ours_commit"], 0.8, ">="),
    }
    print(f"state {nbytes / 2**30:.2f} GiB, {len(state)} tensors, {a.runs} runs, dir {work}")
    for k, v in res.items():
        print(f"  {k:<12} median {v['median']:.3f}s  min {v['min']:.3f}  max {v['max']:.3f}")
    for name, (value, target, op) in ratios.items():
        ok = value <= target if op == "<=" else value >= target
        print(f"  {name:<26} {value:6.3f}  (target {op} {target})  {'met' if ok else 'NOT met'}")
    machine = {"cores": os.cpu_count(), "torch": torch.__version__,
               "python": platform.python_version(),
               "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
               "load_avg": os.getloadavg()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"machine": machine, "bytes": nbytes, "figures": res,
                                       "ratios": {k: v[0] for k, v in ratios.items()}}, indent=1))
    writer.close()
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
