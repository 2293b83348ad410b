"""Run identity on local roots: what two jobs on one root get, and that nothing deletes,
replaces or quarantines a step it cannot prove is its own run's (issue 29).

Real processes (torchrun jobs, the CLI's main), real directories; what would be lost is compared
byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import ForeignPathError, ForeignRunError, TieredStorageWriter
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.cli import main
from dcp_tiered.policy import identity, step_names
from dcp_tiered.tiers import catalog
from dcp_tiered.tiers.local import LocalTier
from tests._manifests import index, tamper
from tests.conftest import REPO, WORKERS, visible
from tests.test_save_load import assert_state_equal, failure, load, save, state


def digest(path: Path) -> dict[str, str]:
    """Every file under ``path`` with the SHA-256 of its bytes."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def cli(capsys, *args: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = main([*args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def job(tmp_path: Path, name: str, root: Path, *args: str, hold: bool = False) -> subprocess.Popen:
    """A real 2-rank training job on ``root`` (tests/workers/job_on_root.py)."""
    report = tmp_path / f"{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=0",
        str(WORKERS / "job_on_root.py"),
        "--root",
        str(root),
        "--report",
        str(report),
        "--release",
        str(tmp_path / f"{name}.release"),
        *(["--hold"] if hold else []),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DCP_TIERED_RUN_ID", None)
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finished(tmp_path: Path, name: str, proc: subprocess.Popen) -> dict:
    _, err = proc.communicate(timeout=240)
    report = tmp_path / f"{name}.json"
    assert report.exists(), f"{name} wrote no report ({proc.returncode}):\n{err[-4000:]}"
    return json.loads(report.read_text())


@pytest.mark.multirank
def test_a_second_job_on_a_root_in_use_is_refused_at_start_naming_the_first(tmp_path):
    root = tmp_path / "root"
    first = job(tmp_path, "a", root, "--value", "1", hold=True)
    deadline = time.monotonic() + 180
    while not (tmp_path / "a.ready").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
        time.sleep(0.1)
    before = digest(root / "step-3")
    second = finished(tmp_path, "b", job(tmp_path, "b", root, "--value", "2"))
    assert second.get("error") == "ForeignRunError", second
    assert "in use by another job" in second["message"] and str(root) in second["message"]
    (tmp_path / "a.release").write_text("")
    report = finished(tmp_path, "a", first)
    assert report["saved"] == [1, 2, 3]
    assert digest(root / "step-3") == before  # the first job's steps are whole
    # Once the first job has ended, a job on the root is the same run going on.
    third = finished(tmp_path, "c", job(tmp_path, "c", root, "--value", "3", "--steps", "4"))
    assert "error" not in third, third
    assert third["run_id"] == report["run_id"] and third["saved"] == [1, 2, 3, 4]


def test_a_job_of_another_run_is_refused_on_a_root_and_changes_nothing(tmp_path):
    root = tmp_path / "root"
    save(root, "step-1", state(1), run_id="run-a")
    before = digest(root)
    with pytest.raises(CheckpointException) as e:
        save(root, "step-2", state(2), run_id="run-b")
    err = failure(e)
    assert isinstance(err, ForeignRunError) and "run 'run-a'" in str(err)
    writer = TieredStorageWriter(root, run_id="run-b")
    with pytest.raises(ForeignRunError, match="run-a"):
        writer.recover()
    assert {k: v for k, v in digest(root).items() if ".dcp-tiered-live" not in k} == {
        k: v for k, v in before.items() if ".dcp-tiered-live" not in k
    }


def _foreign_step(src_root: Path, dst_root: Path, name: str) -> None:
    """A step of another run placed in ``dst_root`` (copied in by a user, say)."""
    shutil.copytree(src_root / name, dst_root / name)


def test_retention_and_overwrite_never_touch_steps_that_are_not_the_runs(tmp_path):
    """Another run's step, a step saved before run ids, a user's copy of a step under another
    name and a vanilla DCP directory survive any number of saves with keep_latest=1, and an
    overwrite of another run's step is refused; the run's own old steps do go."""
    from dcp_tiered import CheckpointManager, Every, Retention, RetentionPolicy, SavePolicy

    other, root = tmp_path / "other", tmp_path / "root"
    save(other, "step-7", state(7), run_id="run-other")
    save(root, "step-1", state(1), run_id="run-a")
    _foreign_step(other, root, "step-7")  # another run's
    save(root, "step-2", state(2), run_id="run-a")
    shutil.copytree(root / "step-2", root / "step-2.bak")  # a user's copy: manifest says step-2
    save(root, "step-8", state(8), run_id="run-a")
    tamper(root / "step-8", edit_index=lambda body: body.pop("run_id"))  # before run ids
    dcp.save(state(3), checkpoint_id=str(root / "vanilla-9"), no_dist=True)  # not ours at all
    kept = {n: digest(root / n) for n in ("step-7", "step-2.bak", "step-8", "vanilla-9")}
    policy = SavePolicy(memory=None, local=Every(steps=1), remote=None)
    mgr = CheckpointManager(
        local=root,
        policy=policy,
        retention=Retention(local=RetentionPolicy(keep_latest=1)),
        run_id="run-a",
    )
    for step in range(10, 14):
        mgr.save(step, {"app": state(step)})
        mgr.wait()
    with pytest.raises(Exception) as e:  # overwrite=True is the manager's default
        mgr.save(7, {"app": state(70)}, force=True)
        mgr.close()
    assert "run-other" in str(e.value) and "step-7" in str(e.value)
    steps = [n for n in visible(root) if not n.startswith(".")]
    assert {n: digest(root / n) for n in kept} == kept, steps
    assert "step-1" not in steps and "step-2" not in steps and "step-13" in steps
    assert_state_equal(load(root, "step-7"), state(7))  # foreign steps still load by name


def test_a_step_saved_before_run_ids_is_adopted_by_hand_and_then_retained_as_the_runs(
    tmp_path, capsys
):
    root = tmp_path / "root"
    for n in (1, 2, 3):
        save(root, f"step-{n}", state(n), run_id="run-a")
        tamper(root / f"step-{n}", edit_index=lambda body: body.pop("run_id"))
    code, data = cli(capsys, "ls", str(root))
    assert code == 0 and {r["step"]: r["owner"] for r in data["steps"]} == dict.fromkeys(
        ("step-1", "step-2", "step-3"), "unowned"
    )
    code, data = cli(capsys, "prune", str(root), "--keep-latest", "1")
    assert code == 0 and data["deleted"] == []  # not provably the run's: left alone
    code, data = cli(capsys, "adopt", str(root), "step-1", "step-2")
    assert code == 0 and [a["step"] for a in data["adopted"]] == ["step-1", "step-2"]
    code, data = cli(capsys, "ls", str(root))
    owners = {r["step"]: r["owner"] for r in data["steps"]}
    assert owners == {"step-1": "ours", "step-2": "ours", "step-3": "unowned"}
    code, data = cli(capsys, "prune", str(root), "--keep-latest", "1")
    assert code == 0 and data["deleted"] == ["step-1"]  # step-3 is no candidate: not adopted
    assert (root / "step-2").is_dir() and (root / "step-3").is_dir()


def test_quarantine_by_hand_is_listed_and_undone_and_refuses_another_runs_step(tmp_path, capsys):
    root, other = tmp_path / "root", tmp_path / "other"
    save(root, "step-1", state(1), run_id="run-a")
    save(root, "step-2", state(2), run_id="run-a")
    save(other, "step-5", state(5), run_id="run-b")
    _foreign_step(other, root, "step-5")
    code, data = cli(capsys, "quarantine", str(root), "step-2", "--reason", "suspect")
    assert code == 0 and not (root / "step-2").exists()
    sid = index(next(root.glob(".step-2.*.dcp-tiered-quarantined")))["save_id"]
    code, data = cli(capsys, "status", str(root))
    assert data["quarantined"] == [{"step": "step-2", "save_id": sid, "tier": "local"}]
    code, data = cli(capsys, "ls", str(root))
    assert [r["step"] for r in data["steps"] if r["state"] == "quarantined"] == ["step-2"]
    assert_state_equal(load(root), state(1))  # latest skips it
    capsys.readouterr()
    assert main(["ls", str(root)]) == 0
    assert "or by hand" in capsys.readouterr().out  # not only a restore quarantines
    code, data = cli(capsys, "quarantine", str(root), "step-2", "--release")
    assert code == 0 and data["save_id"] == sid
    assert_state_equal(load(root), state(2))
    code, data = cli(capsys, "quarantine", str(root), "step-2", "--release")  # nothing left
    assert code == 2 and data["errors"][0]["type"] == "CheckpointNotFoundError"
    assert "no quarantined save" in data["errors"][0]["message"]
    before = digest(root / "step-5")
    code, data = cli(capsys, "quarantine", str(root), "step-5")
    assert code == 2 and data["errors"][0]["type"] == "ForeignPathError"
    assert digest(root / "step-5") == before


def test_ls_and_status_name_the_run_and_list_foreign_steps_as_foreign(tmp_path, capsys):
    root, other = tmp_path / "root", tmp_path / "other"
    save(root, "step-1", state(1), run_id="run-a")
    save(other, "step-4", state(4), run_id="run-b")
    _foreign_step(other, root, "step-4")
    code, data = cli(capsys, "ls", str(root))
    assert data["run_id"] == "run-a"
    rows = {r["step"]: (r["owner"], r["run_id"]) for r in data["steps"]}
    assert rows == {"step-1": ("ours", "run-a"), "step-4": ("foreign", "run-b")}
    code, data = cli(capsys, "status", str(root))
    assert code == 0
    assert {r["step"]: r["owner"] for r in data["steps"]} == {"step-1": "ours", "step-4": "foreign"}
    capsys.readouterr()
    assert main(["ls", str(root)]) == 0
    assert "[foreign: run run-b]" in capsys.readouterr().out


def test_run_records_are_guarded_and_a_bad_one_changes_nothing(tmp_path):
    root = tmp_path / "root"
    save(root, "step-1", state(1), run_id="run-a")
    before = digest(root / "step-1")
    for bad in (b"[1, 2]", b'{"format": "dcp-tiered-run", "run_id": "../x"}', b"{" * 100_000):
        (root / identity.RUN_RECORD).write_bytes(bad)
        with pytest.raises(CheckpointException) as e:
            save(root, "step-2", state(2))
        assert "run record" in str(failure(e)) and not (root / "step-2").exists()
    assert digest(root / "step-1") == before


def test_an_overwrite_never_replaces_a_step_of_another_run_even_when_asked(tmp_path):
    root, other = tmp_path / "root", tmp_path / "other"
    save(root, "step-1", state(1), run_id="run-a")
    save(other, "step-3", state(3), run_id="run-b")
    _foreign_step(other, root, "step-3")
    before = digest(root / "step-3")
    with pytest.raises(CheckpointException) as e:
        save(root, "step-3", state(30), run_id="run-a", overwrite=True)
    assert isinstance(failure(e), ForeignPathError) and "run-b" in str(failure(e))
    assert digest(root / "step-3") == before
    save(root, "step-1", state(10), run_id="run-a", overwrite=True)  # its own: replaced
    assert_state_equal(load(root, "step-1"), state(10))
    assert torch.equal(load(root, "step-3")["w"], state(3)["w"])


def test_a_framework_knows_its_steps_by_their_exact_names(tmp_path):
    """A directory that only looks like a framework's step (leading zeros, a suffix, another
    padding) is not one: an adapter resumes from, and rotates, only the names it builds."""
    names = ["checkpoint-7", "checkpoint-007", "checkpoint-7-old", "iter_0000007", "iter_7"]
    with TieredStorageWriter(tmp_path, sync_files=False) as writer:
        for name in names:
            dcp.save({"w": torch.ones(2)}, checkpoint_id=name, storage_writer=writer, no_dist=True)
    tier = LocalTier(LocalBackend(tmp_path))
    assert sorted(s.name for s in tier.steps()) == sorted(names)

    def numbered(names: step_names.StepNames) -> list[tuple[int, str]]:
        return [(n, s.name) for n, s in catalog.numbered_steps(tier, None, names)]

    assert numbered(step_names.HF) == [(7, "checkpoint-7")]
    assert numbered(step_names.MEGATRON) == [(7, "iter_0000007")]
    assert numbered(step_names.STEP) == numbered(step_names.DEEPSPEED) == []
