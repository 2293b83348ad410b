"""Training step time with peer replication against the same loop without it, in one run.

Every rank is a node of its own (``Replication(node_key=...)``), on this machine, under
torchrun. Both loops snapshot to the memory tier every step (the disk every 1000, so never
here); one also copies every snapshot to the next node in a ring. Runs alternate A B B A so
that drift on a shared machine hits both alike; the figure is the ratio of median step times
(1.0: replication costs the loop nothing beyond the memory snapshot's own stall).

The copy is sent from a background thread over loopback gloo, so on a machine with as many
busy training processes as cores it competes with training for CPU: the ratio is an upper
bound of what a node with spare cores and a real network sees.

    .venv/bin/python benchmarks/bench_replication.py [--ranks 2] [--steps 30] [--runs 4]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_manager import Train, calibrate
from dcp_tiered import CheckpointManager, Every, Replication, SavePolicy
from dcp_tiered.staging import state_bytes

warnings.filterwarnings("ignore")
logging.getLogger("dcp_tiered").setLevel(logging.WARNING)
RESULTS = Path(__file__).resolve().parent / "results"


def loop(train: Train, steps: int, mgr: CheckpointManager) -> tuple[list[float], list[float]]:
    """Per-step wall times (training + save) and save stalls; close() waits for the rest."""
    times, stalls = [], []
    for step in range(steps):
        start = time.perf_counter()
        train.step()
        mgr.save(step, train.state())
        times.append(time.perf_counter() - start)
        stalls.append(mgr.last_stall_secs)
    mgr.close()
    return times, stalls


def worker(a: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.environ["BENCH_NODE"] = f"node-{rank}"
    torch.set_num_threads(a.threads)
    box = [calibrate(a.width, a.layers, a.step_secs) if rank == 0 else 0]
    dist.broadcast_object_list(box, src=0)
    train = Train(a.width, a.layers, box[0])
    times: dict[str, list[float]] = {"plain": [], "replicated": []}
    stalls: dict[str, list[float]] = {"plain": [], "replicated": []}
    for i in range(a.runs):
        for kind in ("plain", "replicated") if i % 2 == 0 else ("replicated", "plain"):
            work = Path(tempfile.mkdtemp(prefix="dcp-tiered-bench-repl-"))
            shm = Path(a.memory) / f"dcp-tiered-bench-repl-{os.getppid()}-{rank}"
            try:
                mgr = CheckpointManager(
                    memory=shm,
                    local=work,
                    events=None,
                    policy=SavePolicy(memory=Every(steps=1), local=Every(steps=1000), remote=None),
                    replication=Replication(node_key="BENCH_NODE", min_interval_secs=a.min_interval)
                    if kind == "replicated"
                    else None,
                )
                t, s = loop(train, a.steps, mgr)
                times[kind] += t[1:]  # the first step allocates the slots
                stalls[kind] += s[1:]
            finally:
                shutil.rmtree(work, ignore_errors=True)
                shutil.rmtree(shm, ignore_errors=True)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (times, stalls))
    if rank == 0:
        report(a, train, gathered)
    dist.destroy_process_group()


def report(a: argparse.Namespace, train: Train, gathered: list) -> None:
    def median(kind: str, which: int) -> float:
        return statistics.median(v for g in gathered for v in g[which][kind])

    ratio = median("replicated", 0) / median("plain", 0)
    result = {
        "ranks": a.ranks,
        "state_mib_per_rank": round(state_bytes(train.state()) / 2**20, 1),
        "steps": a.steps,
        "runs": a.runs,
        "min_interval_secs": a.min_interval,
        "cpus": os.cpu_count(),
        "step_ms_median_plain": round(median("plain", 0) * 1e3, 2),
        "step_ms_median_replicated": round(median("replicated", 0) * 1e3, 2),
        "step_time_ratio": round(ratio, 4),
        "stall_ms_median_plain": round(median("plain", 1) * 1e3, 2),
        "stall_ms_median_replicated": round(median("replicated", 1) * 1e3, 2),
    }
    print("| figure | plain | replicated |\n|---|---|---|")
    print(
        f"| step time, median | {result['step_ms_median_plain']} ms | "
        f"{result['step_ms_median_replicated']} ms |"
    )
    print(
        f"| save() stall, median | {result['stall_ms_median_plain']} ms | "
        f"{result['stall_ms_median_replicated']} ms |"
    )
    print(f"step time ratio (replicated / plain): **{ratio:.3f}**")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="simulated nodes, one rank each")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--step-secs", type=float, default=0.3)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--min-interval", type=float, default=0.0, help="Replication(min_interval_secs)")
    p.add_argument("--memory", default="/dev/shm", help="parent of the memory-tier directories")
    p.add_argument("--out", default=str(RESULTS / "replication.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={a.ranks}",
        __file__,
        "--worker",
        *sys.argv[1:],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
