"""A save that goes to the remote tier is written in files of a few tens of MiB
(``_datafile.EARLY_UPLOAD_FILE_BYTES``; 1 MiB here), each thread's one after another, and each
file's upload starts as soon as it is written: the store takes bytes from the first tens of
milliseconds of the write, not once a thread's whole share is written. A save that stays local
keeps one file per thread. Restores, the vanilla reader and a failed write's clean-up see every
file."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import RemoteConfig, RetryConfig, TieredStorageReader, TieredStorageWriter
from dcp_tiered.tiers.root import Tiers
from dcp_tiered.writer import _datafile

LIMIT = 2**20


def _state(v: float) -> dict:
    # 24 tensors of 256 KiB: 6 MiB, about 3 MiB a thread, so 3 files each
    return {f"t{i}": torch.full((2**16,), v + i) for i in range(24)}


@pytest.fixture
def remote(s3, tmp_path, request):
    fast = RetryConfig(max_attempts=12, initial_backoff_secs=0.05, max_backoff_secs=0.5)
    if request.param == "s3":
        return RemoteConfig(url=s3.url(), storage_options=s3.options(), retry=fast)
    return RemoteConfig(url=f"file://{tmp_path}/remote", retry=fast)


@pytest.mark.parametrize("remote", ["s3", "file"], indirect=True)
def test_files_are_uploaded_as_each_is_written_and_restore_from_the_remote(
    tmp_path, remote, monkeypatch
):
    monkeypatch.setattr(_datafile, "EARLY_UPLOAD_FILE_BYTES", LIMIT)
    events: list[str] = []
    lock = threading.Lock()
    write, early = _datafile.write_file, Tiers.upload_early

    def logged_write(save, f, job, sync):
        with lock:
            events.append("write")
        return write(save, f, job, sync)

    def logged_early(tiers, step, save_id, name, *args):
        with lock:
            events.append(f"upload {name}")
        return early(tiers, step, save_id, name, *args)

    monkeypatch.setattr(_datafile, "write_file", logged_write)
    monkeypatch.setattr(Tiers, "upload_early", logged_early)
    root = tmp_path / "local"
    writer = TieredStorageWriter(root, remote=remote)
    dcp.save(_state(1.0), checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    files = sorted(p.name for p in (root / "step-1").glob("*.distcp"))
    assert len(files) == 6, files  # 2 threads x 3 files of about 1 MiB
    assert sorted(e.split()[1] for e in events if e.startswith("upload")) == files
    # the first uploads start before the last files are begun
    assert events.index(f"upload {files[0]}") < len(events) - 1 - events[::-1].index("write")
    writer.wait_durable("step-1", timeout_secs=60)
    writer.close()
    vanilla = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    dcp.load(vanilla, storage_reader=FileSystemReader(root / "step-1"), no_dist=True)
    assert all(torch.equal(vanilla[k], v) for k, v in _state(1.0).items())
    shutil.rmtree(root)  # a replacement node: the remote alone
    back = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    reader = TieredStorageReader(root, remote=remote)
    dcp.load(back, checkpoint_id="step-1", storage_reader=reader, no_dist=True)
    assert reader.files_read_remotely
    assert all(torch.equal(back[k], v) for k, v in _state(1.0).items())


def test_a_local_save_keeps_one_file_per_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(_datafile, "EARLY_UPLOAD_FILE_BYTES", LIMIT)
    with TieredStorageWriter(tmp_path) as writer:
        dcp.save(_state(1.0), checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    assert len(list((tmp_path / "step-1").glob("*.distcp"))) == 2


def test_a_write_failing_in_a_later_file_removes_every_file_of_the_save(tmp_path, monkeypatch):
    monkeypatch.setattr(_datafile, "EARLY_UPLOAD_FILE_BYTES", LIMIT)
    write, calls = _datafile.write_file, []

    def fails_late(save, f, job, sync):
        calls.append(1)
        if len(calls) == 5:
            raise OSError(28, "No space left on device (injected)")
        return write(save, f, job, sync)

    monkeypatch.setattr(_datafile, "write_file", fails_late)
    root = tmp_path / "local"
    writer = TieredStorageWriter(root, remote=RemoteConfig(url=f"file://{tmp_path}/remote"))
    with pytest.raises(CheckpointException, match="local disk full"):
        dcp.save(_state(1.0), checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    writer.close()
    assert not list(root.rglob("*.distcp")), list(root.rglob("*"))
