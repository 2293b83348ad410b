"""The operator's commands (pull, rm, inspect, prune), --json and the exit codes, against real
roots: a local directory, a file:// remote and the moto S3 server."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import TieredStorageReader, TieredStorageWriter, __version__
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.backends.remote import remote_backend
from dcp_tiered.cli import main
from dcp_tiered.policy import layout
from dcp_tiered.tiers.local import LocalTier
from dcp_tiered.tiers.remote import RemoteTier
from tests.s3server import free_port

STATE = {
    "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "h": torch.ones(4, dtype=torch.bfloat16),
    "n": torch.tensor([7], dtype=torch.int64),
}


@pytest.fixture(params=["file", "s3"])
def remote(request, tmp_path, monkeypatch):
    """(url, storage_options) of an empty remote; for S3 the CLI finds the endpoint and
    credentials in the AWS_* environment, as an operator's shell gives them."""
    if request.param == "file":
        return f"file://{tmp_path / 'remote'}", {}
    s3 = request.getfixturevalue("s3")
    for k, v in {
        "AWS_ACCESS_KEY_ID": s3.key,
        "AWS_SECRET_ACCESS_KEY": s3.secret,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3.endpoint,
    }.items():
        monkeypatch.setenv(k, v)
    return s3.url(), s3.options()


def _save(root, step, remote=None, state=STATE):
    with TieredStorageWriter(
        root, remote=remote[0] if remote else None, storage_options=remote[1] if remote else None
    ) as writer:
        dcp.save(state, checkpoint_id=step, storage_writer=writer, no_dist=True)
    # close() waits until the step is durable on the remote


def _json(capsys, *args: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = main([*args, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == 1 and data["exit_code"] == code and data["ok"] == (code == 0)
    assert data["command"] == args[0] and data["version"] == __version__
    return code, data


def _load(root, step):
    out = {k: torch.zeros_like(v) for k, v in STATE.items()}
    dcp.load(out, checkpoint_id=step, storage_reader=TieredStorageReader(root), no_dist=True)
    return out


def test_pull_copies_a_remote_step_verified_and_refuses_a_corrupt_one(tmp_path, remote, capsys):
    _save(tmp_path / "a", "step-1", remote)
    fresh = tmp_path / "b"
    fresh.mkdir()
    code, data = _json(capsys, "pull", str(fresh), "latest", "--remote", remote[0])
    assert code == 0, data["errors"]
    assert data["step"] == "step-1" and data["files"] >= 1 and data["bytes"] > 0
    assert main(["verify", str(fresh), "step-1"]) == 0
    assert all(torch.equal(v, STATE[k]) for k, v in _load(fresh, "step-1").items())
    assert (
        _json(capsys, "pull", str(fresh), "step-1", "--remote", remote[0])[1]["already_local"]
        is True
    )

    backend = remote_backend(remote[0], remote[1])
    keys = RemoteTier(backend).keys_of("step-1")
    files = RemoteTier(backend).read_manifest(keys).files
    data_file = next(n for n in sorted(files) if n.endswith(".distcp"))
    raw = bytearray(backend.get_bytes(keys.file(data_file)))
    raw[-5] ^= 0xFF
    backend.put_bytes(keys.file(data_file), bytes(raw))
    other = tmp_path / "c"
    other.mkdir()
    code, data = _json(capsys, "pull", str(other), "step-1", "--remote", remote[0])
    assert code == 1 and data["errors"][0]["type"] == "IntegrityError"
    # nothing that looks committed, no leftovers (the root's hydration lock file may stay)
    assert [p.name for p in other.iterdir() if "step-1" in p.name] == []
    code, data = _json(capsys, "pull", str(other), "step-9", "--remote", remote[0])
    assert code == 2 and "step-9" in data["errors"][0]["message"]


def test_rm_refuses_the_only_durable_copy_without_force(tmp_path, remote, capsys, caplog):
    root = tmp_path / "root"
    _save(root, "step-1", remote)  # records its remote in the root
    code, data = _json(capsys, "rm", str(root), "step-1")  # the remote keeps a copy
    assert code == 0 and data["other_copy"] == remote[0] and not (root / "step-1").exists()
    code, data = _json(capsys, "rm", str(root), "step-1", "--remote")
    assert code == 2 and "only durable copy" in data["errors"][0]["message"]
    backend = remote_backend(remote[0], remote[1])
    assert RemoteTier(backend).keys_of("step-1") is not None  # nothing was deleted
    with caplog.at_level(logging.INFO, logger="dcp_tiered"):
        code, data = _json(capsys, "rm", str(root), "step-1", "--remote", "--force")
    assert code == 0 and RemoteTier(backend).keys_of("step-1") is None
    assert backend.sizes("step-1/") == {}  # the save's objects went too
    assert any(
        "deleting" in r.getMessage() or "remov" in r.getMessage().lower() for r in caplog.records
    ), "every delete is logged"

    alone = tmp_path / "alone"
    _save(alone, "step-2")
    assert main(["rm", str(alone), "step-2"]) == 2 and (alone / "step-2").is_dir()
    assert main(["rm", str(alone), "step-2", "--force"]) == 0 and not (alone / "step-2").exists()


def test_inspect_reads_the_manifest_alone(tmp_path, remote, capsys):
    root = tmp_path / "root"
    _save(root, "step-1", remote)
    for f in (root / "step-1").glob("*.distcp"):
        f.write_bytes(b"")  # no data is read: inspect still answers
    code, data = _json(capsys, "inspect", str(root), "step-1")
    assert code == 0 and data["source"] == "local" and data["world_size"] == 1
    tensors = {t["fqn"]: t for t in data["tensors"]}
    assert (tensors["w"]["dtype"], tensors["w"]["shape"], tensors["w"]["bytes"]) == (
        "float32",
        [2, 3],
        24,
    )
    assert (tensors["h"]["dtype"], tensors["h"]["bytes"]) == ("bfloat16", 8)
    assert tensors["n"]["dtype"] == "int64" and tensors["n"]["chunks"][0]["rank"] == 0
    assert [r["rank"] for r in data["ranks"]] == [0] and data["ranks"][0]["bytes"] == data["bytes"]
    assert main(["inspect", str(root), "step-1"]) == 0
    assert "bfloat16" in capsys.readouterr().out
    elsewhere = tmp_path / "elsewhere"  # a step only the remote holds
    elsewhere.mkdir()
    code, data = _json(capsys, "inspect", str(elsewhere), "--remote", remote[0])
    assert code == 0 and data["source"] == "remote" and data["step"] == "step-1"
    assert list(elsewhere.iterdir()) == []


def test_prune_keeps_the_newest_milestones_and_steps_not_durable(tmp_path, capsys):
    root = tmp_path / "root"
    for n in range(1, 6):
        _save(root, f"step-{n}")
    code, data = _json(
        capsys, "prune", str(root), "--keep-latest", "2", "--keep-every", "2", "--dry-run"
    )
    assert code == 0 and data["deleted"] == ["step-1", "step-3"]
    assert all((root / f"step-{n}").is_dir() for n in range(1, 6))  # a dry run deletes nothing
    code, data = _json(capsys, "prune", str(root), "--keep-latest", "2", "--keep-every", "2")
    assert code == 0 and data["deleted"] == ["step-1", "step-3"]
    assert sorted(p.name for p in root.glob("step-*")) == ["step-2", "step-4", "step-5"]
    assert main(["prune", str(root), "--keep-latest", "0"]) == 2  # a config error
    assert main(["prune", str(root)]) == 2  # --keep-latest is required


def test_prune_never_deletes_a_step_the_remote_does_not_hold(tmp_path, remote, capsys):
    root = tmp_path / "root"
    for n in range(1, 4):
        _save(root, f"step-{n}", remote)
    backend = remote_backend(remote[0], remote[1])
    run_id = LocalTier(LocalBackend(root)).record().run_id
    RemoteTier(backend).delete("step-1", reason="test: the remote lost it", run_id=run_id)
    code, data = _json(capsys, "prune", str(root), "--keep-latest", "1")
    assert code == 0 and data["deleted"] == ["step-2"] and data["kept_not_durable"] == ["step-1"]
    assert (root / "step-1").is_dir() and not (root / "step-2").exists()


def test_prune_deletes_nothing_when_the_remote_cannot_be_read(tmp_path, capsys, monkeypatch):
    root = tmp_path / "root"
    for n in range(1, 4):
        _save(root, f"step-{n}")
    (root / layout.TIERS_RECORD).write_text(json.dumps({"remote": "s3://bucket/run"}))
    for k, v in {
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
    }.items():  # nobody listens
        monkeypatch.setenv(k, v)
    code, data = _json(capsys, "prune", str(root), "--keep-latest", "1")
    assert code == 3 and "s3://bucket/run" in data["errors"][0]["message"]
    assert len(list(root.glob("step-*"))) == 3


def test_every_command_speaks_one_json_schema_and_documented_exit_codes(tmp_path, capsys):
    root = tmp_path / "root"
    _save(root, "step-1")
    for args in (["ls"], ["verify"], ["status"], ["inspect"]):
        code, data = _json(capsys, args[0], str(root), *args[1:])
        assert code == 0 and data["root"] == str(root) and data["errors"] == []
    code, data = _json(capsys, "verify", str(root), "step-4")
    assert code == 2 and data["errors"][0]["type"] == "CheckpointNotFoundError"
    code, data = _json(capsys, "ls", str(tmp_path / "missing"))
    assert code == 2 and data["errors"]
    capsys.readouterr()
    assert main(["frobnicate", "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["exit_code"] == 2 and data["errors"][0]["type"] == "UsageError"
    assert main(["--version"]) == 0 and __version__ in capsys.readouterr().out
    assert main(["--help"]) == 0 and "pull" in capsys.readouterr().out
