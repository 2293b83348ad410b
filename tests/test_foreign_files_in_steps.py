"""Files a user puts inside a committed local step directory (an eval result, notes, plots) are
not the step's: every path that deletes or replaces a step (retention, ``dcp-tiered rm``, an
overwrite, and the crash recovery that finishes those) deletes only the files a save of ours
writes there and leaves the rest where it was put, named in a warning."""

from __future__ import annotations

import json
import logging
import os

import torch

from dcp_tiered import CheckpointManager, Every, Retention, RetentionPolicy, SavePolicy
from dcp_tiered.cli import main
from dcp_tiered.policy import layout
from dcp_tiered.tiers.local import LocalTier
from dcp_tiered.backends.local import LocalBackend


def _manager(root, **kw) -> CheckpointManager:
    return CheckpointManager(
        local=root, events=None, policy=SavePolicy(local=Every(steps=1), remote=None), **kw
    )


def _state(v: float) -> dict:
    return {"w": torch.full((64,), v), "n": torch.tensor([int(v)])}


def _put_user_files(step_dir) -> None:
    (step_dir / "eval_results.json").write_text('{"acc": 0.93}')
    (step_dir / "user_plots").mkdir()
    (step_dir / "user_plots" / "loss.png").write_bytes(b"png")
    # a directory under a name of ours is not ours either
    (step_dir / "manifest.node-7.json").mkdir()
    (step_dir / "manifest.node-7.json" / "notes.txt").write_text("mine")


def _user_files_at(step_dir) -> None:
    assert (step_dir / "eval_results.json").read_text() == '{"acc": 0.93}'
    assert (step_dir / "user_plots" / "loss.png").read_bytes() == b"png"
    assert (step_dir / "manifest.node-7.json" / "notes.txt").read_text() == "mine"


def _files_of_ours(directory) -> list[str]:
    return [p.name for p in directory.iterdir() if p.is_file() and layout.is_step_file(p.name)]


def test_retention_deletes_only_the_step_files_and_leaves_the_users(tmp_path, caplog):
    root = tmp_path / "local"
    with _manager(root) as m:
        m.save(1, _state(1))
    _put_user_files(root / "step-1")
    keep_one = Retention(local=RetentionPolicy(keep_latest=1))
    with (
        caplog.at_level(logging.INFO, logger="dcp_tiered"),
        _manager(root, retention=keep_one) as m,
    ):
        m.save(2, _state(2))
        m.save(3, _state(3))
    _user_files_at(root / "step-1")  # back where they were put
    assert sorted(os.listdir(root / "step-1")) == [
        "eval_results.json",
        "manifest.node-7.json",
        "user_plots",
    ]
    assert not (root / "step-2").exists()  # a step with nothing foreign goes whole
    tier = LocalTier(LocalBackend(str(root)))
    assert [s.name for s in tier.steps()] == ["step-3"]  # step-1 is no step any more
    assert "eval_results.json, manifest.node-7.json, user_plots are not the step's" in caplog.text
    assert not [n for n in os.listdir(root) if layout.parse_hidden_dir(n)]
    # the next job starts cleanly beside the user's directory, which it leaves alone
    with _manager(root, retention=keep_one) as m:
        assert m.restore(_state(0)) == 4  # step-3's next
    _user_files_at(root / "step-1")


def test_rm_deletes_the_step_and_leaves_the_users_files(tmp_path, capsys):
    root = tmp_path / "local"
    with _manager(root) as m:
        m.save(1, _state(1))
    _put_user_files(root / "step-1")
    assert main(["rm", str(root), "step-1", "--force", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"][0]["step"] == "step-1"
    _user_files_at(root / "step-1")
    assert not _files_of_ours(root / "step-1")


def test_an_overwrite_keeps_the_users_files_of_the_step_it_replaced(tmp_path, caplog):
    root = tmp_path / "local"
    with _manager(root) as m:
        m.save(1, _state(1))
    _put_user_files(root / "step-1")
    with caplog.at_level(logging.WARNING, logger="dcp_tiered"), _manager(root) as m:
        m.save(1, _state(5))  # the manager overwrites a step of its own run
        out = _state(0)
        assert m.restore(out) == 2 and torch.equal(out["w"], _state(5)["w"])
    aside = [n for n in os.listdir(root) if n.endswith(layout.OLD_SUFFIX)]
    assert len(aside) == 1 and aside[0] in caplog.text  # the warning says where they are
    _user_files_at(root / aside[0])
    assert not _files_of_ours(root / aside[0])
    # each later start leaves them alone (and says so) rather than deleting the directory
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dcp_tiered"), _manager(root):
        pass
    _user_files_at(root / aside[0])
    assert "leaving" in caplog.text and aside[0] in caplog.text


def test_the_recovery_of_an_interrupted_delete_leaves_the_users_files(tmp_path):
    root = tmp_path / "local"
    with _manager(root) as m:
        m.save(1, _state(1))
        m.save(2, _state(2))
    # a delete that died after its rename, a crashed atomic write's leftover in the step
    doomed = layout.delete_dir_name("step-1", "0123456789ab")
    os.rename(root / "step-1", root / doomed)
    _put_user_files(root / doomed)
    leftover = root / doomed / f".metadata.json.1234-5678{layout.TMP_SUFFIX}"
    leftover.write_bytes(b"x")
    old = os.path.getmtime(root / doomed) - 3600  # long abandoned
    os.utime(root / doomed, (old, old))
    with _manager(root) as m:
        out = _state(0)
        assert m.restore(out) == 3
    assert not (root / doomed).exists()
    _user_files_at(root / "step-1")  # back under the step's name
    assert sorted(os.listdir(root / "step-1")) == [
        "eval_results.json",
        "manifest.node-7.json",
        "user_plots",
    ]


def test_files_an_adapter_wrote_into_the_step_go_with_it(tmp_path, caplog):
    """An adapter's files in a step (DeepSpeed's stubs, named by the framework, marked ours
    when written; HF Trainer's and mcore's by their fixed names) are deleted with the step;
    the same names with no mark, or in a subdirectory, are someone else's."""
    root = tmp_path / "local"
    with _manager(root) as m:
        m.save(1, _state(1))
    backend = LocalBackend(str(root))
    backend.write_sidecar("step-1", "mp_rank_00_model_states.pt", b"stub")
    (root / "step-1" / "trainer_state.json").write_text("{}")
    (root / "step-1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"theirs")
    with caplog.at_level(logging.WARNING, logger="dcp_tiered"):
        LocalTier(backend).delete_step("step-1", reason="a test")
    assert os.listdir(root / "step-1") == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt is not the step's" in caplog.text
