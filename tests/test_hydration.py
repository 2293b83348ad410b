"""Hydration (TieredStorageReader(..., hydrate=True)) against a real S3 server (moto): files
read from the remote are copied into the local tier committed like a save (temporary
directory, data, manifest last, rename), so no local step ever looks committed while it
lacks files; and caching being optional, a disk that cannot take them never fails the load."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import RemoteConfig, RetryConfig, TieredStorageReader, TieredStorageWriter
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.backends.remote import RemoteBackend
from dcp_tiered.tiers.local import LocalTier
from dcp_tiered.tiers.pull import adopt_remote_step
from tests.conftest import visible

FAST_RETRY = RetryConfig(max_attempts=4, initial_backoff_secs=0.05, max_backoff_secs=0.2)


def _state(v: float, mib: int = 4) -> dict:
    n = mib * 2**17  # two float32 tensors of mib/2 MiB each: two data files
    return {"a": torch.arange(n, dtype=torch.float32) + v, "b": torch.full((n,), v)}


def _remote(s3) -> RemoteConfig:
    return RemoteConfig(url=s3.url(), storage_options=s3.options(), retry=FAST_RETRY)


def _durable(tmp_path, remote: RemoteConfig, v: float = 1.0) -> None:
    writer = TieredStorageWriter(tmp_path / "saver", remote=remote, thread_count=2)
    dcp.save(_state(v), checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    writer.close(timeout_secs=60)  # waits until durable
    assert len([n for n in os.listdir(tmp_path / "saver" / "step-1") if n.endswith(".distcp")]) == 2


def _load(root, remote=None, **kw) -> TieredStorageReader:
    sd = _state(-1.0)
    reader = TieredStorageReader(root, remote=remote, **kw)
    dcp.load(sd, checkpoint_id="step-1", storage_reader=reader, no_dist=True)
    want = _state(1.0)
    assert torch.equal(sd["a"], want["a"]) and torch.equal(sd["b"], want["b"])
    return reader


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("dcp_tiered")
    ]


def test_hydration_commits_a_complete_step_and_nothing_else(tmp_path, s3):
    remote = _remote(s3)
    _durable(tmp_path, remote)
    root = tmp_path / "fresh"  # a fresh node: the local tier is empty
    assert _load(root, remote, hydrate=True).files_read_remotely
    assert visible(root) == [".dcp-tiered-hydrate.lock", "step-1"]
    assert sorted(os.listdir(root / "step-1")) == sorted(os.listdir(tmp_path / "saver" / "step-1"))
    assert not _load(root).files_read_remotely  # no remote at all now


def test_hydration_fills_an_adopted_step_atomically(tmp_path, s3, tmpfs, monkeypatch, caplog):
    """A step adopted as manifest and .metadata alone (its data stays remote) gets its data by
    the swap of a complete copy: when the disk fills after the first data file the adopted step
    is left exactly as it was, and nothing else is; with room, the step gets every file."""
    remote = _remote(s3)
    _durable(tmp_path, remote)
    disk = tmpfs(3)  # room for one 2 MiB data file, not two
    root = disk / "run"
    adopt_remote_step(LocalTier(LocalBackend(root)), RemoteBackend(remote), "step-1")
    adopted = {n: (root / "step-1" / n).read_bytes() for n in os.listdir(root / "step-1")}
    assert sorted(adopted) == [
        ".metadata",
        "manifest.json",
        "manifest.node-0.json",
        "manifest.shared.json",
    ]
    caplog.set_level(logging.WARNING)
    with monkeypatch.context() as m:  # the space check is told a roomy figure: ENOSPC mid-way
        m.setattr(LocalBackend, "free_bytes", lambda self: 2**40)
        _load(root, remote, hydrate=True)
    assert {n: (root / "step-1" / n).read_bytes() for n in os.listdir(root / "step-1")} == adopted
    assert visible(root) == [".dcp-tiered-hydrate.lock", "step-1"]
    assert len(_warnings(caplog)) == 1 and "InsufficientSpaceError" in _warnings(caplog)[0]
    tmpfs.remount(disk, size_mib=16)
    _load(root, remote, hydrate=True)
    assert len([n for n in os.listdir(root / "step-1") if n.endswith(".distcp")]) == 2
    assert visible(root) == [".dcp-tiered-hydrate.lock", "step-1"]
    assert not _load(root).files_read_remotely


@pytest.mark.parametrize("when", ["checked before writing", "disk fills mid-write"])
def test_hydration_into_a_full_disk_skips_with_one_warning_and_the_load_succeeds(
    tmp_path, s3, tmpfs, monkeypatch, caplog, when
):
    remote = _remote(s3)
    _durable(tmp_path, remote)
    root = tmpfs(3) / "run"  # 4 MiB of data do not fit
    if when == "disk fills mid-write":  # the check is told a roomy figure; the write hits ENOSPC
        monkeypatch.setattr(LocalBackend, "free_bytes", lambda self: 2**40)
    caplog.set_level(logging.WARNING)
    reader = _load(root, remote, hydrate=True)
    assert reader.files_read_remotely
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "hydration of step step-1" in warnings[0] and "skipped" in warnings[0]
    assert "InsufficientSpaceError" in warnings[0] and "load itself succeeded" in warnings[0]
    left = sorted(os.listdir(root)) if root.exists() else []
    assert left in ([], [".dcp-tiered-hydrate.lock"])  # no step, no temporary directory


_KILLED_MID_HYDRATION = """
import json, os, signal, sys
import torch, torch.distributed.checkpoint as dcp
from dcp_tiered import RemoteConfig, TieredStorageReader
from dcp_tiered.tiers import pull
real = pull._download

def download_then_die(*args, **kwargs):  # SIGKILL once the first data file is written
    real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)

pull._download = download_then_die
root, url, options, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
sd = {"a": torch.zeros(n), "b": torch.zeros(n)}
reader = TieredStorageReader(root, remote=RemoteConfig(url=url, storage_options=options),
                             hydrate=True)
dcp.load(sd, checkpoint_id="step-1", storage_reader=reader, no_dist=True)
"""


def test_a_hydration_killed_midway_leaves_no_step_and_is_swept(tmp_path, s3):
    import json
    import signal
    import subprocess
    import sys

    from dcp_tiered import CheckpointNotFoundError

    remote = _remote(s3)
    _durable(tmp_path, remote)
    root = tmp_path / "fresh"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _KILLED_MID_HYDRATION,
            str(root),
            remote.url,
            json.dumps(s3.options()),
            str(4 * 2**17),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    hidden = [n for n in os.listdir(root) if n.endswith(".dcp-tiered-tmp")]
    assert len(hidden) == 1 and "step-1" not in os.listdir(root)  # nothing looks committed
    with pytest.raises(CheckpointException) as e:
        dcp.load(_state(0.0), storage_reader=TieredStorageReader(root), no_dist=True)
    assert isinstance(e.value.failures[0][0], CheckpointNotFoundError)
    TieredStorageWriter(root).recover()  # the local tier's sweep knows the leftover
    assert [n for n in os.listdir(root) if n.endswith(".dcp-tiered-tmp")] == []
    _load(root, remote, hydrate=True)
    assert not _load(root).files_read_remotely
