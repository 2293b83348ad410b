"""CheckpointManager with real processes: SIGKILL at random moments and resume bit-exact,
memory-tier recovery, and failures that reach every rank.

The job (tests/workers/managed_train.py) is FSDP2 on 2 gloo ranks with dropout, per-rank
random inputs, a per-rank data cursor and an LR scheduler: its final weights and optimizer
state match an uninterrupted run only if all of that state comes back on every rank.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from dcp_tiered.tiers import memory_slots
from tests._model import mismatches
from tests.conftest import REPO, WORKERS, read_json, torchrun

pytestmark = pytest.mark.multirank
STEPS = 30


def _args(tmp: Path, shm: Path, out: str, *extra: str) -> list[str]:
    return [
        "--memory",
        str(shm),
        "--disk",
        str(tmp / "disk"),
        "--remote",
        f"file://{tmp / 'remote'}",
        "--steps",
        str(STEPS),
        "--out",
        str(tmp / out),
        "--progress",
        str(tmp / "progress"),
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """Final state of the uninterrupted job (same cadence, fresh tiers)."""
    tmp = tmp_path_factory.mktemp("reference")
    shm = Path("/dev/shm") / f"dcp-tiered-ref-{uuid.uuid4().hex[:8]}"
    try:
        torchrun("managed_train.py", 2, *_args(tmp, shm, "ref.pt"))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return torch.load(tmp / "ref.pt", weights_only=True)


def _kill_job_at(tmp: Path, shm: Path, step: int, delay: float, *extra: str) -> None:
    """Start the job, wait until rank 0 reaches ``step``, wait ``delay`` s, SIGKILL every rank."""
    progress = tmp / "progress"
    progress.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=0",
        str(WORKERS / "managed_train.py"),
        *_args(tmp, shm, "killed.pt", *extra),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp / "killed-job.log"  # the job's own output, for the message if it ends early
    with log.open("wb") as out:
        job = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if progress.exists() and read_json(progress) >= step:
                break
            if job.poll() is not None:
                raise AssertionError(
                    f"the job ended before it could be killed:\n{log.read_text()[-6000:]}"
                )
            time.sleep(0.005)
        else:
            raise AssertionError(f"the job never reached step {step}")
        time.sleep(delay)
        for rank in range(2):  # the workers run in sessions of their own
            os.kill(read_json(f"{progress}.pid{rank}"), signal.SIGKILL)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)


def _restores(tmp: Path) -> list[dict]:
    events = (tmp / "disk" / ".dcp-tiered-events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, events) if e["event"] == "restored" and e["rank"] == 0]


SOAK = [pytest.param(seed, marks=pytest.mark.slow) for seed in range(100, 130)]


# Seed 11 (kills at three random steps, at random moments within them) in the default suite;
# `scripts/test -m slow -k killed`: seed 12 and 30 more.
@pytest.mark.parametrize("seed", [11, pytest.param(12, marks=pytest.mark.slow), *SOAK])
def test_killed_repeatedly_at_random_moments_then_resumed_bit_exact(tmp_path, shm, reference, seed):
    rng = random.Random(seed)
    at = sorted(rng.sample(range(3, STEPS - 3), 3))
    for step in at:
        _kill_job_at(tmp_path, shm, step, rng.uniform(0, 0.15))
    torchrun("managed_train.py", 2, *_args(tmp_path, shm, "final.pt"), timeout=180)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert mismatches(reference, final) == [], f"kills at steps {at} changed the result"
    restores = _restores(tmp_path)
    assert len(restores) >= len(at), restores  # every restart resumed (none started over)
    # the last run resumed both ranks from the same step: the one rank 0 reported restoring
    assert read_json(tmp_path / "final.pt.rank1.json")["restored"] == restores[-1]["step"]


def test_memory_tier_recovery_after_sigkill_of_every_rank(tmp_path, shm, reference):
    # Disk and remote saves only at step 0: everything newer lives in host memory alone.
    rare = ("--disk-every", "steps:1000", "--remote-every", "steps:1000")
    _kill_job_at(tmp_path, shm, 15, 0.05, *rare)
    in_memory = memory_slots.list_steps(shm)
    # The kill may land between two ranks' commits of the newest snapshot: the newest step
    # that every rank holds is the one a restore can take.
    whole = [int(n.split("-")[1]) for n, ranks in in_memory.items() if ranks == [0, 1]]
    assert whole and max(whole) >= 14, in_memory
    assert sorted(n for n in os.listdir(tmp_path / "disk") if n.startswith("step-")) == ["step-0"]

    torchrun("managed_train.py", 2, *_args(tmp_path, shm, "final.pt", *rare), timeout=180)
    restored = _restores(tmp_path)[-1]
    assert restored["tier"] == "memory" and restored["step"] >= 14, restored
    # ...then persisted down the tiers: on local disk and durable on the remote tier.
    persisted = f"step-{restored['step']}"
    assert (tmp_path / "disk" / persisted / "manifest.json").exists()
    assert (tmp_path / "remote" / persisted / "_COMMITTED.json").exists()
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert mismatches(reference, final) == []


def test_snapshots_copied_beside_training_resume_bit_exact_after_sigkill(tmp_path, shm, reference):
    """async_snapshots=True, wait_staged() before every optimizer step: every rank killed at a
    random moment of step 15 (its snapshot may be mid-copy beside the step's forward), then
    resumed from host memory, bit-exact with the job that never checkpointed this way."""
    rare = ("--disk-every", "steps:1000", "--remote-every", "steps:1000", "--async-snapshots")
    _kill_job_at(tmp_path, shm, 15, random.Random(7).uniform(0, 0.1), *rare)
    torchrun("managed_train.py", 2, *_args(tmp_path, shm, "final.pt", *rare), timeout=180)
    restored = _restores(tmp_path)[-1]
    assert restored["tier"] == "memory" and restored["step"] >= 13, restored
    result = read_json(tmp_path / "final.pt.rank0.json")
    assert "error" not in result, result  # no snapshot was refused as changed mid-copy
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert mismatches(reference, final) == []


def test_a_permanent_upload_failure_on_one_rank_reaches_every_rank(tmp_path, shm, s3, fault_proxy):
    # One local root per rank (two "nodes"): rank 1 uploads its own shards, and the proxy
    # denies every write of them (403 AccessDenied, not retried).
    proxy = fault_proxy(0.0, deny="__1_")
    started = time.monotonic()
    torchrun(
        "managed_train.py",
        2,
        "--memory",
        str(shm),
        "--disk",
        str(tmp_path / "disk"),
        "--disk-per-rank",
        "--remote",
        s3.url(),
        "--remote-every",
        "steps:5",
        "--steps",
        str(STEPS),
        "--out",
        str(tmp_path / "out.pt"),
        env={"TEST_S3_ENDPOINT": proxy},
        timeout=180,
    )
    assert time.monotonic() - started < 150  # nobody waited for a durable timeout
    for rank in (0, 1):
        result = read_json(tmp_path / f"out.pt.rank{rank}.json")
        assert "error" in result, f"rank {rank} did not learn of the failure: {result}"
        failure = next(f for f in result["failures"] if f["tier"] == "remote")
        assert failure["rank"] == 1 and failure["step"] == "step-0", failure
        assert "AccessDenied" in failure["error"] or "denied" in failure["error"].lower()
        assert "rank 1: step-0 on the remote tier" in result["error"]
