"""dcp_tiered against its peers on three state shapes, ratios within one run (issue 21).

    benchmarks/peers                  # sets up .venv-bench and LocalStack, then runs this
    benchmarks/peers --quick          # tiny states, one run, moto (the smoke test)

Peers: DLRover flash checkpoint 0.6.1 (``DdpCheckpointer``), torch-checkpointing 0.1.1,
s3torchconnector 1.5.0, vanilla DCP, ``torch.load``, memcpy into reused buffers and
``dd conv=fdatasync``. A peer that is not installed reads "not installed". State shapes:
32 x 32 MiB (1 GiB), and about 256 MiB of model + AdamW state in 2,000 and in 20,000 tensors
(benchmarks/states.py). Every figure is a median of --runs; every ratio is ours / peer from
the same run. Prints the tables (target, value, pass/fail) and writes JSON.
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

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
import states
from peers_lib import CADENCE_OF, available

NOT_INSTALLED = "not installed"
# (row, ours, peers (the fastest available counts), target: ours / peer <= this, or per state
# with DEFAULT for the others)
DEFAULT = "*"
LOCAL_ROWS: list[tuple[str, str, list[str], float | dict[str, float] | None]] = [
    (
        "cold restore vs the fastest peer",
        "ours_restore",
        ["dcp_restore", "tc_restore", "torchload_restore"],
        0.8,
    ),
    ("cold restore vs a cold read of the same files", "ours_restore", ["cold_read"], 2.0),
    ("time to committed vs DLRover (+ fsync)", "ours_commit", ["dlrover_commit"], 1.0),
    # issue 30: 1.2x dd for 2,000 and 32 MiB tensors, 2x for 20,000
    ("time to committed vs dd conv=fdatasync", "ours_commit", ["dd"], {"20k": 2.0, DEFAULT: 1.2}),
    ("stall vs memcpy into reused buffers", "ours_stall", ["memcpy"], 1.3),
    ("stall vs DLRover (save to memory)", "ours_stall", ["dlrover_stall"], 1.0),
    ("memory-tier snapshot (until valid) vs memcpy", "ours_snapshot", ["memcpy"], 1.3),
    ("time to committed vs DCP FileSystemWriter (fsync)", "ours_commit", ["dcp_commit"], None),
    ("time to committed vs torch-checkpointing (+ fsync)", "ours_commit", ["tc_commit"], None),
    ("stall vs torch-checkpointing async save", "ours_stall", ["tc_stall"], None),
]
S3_ROWS = [
    ("S3 time to durable vs s3torchconnector", "s3_ours_durable", "s3_s3t_durable", 0.9),
    ("S3 restore vs s3torchconnector", "s3_ours_restore", "s3_s3t_restore", 0.8),
]
PEER_OF = {
    "dcp_restore": "DCP",
    "tc_restore": "torch-checkpointing",
    "torchload_restore": "torch.load",
}
NEEDS = {  # figure -> the peer package it needs
    "dlrover_commit": "dlrover",
    "dlrover_stall": "dlrover",
    "tc_commit": "torch-checkpointing",
    "tc_stall": "torch-checkpointing",
    "s3_s3t_durable": "s3torchconnector",
    "s3_s3t_restore": "s3torchconnector",
}


def target_of(target: float | dict[str, float] | None, state: str) -> float | None:
    """A row's target for one state shape (by its name in states.NAMES)."""
    if isinstance(target, dict):
        return target.get(state, target[DEFAULT])
    return target


def target_text(target: float | dict[str, float] | None) -> str:
    if target is None:
        return "-"
    if not isinstance(target, dict):
        return f"<= {target}"
    others = [f"{states.NAMES[n]}: <= {t}" for n, t in target.items() if n != DEFAULT]
    return f"<= {target[DEFAULT]} ({'; '.join(others)})"


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in samples.items()}


def cell(
    med: dict, ours: str, peers: list[str], target: float | None, found: dict, errors: dict
) -> dict:
    have = [p for p in peers if p in med]
    if ours not in med or not have:
        missing = [NEEDS[p] for p in peers if p in NEEDS and not found.get(NEEDS[p])]
        failed = [NEEDS[p] for p in peers if p in NEEDS and NEEDS[p] in errors]
        return {"text": NOT_INSTALLED if missing else "failed" if failed else "-"}
    best = min(have, key=lambda p: med[p])
    ratio = med[ours] / med[best]
    out = {"ratio": ratio, "peer": best, "ours_s": med[ours], "peer_s": med[best]}
    text = f"{ratio:.2f}"
    if len(peers) > 1:
        text += f" ({PEER_OF.get(best, best)})"
    if target is not None:
        out["pass"] = ratio <= target
        text += " pass" if out["pass"] else " FAIL"
    out["text"] = text
    return out


def run(cmd: list[str], what: str) -> bool:
    t = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        print(f"  {what}: FAILED ({proc.returncode}), see above; going on", flush=True)
        return False
    print(f"  {what}: {time.perf_counter() - t:.0f} s", flush=True)
    return True


def start_s3(kind: str) -> tuple[object, str, object]:
    if kind == "moto":
        from tests.s3server import start_moto

        proc, endpoint = start_moto()
        return proc, endpoint, None
    from localstack import start_localstack

    proc, endpoint, scratch = start_localstack()
    return proc, endpoint, scratch


def table(title: str, heads: list[str], rows: list[tuple[str, str, list[str]]]) -> str:
    lines = [f"\n{title}\n", "| figure (ours / peer) | target | " + " | ".join(heads) + " |"]
    lines.append("|---|---|" + "---|" * len(heads))
    lines += [f"| {name} | {target} | " + " | ".join(cells) + " |" for name, target, cells in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny states, one run, moto")
    p.add_argument("--states", default="large,2k,20k")
    p.add_argument("--runs", type=int, default=None, help="runs per figure (default 3; quick 1)")
    p.add_argument(
        "--train-runs",
        type=int,
        default=None,
        help="rounds of the training loop, one window of each checkpointer and one without "
        "(default 30, about 11 min; quick 1)",
    )
    p.add_argument("--s3", choices=["localstack", "moto", "none"], default=None)
    p.add_argument(
        "--s3-configs",
        default=None,
        help="state[:GiB] list for the S3 figures (default large:0.25,large:1,2k,20k)",
    )
    p.add_argument("--no-training", action="store_true")
    p.add_argument("--dir", default=None, help="a directory on the disk under test")
    p.add_argument("--out", default=str(HERE / "results" / "peers.json"))
    a = p.parse_args()
    runs = a.runs or (1 if a.quick else 3)
    s3_kind = a.s3 or ("moto" if a.quick else "localstack")
    s3_configs = a.s3_configs or ("2k" if a.quick else "large:0.25,large:1,2k,20k")
    names = [s for s in a.states.split(",") if s]
    found = available()
    if a.dir:
        Path(a.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dcp-tiered-peers-", dir=a.dir))
    info = {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "load_avg_at_start": os.getloadavg(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "peers": found,
        "runs": runs,
        "s3_server": s3_kind,
        "command": " ".join(sys.argv),
    }
    print(f"peers: {found}", flush=True)
    quick = ["--quick"] if a.quick else []
    local, s3, training = {}, {}, None
    try:
        for name in names:
            out = work / f"local-{name}.json"
            ok = run(
                [
                    sys.executable,
                    str(HERE / "peers_local.py"),
                    "--state",
                    name,
                    "--runs",
                    str(runs),
                    "--dir",
                    str(work / name),
                    "--out",
                    str(out),
                    *quick,
                ],
                f"local figures, {states.NAMES[name]}",
            )
            if ok:
                local[name] = json.loads(out.read_text())
            shutil.rmtree(work / name, ignore_errors=True)
        if s3_kind != "none" and s3_configs:
            proc, endpoint, scratch = start_s3(s3_kind)
            try:
                import s3fs

                from tests.s3server import s3fs_options

                bucket = f"peers-{uuid.uuid4().hex[:8]}"
                s3fs.S3FileSystem(**s3fs_options(endpoint)).call_s3("create_bucket", Bucket=bucket)
                for config in s3_configs.split(","):
                    name, _, gib = config.partition(":")
                    out = work / f"s3-{config}.json"
                    ok = run(
                        [
                            sys.executable,
                            str(HERE / "peers_s3.py"),
                            "--state",
                            name,
                            *(["--gib", gib] if gib else []),
                            "--runs",
                            str(runs),
                            "--endpoint",
                            endpoint,
                            "--bucket",
                            bucket,
                            "--dir",
                            str(work / "s3"),
                            "--out",
                            str(out),
                            *quick,
                        ],
                        f"S3 figures ({s3_kind}), {config}",
                    )
                    if ok:
                        s3[config] = json.loads(out.read_text())
            finally:
                proc.terminate()
                proc.wait(timeout=30)
                if scratch:
                    shutil.rmtree(scratch, ignore_errors=True)
        if not a.no_training:
            out = work / "train.json"
            size = ["--step-secs", "0.01", "--width", "64", "--every", "2"]
            size += ["--no-warm-up"]
            ok = run(
                [
                    sys.executable,
                    str(HERE / "peers_train.py"),
                    "--runs",
                    str(a.train_runs or (1 if a.quick else 30)),
                    "--dir",
                    str(work / "train"),
                    "--out",
                    str(out),
                    *(size if a.quick else []),
                ],
                "training loops",
            )
            training = json.loads(out.read_text()) if ok else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info["load_avg_at_end"] = os.getloadavg()
    report = summarise(local, s3, training, found)
    print(render(report, local, s3))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"machine": info, **report}, indent=1))
    print(f"\nwrote {a.out}")


def summarise(local: dict, s3: dict, training: dict | None, found: dict) -> dict:
    rows = []
    for what, ours, peers, target in LOCAL_ROWS:
        cells = {
            n: cell(
                medians(r["samples"]), ours, peers, target_of(target, n), found, r.get("errors", {})
            )
            for n, r in local.items()
        }
        rows.append({"figure": what, "target": target, "cells": cells})
    for what, ours, peer, target in S3_ROWS:
        cells = {
            c: cell(medians(r["samples"]), ours, [peer], target, found, {}) for c, r in s3.items()
        }
        rows.append({"figure": what, "target": target, "cells": cells, "s3": True})
    train = None
    if training:
        vs = training["vs_none"]
        # each peer against ours at its cadence: memory every step + disk every 10 (DLRover),
        # or disk every 10 only (DCP, torch-checkpointing)
        verdicts = {
            peer: vs[CADENCE_OF[peer]] >= v
            for peer, v in vs.items()
            if peer in CADENCE_OF and CADENCE_OF[peer] in vs
        }
        train = {
            "vs_none": vs,
            "spread": training.get("spread", {}),
            "pooled": training.get("pooled", {}),
            "head_to_head": training.get("head_to_head", {}),
            "background_cpu_s": training.get("background_cpu_s", {}),
            "rounds": len(training["steps_per_s"].get("none", [])),
            "missing": [n for n in ("dlrover", "torch-checkpointing") if not found.get(n)],
            "verdicts": verdicts,
            "pass": bool(verdicts) and all(verdicts.values()),
            "state_mib": training["state_mib"],
            "step_secs": training.get("step_secs"),
            "steps_per_s": training["steps_per_s"],
        }
    return {
        "local": {n: {k: v for k, v in r.items()} for n, r in local.items()},
        "s3": s3,
        "rows": rows,
        "training": train,
    }


def render(report: dict, local: dict, s3: dict) -> str:
    def head(r: dict) -> str:
        return f"{r['tensors']} tensors, {r['bytes'] / 2**20:.0f} MiB"

    parts = []
    local_rows = [r for r in report["rows"] if not r.get("s3")]
    parts.append(
        table(
            "Local figures (medians; ours / peer, < 1: we are faster)",
            [head(r) for r in local.values()],
            [
                (
                    r["figure"],
                    target_text(r["target"]),
                    [r["cells"][n]["text"] for n in local],
                )
                for r in local_rows
            ],
        )
    )
    if s3:
        parts.append(
            table(
                "S3 figures",
                [f"{c}: {head(r)}" for c, r in s3.items()],
                [
                    (r["figure"], f"<= {r['target']}", [r["cells"][c]["text"] for c in s3])
                    for r in report["rows"]
                    if r.get("s3")
                ],
            )
        )
    for name, r in local.items():
        for peer, error in r.get("errors", {}).items():
            parts.append(f"\n{states.NAMES[name]}: {peer} failed: {error}")
    train = report["training"]
    if train:

        def fig(n: str, v: float) -> str:
            lo, hi = train["spread"].get(n, (v, v))
            pooled = train["pooled"].get(n, v)
            return f"{n} {v:.3f} ({lo:.3f}-{hi:.3f}; {pooled:.3f})"

        cells = [fig(n, v) for n, v in train["vs_none"].items()]
        cells += [f"{n} {NOT_INSTALLED}" for n in train["missing"]]

        def wins(p: str) -> str:
            won, rounds = train["head_to_head"].get(p, (None, None))
            return "" if won is None else f" (faster in {won} of {rounds} rounds)"

        verdicts = ", ".join(
            f"{CADENCE_OF[p]} vs {p}: {'pass' if ok else 'FAIL'}{wins(p)}"
            for p, ok in train.get("verdicts", {}).items()
        )
        parts.append(
            f"\nTraining loop ({train['state_mib']} MiB state, {train.get('step_secs')} s a step "
            "alone), throughput over a disk-save cycle vs the same round's cycle "
            f"without checkpoints, median (min-max) of {train['rounds']} rounds of interleaved "
            f"windows, then the ratio of totals (target: ours at each "
            f"peer's cadence at least the peer's): {', '.join(cells)} -> {verdicts}"
        )
        cpu = train.get("background_cpu_s", {})
        if cpu:
            parts.append(
                "Background work's CPU seconds per cycle (threads but the training thread, "
                "and child processes; median): "
                + ", ".join(f"{n} {secs:.3f}" for n, secs in cpu.items())
            )
    return "\n".join(parts)


if __name__ == "__main__":
    main()
