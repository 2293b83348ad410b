"""Peer replication through the Megatron facade: 2 simulated nodes x 1 rank, real megatron-core.

Each node is a torchrun of its own (``--nnodes 2 --node-rank K``) with its own save directory
and memory root, and a file:// remote tier (tests/workers/mcore_replicated.py). The model is tensor-parallel across the
two ranks, so each rank's shards exist nowhere else but in its own memory and its partner's
copy. The job saves through iteration 7 (storage every 4: iterations 5-7 are in host memory
only), waits until 7 is copied to the partner, trains on without saving (the uninterrupted
continuation, logged) and is SIGKILLed. Node 0 is then lost with its memory and save
directory; a fresh node 0 and node 1 resume. Or node 0's memory is lost with node 1's copy
of it: the restore falls back to storage and says which iterations were lost.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO, WORKERS, skip_without_megatron
from tests.s3server import free_port

skip_without_megatron()
pytestmark = [pytest.mark.multirank, pytest.mark.framework]
NODES, ITERS, PAUSE = 2, 10, 7


def _launch(out: Path, memory: str, *extra: str) -> list[subprocess.Popen]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={NODES}",
                f"--node-rank={node}",
                "--nproc-per-node=1",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "--max-restarts=0",
                str(WORKERS / "mcore_replicated.py"),
                "--out",
                str(out),
                "--memory",
                memory,
                "--remote",
                f"file://{out / 'remote'}",
                "--iters",
                str(ITERS),
                *extra,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for node in range(NODES)
    ]


def _stop(procs: list[subprocess.Popen]) -> str:
    """Kill what still runs; the tail of each node's output. Again on the same processes (a
    failure's message, then the fixture's clean-up), the same text: their pipes were read."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        if not hasattr(p, "output_read"):
            p.output_read = p.communicate()[0]
    return "\n".join(f"--- node {n}\n{p.output_read[-4000:]}" for n, p in enumerate(procs))


def _runs(out: Path, rank: int) -> list[list[dict]]:
    """Rank ``rank``'s records, one list per process (each begins with its pid line)."""
    runs: list[list[dict]] = []
    for line in (out / f"log-{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "pid" in record:
            runs.append([])
        runs[-1].append(record)
    return runs


def _memory_prefix(tag: str) -> str:
    return f"/dev/shm/dcp-tiered-mrep-{tag}-{uuid.uuid4().hex[:8]}"


def _remove_memory(prefix: str) -> None:
    for node in range(NODES):
        shutil.rmtree(f"{prefix}-node-{node}", ignore_errors=True)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The job, SIGKILLed on every rank after iteration 7 was snapshotted and replicated:
    (its directory, its memory prefix, each rank's records)."""
    out = tmp_path_factory.mktemp("mrep") / "killed"
    out.mkdir()
    memory = _memory_prefix("killed")
    procs = _launch(out, memory, "--pause-at", str(PAUSE))
    try:
        deadline = time.monotonic() + 120
        while not all((out / f"ready-{r}").exists() for r in range(NODES)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise AssertionError(f"the job never paused at {PAUSE}:\n{_stop(procs)}")
            time.sleep(0.05)
        for rank in range(NODES):  # every rank SIGKILLed, then the launchers
            os.kill(_runs(out, rank)[0][0]["pid"], signal.SIGKILL)
    finally:
        _stop(procs)
    yield out, memory, {r: _runs(out, r)[0] for r in range(NODES)}
    _remove_memory(memory)


@pytest.fixture
def resumed(killed, tmp_path):
    """``resume(lose)``: a copy of what the killed job left, ``lose(out, memory)`` applied to it,
    resumed on fresh processes; returns the copy's directory."""
    prefixes = []

    def resume(lose) -> Path:
        out, memory = tmp_path / "run", _memory_prefix("resumed")
        prefixes.append(memory)
        shutil.copytree(killed[0], out)
        for node in range(NODES):
            shutil.copytree(f"{killed[1]}-node-{node}", f"{memory}-node-{node}")
        lose(out, memory)
        procs = _launch(out, memory, "--attempt", "1")  # other initial weights: load must win
        try:
            for p in procs:
                p.wait(timeout=120)
        finally:
            text = _stop(procs)
        assert all(p.returncode == 0 for p in procs), text
        return out

    yield resume
    for memory in prefixes:
        _remove_memory(memory)


def _assert_resumed_exactly(killed: dict[int, list[dict]], out: Path, step: int) -> None:
    """Every rank restored, bit for bit, the shards the killed job had at ``step``, and went on
    with the same losses and shards as the killed job's uninterrupted continuation."""
    digests = set()
    for rank in range(NODES):
        logged = {e["iteration"]: e for e in killed[rank] if "iteration" in e}
        resumed = _runs(out, rank)[1]
        assert resumed[0]["start"] == step, resumed[0]
        assert resumed[0]["digest"] == logged[step]["digest"], f"rank {rank}: state differs"
        after = [(e["iteration"], e["loss"], e["digest"]) for e in resumed[1:]]
        assert after == [
            (i, logged[i]["loss"], logged[i]["digest"]) for i in range(step + 1, ITERS + 1)
        ], f"rank {rank}"
        digests.add(resumed[0]["digest"])
    assert len(digests) == NODES  # tensor-parallel: each rank restored shards of its own


def _events(log: str, kind: str) -> list[dict]:
    return [
        json.loads(line.split(" dcp_tiered.events ")[1])
        for line in log.splitlines()
        if f'"event": "{kind}"' in line
    ]


def test_facade_lost_node_resumes_from_its_partners_copy_bit_exact(killed, resumed):
    assert not (killed[0] / "node-0" / "ckpt" / f"iter_{PAUSE:07d}").exists()  # memory only

    def lose_node_0(out: Path, memory: str) -> None:  # its host memory and its disk with it
        shutil.rmtree(f"{memory}-node-0")
        shutil.rmtree(out / "node-0")

    out = resumed(lose_node_0)
    _assert_resumed_exactly(killed[2], out, PAUSE)
    log = (out / "node-0" / "ckpt.log").read_text()
    assert "restored iteration 7 from memory" in log
    fetched = _events(log, "restored_from_partner")
    assert [(e["rank"], e["holder"], e["step"]) for e in fetched] == [(0, 1, "iter_0000007")]
    # The replacement wrote the iteration it had only in memory to storage straight away.
    assert (out / "node-0" / "ckpt" / "iter_0000007").is_dir()


def test_facade_falls_back_to_storage_when_the_partners_copy_is_lost_too(killed, resumed):
    def lose_both_copies(out: Path, memory: str) -> None:
        shutil.rmtree(f"{memory}-node-0")  # node 0's memory (a reboot: its disk is kept)
        shutil.rmtree(f"{memory}-node-1/replica-0")  # and node 1's copies of it

    out = resumed(lose_both_copies)
    _assert_resumed_exactly(killed[2], out, 4)  # the newest storage checkpoint
    log = (out / "node-0" / "ckpt.log").read_text()
    assert "step(s) 6, 7 were lost: rank(s) 0 (node(s) 0)" in log
    assert "restoring iter_0000004 from storage instead" in log
    lost = _events(log, "lost")
    assert [(e["steps"], e["ranks"]) for e in lost] == [(["iter_0000006", "iter_0000007"], [0])]
    assert "restored iteration 4 from storage" in log


def test_facade_replication_needs_the_memory_tier(tmp_path):
    from dcp_tiered import Replication
    from dcp_tiered.errors import ConfigError
    from dcp_tiered.shims.megatron import EasyCkpt

    with pytest.raises(ConfigError, match="needs save_mem_interval"):
        EasyCkpt(0, 4, 2, save=tmp_path / "ckpt", replication=Replication())


def test_stopping_the_job_twice_keeps_its_output():
    """The fixture stops the job in its failure message and again in its clean-up: the second
    stop must not raise (ValueError: I/O operation on closed file), which hid the first."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", f"print('node {n} ran')"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for n in range(NODES)
    ]
    for p in procs:
        p.wait(timeout=60)
    first = _stop(procs)
    assert "node 0 ran" in first and "node 1 ran" in first
    assert _stop(procs) == first
