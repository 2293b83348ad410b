"""Disk full, for real: a 24 MiB tmpfs as the local tier."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import InsufficientSpaceError, TieredStorageReader, TieredStorageWriter
from dcp_tiered.backends.local import LocalBackend
from tests.conftest import visible


@pytest.fixture
def tiny_disk(tmpfs):
    return tmpfs(24)


def _state(mib: int, v: float) -> dict:
    return {"w": torch.full((mib * 2**18,), v)}  # float32: 2**18 elements per MiB


def _error(exc: BaseException) -> BaseException:
    err = next(iter(exc.failures.values())) if isinstance(exc, CheckpointException) else exc
    return err[0] if isinstance(err, tuple) else err


def _only_step_1_left(root) -> None:
    assert visible(root) == ["step-1"], os.listdir(root)
    sd = _state(4, 0.0)
    dcp.load(sd, storage_reader=TieredStorageReader(root), no_dist=True)
    assert torch.equal(sd["w"], _state(4, 1.0)["w"])


def test_plan_that_does_not_fit_is_refused_before_writing(tiny_disk):
    root = tiny_disk / "run"
    writer = TieredStorageWriter(root, free_space_margin_bytes=2**20)
    dcp.save(_state(4, 1.0), checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    with pytest.raises(CheckpointException) as e:
        dcp.save(_state(30, 2.0), checkpoint_id="step-2", storage_writer=writer, no_dist=True)
    err = _error(e.value)
    assert isinstance(err, InsufficientSpaceError)
    assert "MiB is free" in str(err) and str(root) in str(err)
    _only_step_1_left(root)


def test_disk_filling_up_mid_write_loses_nothing(tiny_disk, monkeypatch):
    root = tiny_disk / "run"
    writer = TieredStorageWriter(root, free_space_margin_bytes=0)
    dcp.save(_state(4, 1.0), checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    # Another tenant fills the disk after our admission check: the check is told the old,
    # roomy figure and the write itself runs into ENOSPC.
    monkeypatch.setattr(LocalBackend, "free_bytes", lambda self: 2**40)
    with pytest.raises(CheckpointException) as e:
        dcp.save(_state(30, 2.0), checkpoint_id="step-2", storage_writer=writer, no_dist=True)
    assert isinstance(_error(e.value), InsufficientSpaceError)
    monkeypatch.undo()
    writer = TieredStorageWriter(root, free_space_margin_bytes=0)
    writer.recover()  # a restart sweeps the leftovers
    _only_step_1_left(root)
    dcp.save(_state(4, 3.0), checkpoint_id="step-3", storage_writer=writer, no_dist=True)


def test_cached_plan_that_no_longer_fits_is_refused_before_writing(tiny_disk):
    from torch.distributed.checkpoint import DefaultSavePlanner

    from dcp_tiered import _torch_compat

    _torch_compat.forget_save_plans()  # DCP's cache lives as long as the process
    root = tiny_disk / "run"
    writer = TieredStorageWriter(root, free_space_margin_bytes=2 * 2**20)
    planner = DefaultSavePlanner(enable_plan_caching=True)
    for step in (1, 2):  # 8 MiB each of the 24: the third no longer fits
        dcp.save(
            _state(8, float(step)),
            checkpoint_id=f"step-{step}",
            storage_writer=writer,
            planner=planner,
            no_dist=True,
        )
    with pytest.raises(CheckpointException) as e:
        dcp.save(
            _state(8, 3.0),
            checkpoint_id="step-3",
            storage_writer=writer,
            planner=planner,
            no_dist=True,
        )
    err = _error(e.value)
    assert isinstance(err, InsufficientSpaceError), err
    assert "MiB is free" in str(err) and str(root) in str(err)
    assert visible(root) == ["step-1", "step-2"], os.listdir(root)
    sd = _state(8, 0.0)
    dcp.load(sd, checkpoint_id="step-2", storage_reader=TieredStorageReader(root), no_dist=True)
    assert torch.equal(sd["w"], _state(8, 2.0)["w"])
