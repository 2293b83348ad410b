"""The benchmark suite: dcp_tiered against its peers and the machine's limits, in one run.

For every size and rank count it runs ``figures.py`` under torchrun (all figures and their
baselines interleaved in one job), then ``bench_manager.py`` for the training-throughput
figure. It prints a table of ratios against baselines measured in the same run, and writes
JSON with the machine, every sample, and each figure's median and min-max.

    benchmarks/run            # full: 0.25, 1 and 4 GiB at 1, 2 and 4 ranks
    benchmarks/run --quick    # 0.25 and 1 GiB
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tests.s3server import s3fs_options, start_moto

# number, what, ours, baseline, target, "<=" or ">=" on ours / baseline
TARGETS = [
    (1, "caller stall of async_save vs copy_ into preallocated buffers", "ours_stall", "copy", 1.2),
    (
        2,
        "caller stall of async_save vs DCP async_save + FileSystemWriter",
        "ours_stall",
        "dcp_stall",
        0.3,
    ),
    (3, "time to committed-local vs dd conv=fdatasync", "ours_commit", "dd", 1.15),
    (
        4,
        "time to committed-local vs DCP dcp.save + FileSystemWriter (fsync)",
        "ours_commit",
        "dcp_save",
        1.0,
    ),
    (5, "time to durable on S3 vs s3fs bulk put", "s3_ours_durable", "s3_bulk_put", 1.1),
    (6, "time to durable on S3 vs FsspecWriter dcp.save", "s3_ours_durable", "s3_fsspec_save", 0.5),
    (7, "restore from local vs cold read of the same files", "ours_restore", "cold_read", 1.15),
    (8, "restore from S3 vs FsspecReader dcp.load", "s3_ours_restore", "s3_fsspec_restore", 0.5),
    (
        11,
        "planning a repeat save with DCP's plan caching vs a first save's (ours)",
        "ours_plan_cached",
        "ours_plan_first",
        0.2,
    ),
    (
        12,
        "the same for DCP's FileSystemWriter (vanilla DCP's cached planner)",
        "dcp_plan_cached",
        "dcp_plan_first",
        0.2,
    ),
]


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def machine(directory: Path) -> dict:
    df = subprocess.run(
        ["df", "-hT", str(directory)], capture_output=True, text=True, check=False
    ).stdout
    return {
        "cores": os.cpu_count(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "disk": df.splitlines()[-1] if df else "?",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "load_avg_at_start": os.getloadavg(),
    }


def run_config(
    gib: float,
    ranks: int,
    runs: int,
    work: Path,
    s3: tuple[str, str] | None,
    s3_args: list[str],
    plan_tensors: int = 2000,
) -> dict:
    out = work / f"figures-{gib}-{ranks}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        "--standalone",
        str(HERE / "figures.py"),
        "--gib",
        str(gib),
        "--runs",
        str(runs),
        "--dir",
        str(work / f"w-{gib}-{ranks}"),
        "--out",
        str(out),
        "--plan-tensors",
        str(plan_tensors),
    ]
    if s3:
        cmd += ["--s3-endpoint", s3[0], "--s3-bucket", s3[1], *s3_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    print(f"  {gib} GiB x {ranks} rank(s) took {time.perf_counter() - t:.0f} s", flush=True)
    shutil.rmtree(work / f"w-{gib}-{ranks}", ignore_errors=True)
    return result


def ratios(samples: dict[str, list[float]], nbytes: int) -> dict[int, float]:
    med = {k: statistics.median(v) for k, v in samples.items()}
    found = {
        n: med[ours] / med[base] for n, _, ours, base, _ in TARGETS if ours in med and base in med
    }
    found[10] = med["peak_extra_bytes"] / nbytes
    return found


def training(runs: int, work: Path) -> dict:
    out = work / "manager.json"
    subprocess.run(
        [sys.executable, str(HERE / "bench_manager.py"), "--runs", str(runs), "--out", str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return json.loads(out.read_text())


def print_table(configs: list[dict], train: dict | None) -> None:
    heads = [f"{c['gib']} GiB x{c['world']}" for c in configs]
    print("\n| # | figure | target | " + " | ".join(heads) + " |")
    print("|---|---|---|" + "---|" * len(heads))
    rows = [(n, what, f"<= {t}") for n, what, _, _, t in TARGETS]
    rows.insert(
        8, (9, "training throughput (memory every step, local every 10) vs none", ">= 0.95")
    )
    rows.append((10, "peak extra host memory during a save / state size", "<= 2.2"))
    rows.sort(key=lambda row: row[0])
    for n, what, target in rows:
        if n == 9:
            cells = ["-"] * len(configs)
            if train:
                value = 1 - train["throughput_loss"]
                cells[0] = (
                    f"{value:.3f} {'met' if value >= 0.95 else 'NOT met'} "
                    f"({train['state_mib']:.0f} MiB)"
                )
        else:
            limit = float(target.split()[1])
            cells = [
                f"{c['ratios'][n]:.2f} {'met' if c['ratios'][n] <= limit else 'NOT met'}"
                if n in c["ratios"]
                else "-"
                for c in configs
            ]
        print(f"| {n} | {what} | {target} | " + " | ".join(cells) + " |")
    print("\nSeconds per GiB (median), to see how each grows with size and ranks:")
    keys = [
        "ours_stall",
        "ours_commit",
        "ours_restore",
        "dd",
        "cold_read",
        "dcp_save",
        "s3_ours_durable",
        "s3_ours_restore",
    ]
    print("| config | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for c, head in zip(configs, heads):
        gib = c["bytes"] / 2**30
        cells = [
            f"{c['figures'][k]['median'] / gib:.2f}" if k in c["figures"] else "-" for k in keys
        ]
        print(f"| {head} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="sizes 0.25 and 1 GiB only")
    p.add_argument("--sizes", help="GiB, comma-separated (default 0.25,1,4; quick 0.25,1)")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--s3-sizes",
        default="0.25",
        help="sizes that also run the S3 figures (moto moves ~25 MB/s here)",
    )
    p.add_argument("--s3-ranks", default="1,2")
    p.add_argument("--endpoint", help="an S3 endpoint (default: start moto on 127.0.0.1)")
    p.add_argument("--part-mib", type=int, default=16, help="our multipart part size")
    p.add_argument("--concurrency", type=int, default=8, help="our parts in flight per file")
    p.add_argument(
        "--no-verify-uploads",
        action="store_true",
        help="measure our S3 figures without the read-back of uploaded objects",
    )
    p.add_argument("--no-training", action="store_true", help="skip figure 9")
    p.add_argument(
        "--plan-tensors",
        type=int,
        default=2000,
        help="small tensors saved for figures 11 and 12 (planning time); fewer for a smoke run",
    )
    p.add_argument("--dir", default=None, help="directory on the disk under test (default: tmp)")
    p.add_argument("--out", default=str(HERE / "results" / "suite.json"))
    a = p.parse_args()
    sizes = [float(s) for s in (a.sizes or ("0.25,1" if a.quick else "0.25,1,4")).split(",")]
    ranks = [int(r) for r in a.ranks.split(",")]
    s3_sizes = {float(s) for s in a.s3_sizes.split(",") if s}
    s3_ranks = {int(r) for r in a.s3_ranks.split(",") if r}
    if a.dir:
        Path(a.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dcp-tiered-suite-", dir=a.dir))
    info = machine(work)
    print(f"machine: {info}", flush=True)
    moto = None
    s3 = None
    if s3_sizes:
        if a.endpoint:
            endpoint = a.endpoint
        else:
            moto, endpoint = start_moto()
        import s3fs

        bucket = f"suite-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(**s3fs_options(endpoint)).call_s3("create_bucket", Bucket=bucket)
        s3 = (endpoint, bucket)
    configs = []
    try:
        for gib in sizes:
            for r in ranks:
                use_s3 = s3 if gib in s3_sizes and r in s3_ranks else None
                res = run_config(
                    gib,
                    r,
                    a.runs,
                    work,
                    use_s3,
                    ["--part-mib", str(a.part_mib), "--concurrency", str(a.concurrency)]
                    + (["--no-verify-uploads"] if a.no_verify_uploads else []),
                    a.plan_tensors,
                )
                configs.append(
                    {
                        "gib": gib,
                        "world": r,
                        "bytes": res["bytes"],
                        "samples": res["samples"],
                        "figures": {k: summary(v) for k, v in res["samples"].items()},
                        "ratios": ratios(res["samples"], res["bytes"]),
                    }
                )
        train = None if a.no_training else training(max(a.runs, 4), work)
    finally:
        if moto is not None:
            moto.terminate()
        shutil.rmtree(work, ignore_errors=True)
    info["load_avg_at_end"] = os.getloadavg()
    print_table(configs, train)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(
        json.dumps(
            {
                "machine": info,
                "targets": {
                    n: {"figure": w, "ours": o, "baseline": b, "max": t}
                    for n, w, o, b, t in TARGETS
                },
                "configs": configs,
                "training": train,
            },
            indent=1,
        )
    )
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
