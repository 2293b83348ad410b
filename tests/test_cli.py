from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import TieredStorageWriter
from dcp_tiered.cli import main
from tests.s3server import free_port


def _save(root, step):
    dcp.save(
        {"w": torch.ones(1000)},
        checkpoint_id=step,
        storage_writer=TieredStorageWriter(root),
        no_dist=True,
    )


def test_ls_lists_steps_sizes_and_state(tmp_path, capsys):
    _save(tmp_path, "step-1")
    _save(tmp_path, "step-2")
    (tmp_path / ".step-3.abc.dcp-tiered-tmp").mkdir()
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step-1" in out and "step-2" in out and "committed" in out and "KiB" in out
    assert "step-3" in out and "abandoned" in out


def test_verify_detects_flipped_byte(tmp_path, capsys):
    _save(tmp_path, "step-1")
    _save(tmp_path, "step-2")
    assert main(["verify", str(tmp_path)]) == 0
    data_file = next((tmp_path / "step-2").glob("*.distcp"))
    raw = bytearray(data_file.read_bytes())
    raw[-20] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path), "step-1"]) == 0
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "step-1: OK" in out and "step-2: CORRUPT" in out and data_file.name in out


def test_verify_unknown_step_is_a_clear_error(tmp_path):
    _save(tmp_path, "step-1")
    proc = subprocess.run(
        [sys.executable, "-m", "dcp_tiered.cli", "verify", str(tmp_path), "step-7"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "step-1" in proc.stderr and "step-7" in proc.stderr


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dcp_tiered.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_a_root_that_is_missing_or_a_file_is_an_error_not_an_empty_listing(tmp_path, capsys):
    a_file = tmp_path / "model.pt"
    a_file.write_text("not a root")
    for command in ("ls", "status", "verify"):
        for root in (tmp_path / "missing", a_file):
            assert main([command, str(root)]) == 2, (command, root)
            assert str(root) in capsys.readouterr().err


def test_status_finds_the_remote_a_writer_recorded_and_says_when_it_cannot_be_read(tmp_path, s3):
    """The root remembers its remote (no --remote needed). When that remote cannot be read,
    status says so on stderr and in JSON, marks remote columns unknown instead of '-', and
    exits 3; it does not pass a durable step off as 'upload pending'."""
    url, root = s3.url(), tmp_path / "root"
    with TieredStorageWriter(root, remote=url, storage_options=s3.options()) as writer:
        dcp.save(
            {"w": torch.ones(1000)}, checkpoint_id="step-1", storage_writer=writer, no_dist=True
        )  # close() waits until it is durable
    aws = {
        "AWS_ACCESS_KEY_ID": s3.key,
        "AWS_SECRET_ACCESS_KEY": s3.secret,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    ok = _cli("status", str(root), "--json", env={**aws, "AWS_ENDPOINT_URL": s3.endpoint})
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert data["remote"] == url and data["unreadable"] == {}
    assert [(s["step"], s["durability"]) for s in data["steps"]] == [("step-1", "durable-remote")]
    gone = {  # nobody listens; botocore tries each request once (the CLI's own retry remains)
        **aws,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
        "AWS_MAX_ATTEMPTS": "1",
    }
    started = time.monotonic()
    bad = _cli("status", str(root), "--json", env=gone)
    assert bad.returncode == 3, bad.stderr
    assert time.monotonic() - started < 60
    data = json.loads(bad.stdout)
    assert url in data["unreadable"]["remote"] and url in bad.stderr
    assert [(s["step"], s["local"], s["remote"]) for s in data["steps"]] == [
        ("step-1", True, None)
    ]  # unknown, not "not there"
    assert "upload pending" not in bad.stdout
