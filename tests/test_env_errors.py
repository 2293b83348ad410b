"""The environment fails, for real: a read-only filesystem (a real `mount -o remount,ro`, which
root cannot write either), inodes exhausted while bytes are free (a tmpfs with few inodes), on
the local tier and the memory tier, through dcp.save and through CheckpointManager. Each gives
a typed error naming the path and what to do, leaves nothing behind, and the next save works
once the condition is gone."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import (
    Admission,
    CheckpointManager,
    ConfigError,
    Every,
    InsufficientSpaceError,
    NotWritableError,
    SaveFailedError,
    SavePolicy,
    TieredStorageReader,
    TieredStorageWriter,
)
from tests.conftest import visible


def _state(v: float, n: int = 2**16) -> dict:
    return {"w": torch.full((n,), float(v))}


def _error(exc: BaseException) -> BaseException:
    err = next(iter(exc.failures.values())) if isinstance(exc, CheckpointException) else exc
    return err[0] if isinstance(err, tuple) else err


def _save(writer: TieredStorageWriter, step: str, v: float) -> None:
    dcp.save(_state(v), checkpoint_id=step, storage_writer=writer, no_dist=True)


def _loads(root, step: str, v: float) -> None:
    sd = _state(-1)
    dcp.load(sd, checkpoint_id=step, storage_reader=TieredStorageReader(root), no_dist=True)
    assert torch.equal(sd["w"], _state(v)["w"])


def _entries(root) -> list[str]:
    """Everything under the root but the manager's own bookkeeping files."""
    return sorted(n for n in os.listdir(root) if not n.startswith(".dcp-tiered-"))


# ---------------------------------------------------------------- TieredStorageWriter + dcp.save


def test_read_only_root_is_a_typed_error_and_the_next_save_works(tmpfs):
    disk = tmpfs(64)
    root = disk / "run"
    writer = TieredStorageWriter(root, free_space_margin_bytes=0)
    _save(writer, "step-1", 1.0)
    tmpfs.remount(disk, read_only=True)
    with pytest.raises(CheckpointException) as e:
        _save(writer, "step-2", 2.0)
    err = _error(e.value)
    assert isinstance(err, NotWritableError) and isinstance(err, PermissionError)
    assert "read-only" in str(err) and str(root) in str(err) and "remount" in str(err).lower()
    _loads(root, "step-1", 1.0)  # a read-only root still loads what it holds
    tmpfs.remount(disk, read_only=False)
    assert _entries(root) == ["step-1"]  # no hidden temporary directory, no half step
    _save(writer, "step-3", 3.0)
    assert _entries(root) == ["step-1", "step-3"]
    _loads(root, "step-3", 3.0)


def test_read_only_parent_of_a_new_root_is_a_typed_error(tmpfs):
    disk = tmpfs(64)
    tmpfs.remount(disk, read_only=True)
    with pytest.raises(CheckpointException) as e:
        _save(TieredStorageWriter(disk / "run"), "step-1", 1.0)
    err = _error(e.value)
    assert isinstance(err, NotWritableError) and str(disk / "run") in str(err)


@pytest.mark.parametrize("where", ["root", "parent"])
def test_a_root_that_is_a_file_is_a_config_error_and_the_file_is_untouched(tmp_path, where):
    """A file where the root (or a directory above it) should be: ConfigError naming the
    file, from dcp.save and from CheckpointManager; the file is left as it was."""
    blocker = tmp_path / "ckpt"
    blocker.write_bytes(b"not a directory")
    root = blocker if where == "root" else blocker / "run1"
    with pytest.raises(CheckpointException) as e:
        _save(TieredStorageWriter(root), "step-1", 1)
    err = _error(e.value)
    assert isinstance(err, ConfigError) and f"{blocker} is a file" in str(err), err
    with pytest.raises(ConfigError, match="not a directory"):
        CheckpointManager(local=root, memory=None, events=None)
    if where == "root":  # loading from it: the same, not "the step cannot be read"
        with pytest.raises(CheckpointException) as e:
            _loads(root, "step-1", 1)
        err = _error(e.value)
        assert isinstance(err, ConfigError) and f"{blocker} is a file" in str(err), err
    assert blocker.read_bytes() == b"not a directory"


@pytest.mark.parametrize("free_inodes", [0, 1, 2, 3, 4])
def test_inode_exhaustion_is_insufficient_space_naming_inodes(tmpfs, free_inodes):
    """Bytes are free but inodes are not: every place a save creates an entry (its temporary
    directory, its lock, a data file, the manifest, .metadata) fails in turn, typed, saying
    inodes, leaving nothing; once inodes are freed the next save works."""
    disk = tmpfs(64, inodes=64)
    root = disk / "run"
    writer = TieredStorageWriter(root, free_space_margin_bytes=0)
    _save(writer, "step-1", 1.0)
    filler = tmpfs.fill_inodes(disk / "other-tenant", leave=free_inodes)
    with pytest.raises(CheckpointException) as e:
        _save(writer, "step-2", 2.0)
    err = _error(e.value)
    assert isinstance(err, InsufficientSpaceError), err
    assert "inodes" in str(err) and "MiB" in str(err) and str(root) in str(err)
    assert _entries(root) == ["step-1"]  # no leftovers, not even before a restart's sweep
    for path in filler:
        path.unlink()
    _save(writer, "step-3", 3.0)
    assert _entries(root) == ["step-1", "step-3"]
    _loads(root, "step-1", 1.0)
    _loads(root, "step-3", 3.0)


# ---------------------------------------------------------------- CheckpointManager


def _events(root) -> list[dict]:
    import json

    path = root / ".dcp-tiered-events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


EVERY_STEP = SavePolicy(memory=None, local=Every(steps=1), remote=None)
LENIENT = Admission(disk_margin_bytes=0, memory_margin_bytes=0)
NO_MARGIN = {"free_space_margin_bytes": 0}  # a 64 MiB tmpfs: the default margin fills it


def test_manager_skips_a_save_that_runs_out_of_inodes_like_a_full_disk(tmpfs):
    """As a full disk (tests/test_manager.py): under when_full='skip' the save is skipped with
    a warning and an event naming inodes, nothing raises, nothing is left; 'raise' raises
    SaveFailedError at the next save; once inodes are free, saves work again."""
    disk = tmpfs(64, inodes=64)
    with CheckpointManager(
        local=disk, policy=EVERY_STEP, writer_options=NO_MARGIN, admission=LENIENT
    ) as mgr:
        mgr.save(0, _state(0))
        mgr.wait()
        filler = tmpfs.fill_inodes(disk / "other-tenant", leave=2)
        mgr.save(1, _state(1))
        mgr.wait()
        assert mgr.skipped_saves == 1
        for path in filler:
            path.unlink()
        assert mgr.save(2, _state(2)).local
    skipped = [e for e in _events(disk) if e["event"] == "skipped"]
    assert [e["step"] for e in skipped] == [1] and "inodes" in skipped[0]["reason"]
    assert _entries(disk) == ["other-tenant", "step-0", "step-2"]
    strict = Admission(disk_margin_bytes=0, memory_margin_bytes=0, when_full="raise")
    with CheckpointManager(
        local=disk, policy=EVERY_STEP, writer_options=NO_MARGIN, admission=strict
    ) as mgr:
        filler = tmpfs.fill_inodes(disk / "other-tenant", leave=2)
        mgr.save(3, _state(3))
        mgr.wait()
        with pytest.raises(SaveFailedError, match="InsufficientSpaceError.*inodes"):
            mgr.save(4, _state(4))
        for path in filler:
            path.unlink()
        assert mgr.save(5, _state(5)).local
    assert _entries(disk) == ["other-tenant", "step-2", "step-5"]  # retention: 2 latest


def test_manager_raises_for_a_read_only_root_and_recovers_once_writable(tmpfs):
    """A read-only root is not a full disk: it will not pass by itself, so even under
    when_full='skip' the failed save is raised (SaveFailedError naming NotWritableError and
    the path) at the next save rather than every later save being skipped in silence."""
    disk = tmpfs(64)
    with CheckpointManager(
        local=disk, policy=EVERY_STEP, writer_options=NO_MARGIN, admission=LENIENT
    ) as mgr:
        mgr.save(0, _state(0))
        mgr.wait()
        tmpfs.remount(disk, read_only=True)
        mgr.save(1, _state(1))
        mgr.wait()
        with pytest.raises(SaveFailedError, match=f"NotWritableError.*{disk}.*read-only"):
            mgr.save(2, _state(2))
        tmpfs.remount(disk, read_only=False)
        assert mgr.save(3, _state(3)).local
    assert _entries(disk) == ["step-0", "step-3"]
    back = _state(-1)
    with CheckpointManager(local=disk) as mgr:
        assert mgr.restore(back) == 4 and torch.equal(back["w"], _state(3)["w"])


def test_manager_read_only_memory_tier_raises_and_recovers(tmpfs, tmp_path):
    """A memory tier on a read-only tmpfs (remounted before the job: the slots a running tier
    maps keep it writable). Its save fails typed, raised at the next save; once the tmpfs is
    writable again snapshots work."""
    shm = tmpfs(64, name="shm")
    tmpfs.remount(shm, read_only=True)
    policy = SavePolicy(memory=Every(steps=1), local=Every(steps=100), remote=None)
    with CheckpointManager(
        memory=shm,
        local=tmp_path / "disk",
        policy=policy,
        writer_options=NO_MARGIN,
        admission=LENIENT,
    ) as mgr:
        assert mgr.save(1, _state(1)).memory
        mgr.wait()
        with pytest.raises(SaveFailedError, match=f"NotWritableError.*{shm}.*read-only"):
            mgr.save(2, _state(2))
        tmpfs.remount(shm, read_only=False)
        assert mgr.save(3, _state(3)).memory
        mgr.wait()
    assert visible(shm) == ["rank-0"]
    back = _state(-1)
    with CheckpointManager(memory=shm, local=tmp_path / "disk", policy=policy) as mgr:
        assert mgr.restore(back) == 4 and torch.equal(back["w"], _state(3)["w"])


def test_manager_memory_tier_out_of_inodes_is_skipped(tmpfs, tmp_path):
    shm = tmpfs(64, name="shm", inodes=16)
    tmpfs.fill_inodes(shm / "other-tenant", leave=0)
    policy = SavePolicy(memory=Every(steps=1), local=Every(steps=100), remote=None)
    with CheckpointManager(
        memory=shm,
        local=tmp_path / "disk",
        policy=policy,
        writer_options=NO_MARGIN,
        admission=LENIENT,
    ) as mgr:
        assert mgr.save(1, _state(1)).memory  # the copy fails: skipped, not raised
        mgr.wait()
        assert mgr.skipped_saves == 1
        assert mgr.save(2, _state(2)).memory
        mgr.wait()
        assert mgr.skipped_saves == 2
    skipped = [e for e in _events(tmp_path / "disk") if e["event"] == "skipped"]
    assert skipped and "inodes" in skipped[0]["reason"] and str(shm) in skipped[0]["reason"]
    assert visible(shm) == ["other-tenant"]
