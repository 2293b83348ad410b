"""What is only *named* like ours is left alone (a hostile trial of the thirty-first session).

Each case builds the look-alike for real (links to a user's file or directory, a directory named
like a crashed save's leftover, another run's snapshots whose run record is gone, a remote save
whose marker was lost, a manifest written out again) and checks, byte for byte where something
could be lost, that nothing of it was written through, renamed, deleted or misnamed."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from dcp_tiered import (
    CheckpointManager,
    Every,
    ForeignRunError,
    ManifestError,
    Retention,
    RetentionPolicy,
    SaveFailedError,
    SavePolicy,
)
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.cli import main
from dcp_tiered.config import RemoteConfig
from dcp_tiered.policy import layout
from dcp_tiered.tiers.local import LocalTier
from tests.test_ownership import digest

MEMORY = SavePolicy(memory=Every(steps=1), local=Every(steps=100), remote=None)
HOUR_AGO = time.time() - 3600


def app(v: float) -> dict:
    return {"m": {"w": torch.full((8, 8), v), "b": torch.arange(3.0) * v}}


def age(path: Path) -> None:
    """Make everything under ``path`` (and it) an hour old: past every grace period."""
    for p in [path, *path.rglob("*")]:
        os.utime(p, (HOUR_AGO, HOUR_AGO), follow_symlinks=False)


@pytest.mark.parametrize("where", ["slot file", "rank directory"])
def test_the_memory_tier_never_writes_through_a_link(tmp_path, shm, where):
    mgr = CheckpointManager(local=tmp_path / "local", memory=shm, policy=MEMORY)
    mgr.save(1, app(1))
    mgr.close()
    user = tmp_path / "user"
    user.mkdir()
    (user / "slot-1.data").write_bytes(b"the user's own bytes\n" * 8)
    (user / "notes.txt").write_text("not a checkpoint")
    before = digest(user)
    rank = shm / "rank-0"
    if where == "slot file":  # the slot the next save writes is slot 1
        for name in ("slot-1.data", "slot-1.json"):
            (rank / name).unlink(missing_ok=True)
        (rank / "slot-1.data").symlink_to(user / "slot-1.data")
    else:
        shutil.rmtree(rank)
        rank.symlink_to(user, target_is_directory=True)
    mgr = CheckpointManager(local=tmp_path / "local", memory=shm, policy=MEMORY)
    with pytest.raises(SaveFailedError) as e:
        mgr.save(2, app(2))
        mgr.save(3, app(3))  # the memory save's failure is reported by the next save
    mgr.close()
    assert "symbolic link" in str(e.value) and "nothing was written" in str(e.value)
    assert digest(user) == before  # not truncated, not overwritten, nothing added
    assert os.path.islink(rank if where == "rank directory" else rank / "slot-1.data")


def test_another_runs_snapshots_refuse_a_new_run_when_the_run_record_is_gone(tmp_path, shm):
    mgr = CheckpointManager(local=tmp_path / "a", memory=shm, policy=MEMORY, run_id="run-a")
    mgr.save(1, app(1))
    mgr.save(2, app(2))  # step 2 exists only in memory: a local save every 100 steps
    mgr.close()
    (shm / ".dcp-tiered-run.json").unlink()  # a partial clean-up
    before = digest(shm)
    with pytest.raises(ForeignRunError, match="run-a"):
        CheckpointManager(local=tmp_path / "b", memory=shm, policy=MEMORY, run_id="run-b")
    assert digest(shm) == before
    # the run itself continues, and resumes from its snapshot
    mgr = CheckpointManager(local=tmp_path / "a", memory=shm, policy=MEMORY, run_id="run-a")
    state = app(0)
    assert mgr.restore(state) == 3 and torch.equal(state["m"]["w"], app(2)["m"]["w"])
    mgr.close()


def test_the_memory_tier_itself_refuses_slots_of_another_run(tmp_path, shm):
    """Below the manager's start check: a tier whose first save finds another run's slots."""
    from dcp_tiered.tiers.memory import MemoryTier

    tier = MemoryTier(shm, 0, run_id="run-a")
    tier.save("step-1", app(1)).result()
    tier.close()
    (shm / ".dcp-tiered-run.json").unlink()
    before = digest(shm)
    tier = MemoryTier(shm, 0, run_id="run-b")
    with pytest.raises(ForeignRunError, match="run 'run-a'"):
        tier.save("step-7", app(7))
    tier.close()
    assert digest(shm) == before


def test_a_directory_named_like_an_overwrites_leftover_is_left_alone(tmp_path, caplog):
    root = tmp_path / "local"
    mgr = CheckpointManager(local=root, policy=SavePolicy(local=Every(steps=1), remote=None))
    mgr.save(1, app(1))
    mgr.close()
    fakes = [".step-1.0abc.dcp-tiered-old", ".step-9.0abc.dcp-tiered-old"]
    for name in fakes:  # step-1 exists, step-9 does not
        (root / name).mkdir()
        (root / name / "my-notes.txt").write_text("user data, not a checkpoint")
    before = {n: digest(root / n) for n in fakes}
    with caplog.at_level(logging.WARNING, logger="dcp_tiered"):
        assert main(["ls", str(root)]) == 0  # a reader's pass: undoes interrupted overwrites
        mgr = CheckpointManager(local=root, policy=SavePolicy(local=Every(steps=1), remote=None))
        mgr.save(2, app(2))  # a writer's pass: sweeps
        mgr.close()
    assert {n: digest(root / n) for n in fakes} == before
    assert not (root / "step-9").exists()
    assert "holds no manifest of that step" in caplog.text


def test_a_real_interrupted_overwrite_is_still_undone_and_finished(tmp_path):
    """The counterpart: what an overwrite of ours set aside (a committed step's directory)
    goes back under its name when the crash left none there, and is removed once the new
    commit of the same run stands."""
    root = tmp_path / "local"
    mgr = CheckpointManager(local=root, policy=SavePolicy(local=Every(steps=1), remote=None))
    mgr.save(1, app(1))
    mgr.save(2, app(2))
    mgr.close()
    (root / "step-1").rename(root / ".step-1.0abc.dcp-tiered-old")  # crash between renames
    shutil.copytree(root / "step-2", root / ".step-2.0def.dcp-tiered-old")  # crash after both
    tier = LocalTier(LocalBackend(str(root)))
    tier.recover_and_sweep()
    assert (root / "step-1" / layout.MANIFEST_NAME).exists()
    assert not (root / ".step-1.0abc.dcp-tiered-old").exists()
    assert not (root / ".step-2.0def.dcp-tiered-old").exists()
    assert (root / "step-2" / layout.MANIFEST_NAME).exists()


def test_the_sweep_keeps_names_outside_our_save_id_grammar(tmp_path):
    root = tmp_path / "local"
    tier = LocalTier(LocalBackend(str(root)))
    ours = [".step-5.0abc12.dcp-tiered-tmp", ".step-5.h0123456789a.dcp-tiered-tmp"]
    foreign = [
        ".step-5.ZZZ.dcp-tiered-tmp",
        ".step-5.ABC.dcp-tiered-tmp",
        ".my.notes.dcp-tiered-tmp",
        f".step-5.{'a' * 40}.dcp-tiered-tmp",
        ".step-5.not-hex.dcp-tiered-del",
        ".step-5.Up.dcp-tiered-up",
        ".step-5.h0123.dcp-tiered-tmp",
    ]
    for name in ours + foreign:
        (root / name).mkdir(parents=True)
        (root / name / "f").write_text(name)
    age(root)
    tier.recover_and_sweep()
    assert sorted(
        p.name for p in root.iterdir() if p.name.startswith(".step") or ".my" in p.name
    ) == sorted(foreign)


def test_a_remote_save_that_lost_its_marker_is_not_swept(tmp_path, caplog):
    """A save whose manifest reached the remote began its commit: no marker then proves
    nothing (here it was lost after the commit), and the local copy was pruned: it is the
    only copy of the step."""
    remote = tmp_path / "remote"
    kw = {
        "local": tmp_path / "local",
        "remote": RemoteConfig(url=f"file://{remote}"),
        "policy": SavePolicy(local=Every(steps=1), remote=Every(steps=1)),
        "retention": Retention(local=RetentionPolicy(keep_latest=1)),
    }
    mgr = CheckpointManager(**kw)
    mgr.save(1, app(1))
    mgr.save(2, app(2))
    mgr.close()
    assert not (tmp_path / "local" / "step-1").exists()  # durable, so pruned locally
    (remote / "step-1" / "_COMMITTED.json").unlink()
    age(remote)
    before = digest(remote / "step-1")
    assert any(name.endswith(".distcp") for name in before)
    with caplog.at_level(logging.WARNING, logger="dcp_tiered"):
        CheckpointManager(**kw).close()  # a job's start sweeps the remote's orphans
    assert digest(remote / "step-1") == before
    assert "holds its manifest" in caplog.text


def test_ls_names_an_entry_it_may_not_look_at_instead_of_failing(tmp_path, capsys):
    root = tmp_path / "local"
    root.mkdir()
    (root / "step-7").symlink_to("/proc/1/cwd")  # EACCES to stat, even for root (ptrace rules)
    try:
        (root / "step-7").is_dir()
        pytest.skip("this process may look at /proc/1/cwd: no entry to refuse it here")
    except PermissionError:
        pass
    assert main(["ls", str(root), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["exit_code"] == 0


def test_a_manifest_written_out_again_is_named_for_what_it_is(tmp_path, capsys):
    root = tmp_path / "local"
    mgr = CheckpointManager(local=root, policy=SavePolicy(local=Every(steps=1), remote=None))
    mgr.save(1, app(1))
    mgr.close()
    path = root / "step-1" / layout.MANIFEST_NAME
    path.write_text(json.dumps(json.loads(path.read_bytes()), indent=1))  # same content, no seal
    assert main(["verify", str(root), "step-1"]) == 1
    text = capsys.readouterr()
    assert "seal" in text.out + text.err and "upgrade" not in text.out + text.err
    from dcp_tiered.policy import manifest

    with pytest.raises(ManifestError, match="was modified"):
        manifest.parse(path.read_bytes(), where=str(path))


def test_pull_onto_a_users_directory_refuses_before_copying_anything(tmp_path, capsys):
    remote = tmp_path / "remote"
    mgr = CheckpointManager(
        local=tmp_path / "a",
        remote=RemoteConfig(url=f"file://{remote}"),
        policy=SavePolicy(local=Every(steps=1), remote=Every(steps=1)),
    )
    mgr.save(1, app(1))
    mgr.close()
    root = tmp_path / "b"
    (root / "step-1").mkdir(parents=True)
    (root / "step-1" / "mine.txt").write_text("the user's")
    before = digest(root / "step-1")
    code = main(["pull", str(root), "step-1", "--remote", f"file://{remote}", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and "is not a committed step" in json.dumps(out)
    assert "appeared while" not in json.dumps(out)
    assert digest(root / "step-1") == before
    assert not [p for p in root.iterdir() if p.name.startswith(".step-1")]  # nothing downloaded


def test_status_does_not_call_a_local_save_durable_when_the_remote_holds_another(tmp_path, capsys):
    remote, local = tmp_path / "remote", tmp_path / "local"
    mgr = CheckpointManager(
        local=local,
        remote=RemoteConfig(url=f"file://{remote}"),
        policy=SavePolicy(local=Every(steps=1), remote=Every(steps=1)),
    )
    mgr.save(1, app(1))
    mgr.save(2, app(2))
    mgr.close()
    mgr = CheckpointManager(local=local, policy=SavePolicy(local=Every(steps=1), remote=None))
    mgr.save(2, app(22), force=True)  # saved again here, never uploaded
    mgr.close()
    assert main(["status", str(local), "--remote", f"file://{remote}", "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["steps"]}
    assert rows["step-1"]["durability"] == "durable-remote"
    assert rows["step-2"]["durability"].startswith("committed-local")
    assert "another save" in rows["step-2"]["durability"]
