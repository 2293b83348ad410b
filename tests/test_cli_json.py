"""The CLI's ``--json`` output against the schema docs/cli.md documents: the real command
(``python -m dcp_tiered.cli``, a process of its own), on a real root with a ``file://`` remote
that holds some of its steps. Each object is checked key by key (no key missing, none
undocumented) and type by type, with the exit code it reports and the one the process gives."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import RemoteConfig, RetryConfig, TieredStorageWriter, UploadFailedError
from dcp_tiered import __version__ as VERSION

NoneType = type(None)
# docs/cli.md, "--json schema (version 1)": what every command has, ...
ENVELOPE = {
    "schema": int,
    "tool": str,
    "version": str,
    "command": (str, NoneType),
    "exit_code": int,
    "ok": bool,
    "errors": list,
}
ERROR = {"type": str, "message": str}
# ... and, per command, its own keys (``root`` and, where it looks at the remote, ``remote``).
COMMAND = {
    "ls": {"root": str, "run_id": (str, NoneType), "steps": list},
    "status": {
        "root": str,
        "remote": (str, NoneType),
        "run_id": (str, NoneType),
        "memory": (str, NoneType),
        "unreadable": dict,
        "quarantined": list,
        "steps": list,
    },
    "verify": {"root": str, "steps": list},
    "inspect": {
        "root": str,
        "remote": (str, NoneType),
        "step": str,
        "source": str,
        "complete": bool,
        "save_id": str,
        "world_size": int,
        "committed_at": str,
        "bytes": int,
        "ranks": list,
        "tensors": list,
        "objects": list,
    },
    "prune": {
        "root": str,
        "remote": (str, NoneType),
        "dry_run": bool,
        "deleted": list,
        "kept": list,
        "kept_not_durable": list,
    },
    "rm": {
        "root": str,
        "remote": (str, NoneType),
        "step": str,
        "deleted": list,
        "other_copy": (str, NoneType),
    },
}
LS_STEP = {
    "step": str,
    "bytes": int,
    "state": str,
    "world_size": int,
    "committed_at": str,
    "run_id": (str, NoneType),
    "owner": str,
}
LS_HIDDEN = {"step": str, "bytes": NoneType, "state": str, "path": str}
STATUS_STEP = {  # every key but step and durability only where it applies
    "step": str,
    "memory": bool,
    "copies_of_ranks": list,
    "local": bool,
    "remote": (bool, NoneType),
    "saving": bool,
    "promote": bool,
    "remote_dropped": bool,
    "owner": str,
    "durability": str,
}
DURABILITY = {
    "durable-remote",
    "committed-local",
    "committed-local (upload pending)",
    "committed-local (remote unreadable)",
    "committed-local (the remote's retention does not keep it: no upload)",
    "memory",
    "copies",
    "staged",
}
VERIFY_STEP = {"step": str, "ok": bool, "problems": list}
RANK = {"rank": int, "files": int, "items": int, "bytes": int}
TENSOR = {"fqn": str, "dtype": str, "shape": list, "bytes": int, "chunks": list}
CHUNK = {"offsets": list, "sizes": list, "rank": int, "stored_bytes": int}
OBJECT = {"fqn": str, "ranks": list, "stored_bytes": int}
RM_DELETED = {"tier": str, "step": str, "where": str}


def _typed(obj: dict, schema: dict, *, optional: bool = False) -> None:
    """``obj`` has exactly ``schema``'s keys (with ``optional``: a subset of them, always its
    ``step``), each of its type."""
    keys, documented = set(obj), set(schema)
    if optional:
        assert keys <= documented and "step" in keys, (keys - documented, obj)
    else:
        assert keys == documented, (keys ^ documented, obj)
    for key in keys:
        assert isinstance(obj[key], schema[key]), (key, obj[key], schema[key])
        assert not (isinstance(obj[key], bool) and schema[key] is int), (key, obj[key])


def _iso_utc(text: str) -> datetime.datetime:
    at = datetime.datetime.fromisoformat(text)
    assert at.utcoffset() == datetime.timedelta(0), text
    return at


def cli(*args: str, expect: int, fields: set[str] | None = None) -> dict:
    """Run ``dcp-tiered ARGS --json`` as a process; its one JSON object, checked against the
    envelope and (``fields``: the keys of the command present this time; by default all of
    them) the command's own keys."""
    proc = subprocess.run(
        [sys.executable, "-m", "dcp_tiered.cli", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == expect, (proc.returncode, proc.stdout, proc.stderr)
    data = json.loads(proc.stdout)  # one object, nothing else on stdout
    command = COMMAND[args[0]]
    _typed(data, {**ENVELOPE, **{k: command[k] for k in (command if fields is None else fields)}})
    assert (data["schema"], data["tool"], data["version"]) == (1, "dcp-tiered", VERSION)
    assert (data["command"], data["exit_code"], data["ok"]) == (args[0], expect, expect == 0)
    for e in data["errors"]:
        _typed(e, ERROR)
        assert e["message"] in proc.stderr  # and said on stderr
    if expect == 0:
        assert data["errors"] == []
    return data


STATE = {
    "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "h": torch.ones(5, dtype=torch.bfloat16),
    "meta": {"epoch": 3},  # a non-tensor value: one of inspect's objects
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """step-1 and step-3 durable on the remote, step-2 asking for promotion but not there (its
    upload failed: a file stood where its objects must go), and an abandoned save of step-4."""
    tmp = tmp_path_factory.mktemp("cli-json")
    remote_dir = tmp / "remote"
    remote_dir.mkdir()
    url = f"file://{remote_dir}"
    remote = RemoteConfig(url=url, retry=RetryConfig(max_attempts=1, initial_backoff_secs=0.01))
    writer = TieredStorageWriter(tmp / "local", remote=remote, sync_files=False)
    for n in (1, 2, 3):
        if n == 2:
            (remote_dir / "step-2").write_bytes(b"")
        dcp.save(STATE, checkpoint_id=f"step-{n}", storage_writer=writer, no_dist=True)
        if n == 2:
            with pytest.raises(UploadFailedError):
                writer.wait_durable("step-2", timeout_secs=60)
        else:
            writer.wait_durable(f"step-{n}", timeout_secs=60)
    writer.close(wait_durable=False)  # step-2's failed upload is the point
    (remote_dir / "step-2").unlink()  # the remote just lacks step-2, as after a lost upload
    (tmp / "local" / ".step-4.abc123.dcp-tiered-tmp").mkdir()
    return tmp / "local", url


def test_ls_json(root):
    local, _ = root
    data = cli("ls", str(local), expect=0)
    assert data["command"] == "ls" and data["root"] == str(local)
    committed, hidden = data["steps"][:3], data["steps"][3:]
    for row in committed:
        _typed(row, LS_STEP)
        assert row["state"] == "committed" and row["world_size"] == 1 and row["bytes"] > 0
        assert row["run_id"] == data["run_id"] is not None and row["owner"] == "ours"
        _iso_utc(row["committed_at"])
    assert [r["step"] for r in committed] == ["step-1", "step-2", "step-3"]
    assert sum(os.path.getsize(p) for p in (local / "step-1").iterdir()) == committed[0]["bytes"]
    assert len(hidden) == 1
    _typed(hidden[0], LS_HIDDEN)
    assert hidden[0] == {
        "step": "step-4",
        "bytes": None,
        "state": "abandoned",
        "path": ".step-4.abc123.dcp-tiered-tmp",
    }


def test_status_json(root):
    local, url = root
    data = cli("status", str(local), expect=0)
    assert data["remote"] == url and data["memory"] is None and data["unreadable"] == {}
    assert data["quarantined"] == [] and isinstance(data["run_id"], str)
    for row in data["steps"]:
        _typed(row, STATUS_STEP, optional=True)
        assert row["durability"] in DURABILITY
    got = {r["step"]: r for r in data["steps"]}
    assert list(got) == ["step-1", "step-2", "step-3", "step-4"]
    assert got["step-1"] == {
        "step": "step-1",
        "local": True,
        "remote": True,
        "owner": "ours",
        "durability": "durable-remote",
    }
    assert got["step-2"] == {
        "step": "step-2",
        "local": True,
        "remote": False,
        "owner": "ours",
        "promote": True,
        "durability": "committed-local (upload pending)",
    }
    assert got["step-4"] == {"step": "step-4", "saving": True, "durability": "staged"}


def test_verify_json(root):
    local, _ = root
    data = cli("verify", str(local), expect=0)
    for row in data["steps"]:
        _typed(row, VERIFY_STEP)
    assert [(r["step"], r["ok"], r["problems"]) for r in data["steps"]] == [
        (f"step-{n}", True, []) for n in (1, 2, 3)
    ]


def test_inspect_json(root):
    local, url = root
    data = cli("inspect", str(local), "step-1", expect=0)
    assert (data["step"], data["source"], data["complete"], data["world_size"]) == (
        "step-1",
        "local",
        True,
        1,
    )
    assert data["remote"] == url
    _iso_utc(data["committed_at"])
    assert data["bytes"] == sum(os.path.getsize(p) for p in (local / "step-1").glob("*.distcp"))
    for r in data["ranks"]:
        _typed(r, RANK)
    assert [r["rank"] for r in data["ranks"]] == [0]
    assert data["ranks"][0]["items"] == 3 and data["ranks"][0]["bytes"] == data["bytes"]
    for t in data["tensors"]:
        _typed(t, TENSOR)
        for c in t["chunks"]:
            _typed(c, CHUNK)
    got = {t["fqn"]: t for t in data["tensors"]}
    assert list(got) == ["h", "w"]
    assert (got["w"]["dtype"], got["w"]["shape"], got["w"]["bytes"]) == ("float32", [3, 4], 48)
    assert (got["h"]["dtype"], got["h"]["shape"], got["h"]["bytes"]) == ("bfloat16", [5], 10)
    (chunk,) = got["w"]["chunks"]
    assert (chunk["offsets"], chunk["sizes"], chunk["rank"]) == ([0, 0], [3, 4], 0)
    stored = [c["stored_bytes"] for t in data["tensors"] for c in t["chunks"]]
    assert chunk["stored_bytes"] >= 48  # the stored form (DCP torch.saves each tensor)
    for o in data["objects"]:
        _typed(o, OBJECT)
    assert [(o["fqn"], o["ranks"]) for o in data["objects"]] == [("meta.epoch", [0])]
    stored += [o["stored_bytes"] for o in data["objects"]]
    assert all(n > 0 for n in stored) and sum(stored) <= data["bytes"]


def test_prune_dry_run_json(root):
    local, url = root
    before = sorted(os.listdir(local))
    data = cli("prune", str(local), "--keep-latest", "1", "--dry-run", expect=0)
    assert data["remote"] == url and data["dry_run"] is True
    # step-1 and step-2 are due; step-2 is not on the remote, so it stays
    assert data["deleted"] == ["step-1"] and data["kept_not_durable"] == ["step-2"]
    assert data["kept"] == ["step-2", "step-3"]
    assert sorted(os.listdir(local)) == before  # a dry run deletes nothing


def test_rm_refuses_the_only_durable_copy_then_deletes_one_that_has_another(root):
    local, url = root
    refused = cli("rm", str(local), "step-2", expect=2, fields={"root", "remote"})
    assert [e["type"] for e in refused["errors"]] == ["CheckpointExistsError"]
    assert "only durable copy" in refused["errors"][0]["message"]
    assert (local / "step-2").is_dir()  # nothing was deleted
    data = cli("rm", str(local), "step-1", expect=0)
    assert data["step"] == "step-1" and data["other_copy"] == url
    for d in data["deleted"]:
        _typed(d, RM_DELETED)
    assert data["deleted"] == [{"tier": "local", "step": "step-1", "where": str(local)}]
    assert not (local / "step-1").exists()


def test_verify_json_names_a_corrupt_file_and_exits_1(tmp_path):
    with TieredStorageWriter(tmp_path) as writer:
        for step in ("step-1", "step-2"):
            dcp.save(STATE, checkpoint_id=step, storage_writer=writer, no_dist=True)
    data_file = next((tmp_path / "step-2").glob("*.distcp"))
    raw = bytearray(data_file.read_bytes())
    raw[-20] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    data = cli("verify", str(tmp_path), expect=1, fields={"root", "steps"})
    for row in data["steps"]:
        _typed(row, VERIFY_STEP)
    (one, two) = data["steps"]
    assert (one["step"], one["ok"], one["problems"]) == ("step-1", True, [])
    assert (two["step"], two["ok"]) == ("step-2", False)
    assert len(two["problems"]) == 1 and data_file.name in two["problems"][0]
    assert data["errors"] == []  # a problem in the data, not an error of the command


def test_a_usage_error_is_one_json_object_too(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dcp_tiered.cli", "ls", str(tmp_path), "--bogus", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    data = json.loads(proc.stdout)
    _typed(data, ENVELOPE)  # no root: the arguments were never understood
    assert (data["command"], data["exit_code"], data["ok"]) == (None, 2, False)
    assert [e["type"] for e in data["errors"]] == ["UsageError"]
    assert "--bogus" in data["errors"][0]["message"]
