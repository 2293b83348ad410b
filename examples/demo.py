"""The README demo: train, crash, resume from the newest tier, compare with an uninterrupted run.

Memory snapshot every step, local disk every 3 steps, remote every 6. Every rank is SIGKILLed at
step 8: the disk's newest step is step-6, but host memory holds step-7, and the restart resumes
from there (then persists it to disk and remote).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = Path.cwd() / "runs" / "demo"
# The remote tier: any fsspec URL works (s3://bucket/run with s3fs); a local directory stands
# in for object storage here so the demo needs no server.
REMOTE = f"file://{RUNS / 'remote'}"
MEMORY = Path("/dev/shm") / f"dcp-tiered-demo-{os.getuid()}"


def torchrun(*args: str, quiet_stderr: bool = False) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=0",
        str(HERE / "fsdp2_train.py"),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    stderr = subprocess.DEVNULL if quiet_stderr else None  # torchrun's report of the kill
    return subprocess.run(cmd, env=env, stderr=stderr).returncode


def main() -> int:
    shutil.rmtree(RUNS, ignore_errors=True)
    RUNS.mkdir(parents=True)
    try:
        return run()
    finally:
        for tier in (MEMORY, Path(f"{MEMORY}-reference")):
            shutil.rmtree(tier, ignore_errors=True)  # host memory is not for keeping


def run() -> int:
    for tier in (MEMORY, Path(f"{MEMORY}-reference")):
        shutil.rmtree(tier, ignore_errors=True)
    print(
        f"== 1. uninterrupted run (reference); tiers: memory {MEMORY}, local {RUNS}, "
        f"remote {REMOTE}"
    )
    if torchrun(
        "--root",
        str(RUNS / "reference"),
        "--memory",
        f"{MEMORY}-reference",
        "--losses",
        str(RUNS / "reference.json"),
        "--remote",
        REMOTE + "-reference",
    ):
        return 1
    print("\n== 2. run that crashes at step 8")
    rc = torchrun(
        "--root",
        str(RUNS / "ckpt"),
        "--memory",
        str(MEMORY),
        "--kill-at",
        "8",
        "--losses",
        str(RUNS / "x.json"),
        "--remote",
        REMOTE,
        quiet_stderr=True,
    )
    print(f"   torchrun exited with {rc}: every rank was SIGKILLed. What the tiers hold now:")
    subprocess.run([sys.executable, "-m", "dcp_tiered.cli", "status", str(RUNS / "ckpt")])
    print("\n== 3. restart: resumes from the newest step of any tier")
    if torchrun(
        "--root",
        str(RUNS / "ckpt"),
        "--memory",
        str(MEMORY),
        "--losses",
        str(RUNS / "resumed.json"),
        "--remote",
        REMOTE,
    ):
        return 1
    print("\n   and now:")
    subprocess.run([sys.executable, "-m", "dcp_tiered.cli", "status", str(RUNS / "ckpt")])
    ref = json.loads((RUNS / "reference.json").read_text())
    resumed = json.loads((RUNS / "resumed.json").read_text())
    print("\n step  uninterrupted       resumed")
    same = True
    for step in sorted(resumed, key=int):
        equal = resumed[step] == ref[step]
        same &= equal
        print(f" {int(step):4d}  {ref[step]:.10f}  {resumed[step]:.10f}  {'==' if equal else '!='}")
    print("\nresumed losses equal the uninterrupted run: " + ("YES" if same else "NO"))
    return 0 if same and resumed else 1


if __name__ == "__main__":
    sys.exit(main())
