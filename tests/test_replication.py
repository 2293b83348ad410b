"""Peer replication with real processes: 3 simulated nodes x 2 gloo ranks on one machine.

Each node is a torchrun of its own (``--nnodes 3 --node-rank K``), with its own local root and
its own memory root in /dev/shm; the node id comes from torchrun's GROUP_RANK. One job runs
with replication in a ring (node 0 -> 1 -> 2 -> 0), saves through step 13 (memory every step,
disk every 5, remote every 10: steps 11-13 live in host memory only), waits until step 13 is
replicated, trains on to the end without saving (the uninterrupted continuation, logged), and
then every rank is SIGKILLed. Each test takes a copy of what the killed job left, breaks it
(a node gone, two partners gone, a corrupt copy) and resumes on fresh processes: every rank's
restored state must equal, bit for bit, the state the killed job logged at that step, and every
loss after it the killed job's.
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

from dcp_tiered.cli import main
from dcp_tiered.tiers import memory as memory_tier
from dcp_tiered.tiers import memory_slots
from tests.conftest import REPO, WORKERS, read_json, torchrun
from tests.s3server import free_port

pytestmark = pytest.mark.multirank
NODES, PER_NODE, STEPS, PAUSE = 3, 2, 17, 13


def _launch(run: dict, log: Path, *extra: str) -> list[subprocess.Popen]:
    """One torchrun per node, as on a cluster (static rendezvous on 127.0.0.1)."""
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
                f"--nproc-per-node={PER_NODE}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "--max-restarts=0",
                str(WORKERS / "replicated_train.py"),
                "--memory",
                str(run["shm"]),
                "--disk",
                str(run["disk"]),
                "--remote",
                f"file://{run['remote']}",
                "--steps",
                str(STEPS),
                "--records",
                str(log),
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


def _wait(procs: list[subprocess.Popen], timeout: float = 150) -> str:
    """Wait for every node; their output, or fail the test with it."""
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = "\n".join(f"--- node {n}\n{o[-6000:]}" for n, o in enumerate(outputs))
    assert all(p.returncode == 0 for p in procs), text
    return text


def _records(log: Path) -> dict[int, list[dict]]:
    return {
        r: [json.loads(line) for line in Path(f"{log}.rank{r}").read_text().splitlines()]
        for r in range(NODES * PER_NODE)
    }


def _paths(base: Path, tag: str) -> dict:
    return {
        "shm": Path("/dev/shm") / f"dcp-tiered-repl-{tag}-{uuid.uuid4().hex[:8]}",
        "disk": base / "disk",
        "remote": base / "remote",
    }


def _shm(run: dict, node: int) -> Path:
    return Path(f"{run['shm']}-node-{node}")


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The job, SIGKILLed on every rank after step 13 was snapshotted and replicated."""
    base = tmp_path_factory.mktemp("replicated")
    run = _paths(base, "killed")
    log = base / "killed.log"
    procs = _launch(run, log, "--pause-at", str(PAUSE))
    try:
        deadline = time.monotonic() + 150
        ready = [Path(f"{log}.ready{r}") for r in range(NODES * PER_NODE)]
        committed = run["remote"] / "step-10" / "_COMMITTED.json"
        while not (all(f.exists() for f in ready) and committed.exists()):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                out = "\n".join(p.communicate()[0][-4000:] for p in procs)
                raise AssertionError(f"the job never paused at step {PAUSE}:\n{out}")
            time.sleep(0.05)
        records = _records(log)
        for r in records:  # SIGKILL every rank, then the launchers
            os.kill(records[r][0]["pid"], signal.SIGKILL)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    yield run, _records(log)
    for node in range(NODES):
        shutil.rmtree(_shm(run, node), ignore_errors=True)


def _copy(killed_run: dict, base: Path, tag: str) -> dict:
    """A copy of what the killed job left, for one test to break."""
    run = _paths(base, tag)
    shutil.copytree(killed_run["disk"], run["disk"], symlinks=True)
    shutil.copytree(killed_run["remote"], run["remote"], symlinks=True)
    for node in range(NODES):
        shutil.copytree(_shm(killed_run, node), _shm(run, node))
    return run


@pytest.fixture
def broken(killed, tmp_path):
    runs = []

    def make(tag: str) -> dict:
        runs.append(_copy(killed[0], tmp_path, tag))
        return runs[-1]

    yield make
    for run in runs:
        for node in range(NODES):
            shutil.rmtree(_shm(run, node), ignore_errors=True)


def _lose_node(run: dict, node: int) -> None:
    """The node is gone: its host memory and its local disk with it."""
    shutil.rmtree(_shm(run, node))
    shutil.rmtree(run["disk"] / f"node-{node}")


def _assert_resumed_exactly(before: dict[int, list[dict]], after: dict[int, list[dict]]) -> int:
    """Every rank restored the state the killed job had at that step, and went on with the
    same losses and states; returns the step restored."""
    restored = {r: rec[1] for r, rec in after.items()}  # rec[0] is the pid line
    steps = {r["restored"] for r in restored.values()}
    assert len(steps) == 1, restored
    step = steps.pop()
    assert step is not None
    for r, records in before.items():
        logged = {e["step"]: e for e in records if "step" in e}
        assert restored[r]["digest"] == logged[step]["digest"], f"rank {r}: state differs"
        resumed = [e for e in after[r] if "step" in e]
        assert [e["step"] for e in resumed] == list(range(step + 1, STEPS))
        for e in resumed:
            assert (e["loss"], e["digest"]) == (
                logged[e["step"]]["loss"],
                logged[e["step"]]["digest"],
            ), f"rank {r} step {e['step']}"
    return step


def _events(run: dict, node: int, kind: str) -> list[dict]:
    path = run["disk"] / f"node-{node}" / ".dcp-tiered-events.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]


def test_the_killed_job_left_step_13_only_in_memory_and_on_partner_nodes(killed, capsys):
    run, _ = killed
    for node in range(NODES):
        own = memory_slots.list_steps(_shm(run, node))
        assert "step-13" in own and sorted(own["step-13"]) == [2 * node, 2 * node + 1], own
        source = (node - 1) % NODES  # ring: node k keeps node k-1's copies
        for index in range(PER_NODE):
            store = memory_tier.MemoryTier(
                _shm(run, node), 2 * source + index, directory=f"replica-{2 * source + index}"
            )
            assert "step-13" in store.steps()
    assert not (run["remote"] / "step-13").exists()
    # Node 1's status: its own snapshots of 13 and the copies it keeps for node 0's ranks.
    assert (
        main(["status", str(run["disk"] / "node-1"), "--memory", str(_shm(run, 1)), "--json"]) == 0
    )
    steps = {s["step"]: s for s in json.loads(capsys.readouterr().out)["steps"]}
    assert steps["step-13"]["memory"] and steps["step-13"]["copies_of_ranks"] == [0, 1]
    assert steps["step-10"]["durability"] == "durable-remote"
    assert not any((run["disk"] / f"node-{n}" / "step-13").exists() for n in range(NODES))


def test_a_lost_node_is_replaced_and_resumes_from_its_partner_bit_exact(killed, broken, tmp_path):
    run = broken("lost")
    _lose_node(run, 0)
    log = tmp_path / "resumed.log"
    _wait(_launch(run, log))
    step = _assert_resumed_exactly(killed[1], _records(log))
    assert step == PAUSE
    restored = _events(run, 0, "restored")
    assert {e["tier"] for e in restored} == {"memory"}
    fetched = _events(run, 0, "restored_from_partner")
    assert sorted((e["rank"], e["holder"]) for e in fetched) == [(0, 2), (1, 3)]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """tests/workers/replica_cases.py, once: what each rank restored in each case."""
    base = tmp_path_factory.mktemp("cases")
    memory = f"/dev/shm/dcp-tiered-repl-cases-{uuid.uuid4().hex[:8]}"
    try:
        torchrun("replica_cases.py", 3, "--memory", memory, "--base", str(base), timeout=240)
    finally:
        for path in Path("/dev/shm").glob(f"{Path(memory).name}-*"):
            shutil.rmtree(path, ignore_errors=True)

    def result(case: str) -> tuple[list[dict], list[dict]]:
        if case == "copies":
            return read_json(base / "copies.json"), []
        events = []
        for rank in range(3):
            path = base / case / f"n{rank}" / ".dcp-tiered-events.jsonl"
            events += [json.loads(line) for line in path.read_text().splitlines()]
        return [read_json(base / f"{case}.rank{r}.json") for r in range(3)], events

    return result


def test_partners_lost_together_fall_back_to_the_remote_tier_and_say_which_steps(cases):
    results, events = cases("partners")
    # Rank 0's copies of steps 6 and 7 were on n1, lost with n0: step 5 (remote) is restored.
    assert [r["restored"] for r in results] == [5, 5, 5], results
    assert all(r["exact"] and r["step"] == 5 for r in results), results
    lost = [e for e in events if e["event"] == "lost"]
    assert len(lost) == 1 and lost[0]["steps"] == ["step-6", "step-7"], lost
    assert lost[0]["ranks"] == [0], lost
    assert "6, 7 were lost" in lost[0]["reason"] and "n0" in lost[0]["reason"], lost
    assert {e["tier"] for e in events if e["event"] == "restored"} == {"local"}


def test_a_corrupt_own_snapshot_is_replaced_by_the_partners_copy(cases):
    results, events = cases("own")
    assert [r["restored"] for r in results] == [7, 7, 7], results
    assert all(r["exact"] and r["step"] == 7 for r in results), results
    fetched = [e for e in events if e["event"] == "restored_from_partner"]
    assert [(e["rank"], e["holder"]) for e in fetched] == [(1, 2)], fetched


def test_a_corrupt_copy_is_detected_and_an_older_whole_copy_used(cases):
    results, events = cases("replica")
    # n0 is gone and n1's copy of rank 0's step 7 fails its checksum: step 6 (the other
    # slot of n1's copies) is the newest step every rank can get whole.
    assert [r["restored"] for r in results] == [6, 6, 6], results
    assert all(r["exact"] and r["step"] == 6 for r in results), results
    fetched = [e for e in events if e["event"] == "restored_from_partner"]
    assert sorted(e["step"] for e in fetched if e["rank"] == 0) == ["step-6"], fetched


def test_status_shows_where_each_steps_copies_are(cases):
    where, _ = cases("copies")
    assert list(where)[:3] == ["step-7", "step-6", "step-5"], where
    for step in ("step-7", "step-6"):  # in every rank's memory, and each copied to the next node
        assert where[step]["memory"] == [0, 1, 2], where[step]
        assert where[step]["partners"] == {"0": [1], "1": [2], "2": [0]}, where[step]
        assert not where[step]["local"] and not where[step]["remote"]
    assert where["step-5"]["local"] and where["step-5"]["memory"] == []
