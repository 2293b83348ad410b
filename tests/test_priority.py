"""The writer threads' CPU priority: a blocking save's writers run at the priority of the thread
that waits for them; an async save's, below the trainer's."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import TieredStorageWriter
from dcp_tiered._priority import BACKGROUND_NICE
from dcp_tiered.writer import _datafile

pytestmark = pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-thread nice")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.fixture
def writers_nice(monkeypatch):
    """The nice value of every thread that wrote a data file, and whether it was the caller's."""
    seen: list[tuple[int, bool]] = []
    real = _datafile.write_file

    def write_file(*args):
        seen.append((_nice(), threading.current_thread() is threading.main_thread()))
        return real(*args)

    monkeypatch.setattr(_datafile, "write_file", write_file)
    return seen


def _state() -> dict:
    return {f"w{i}": torch.randn(50_000) for i in range(8)}


def test_a_blocking_save_writes_at_the_callers_priority(tmp_path, writers_nice):
    writer = TieredStorageWriter(tmp_path, thread_count=2)
    dcp.save(_state(), checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    writer.close()
    assert len(writers_nice) == 2
    assert all(not on_main for _, on_main in writers_nice)  # the pool's threads
    assert [nice for nice, _ in writers_nice] == [_nice(), _nice()]


def test_an_async_saves_writers_run_below_the_trainer(tmp_path, writers_nice):
    writer = TieredStorageWriter(tmp_path, thread_count=2)
    trainer = _nice()
    dcp.async_save(_state(), checkpoint_id="step-1", storage_writer=writer, no_dist=True).result()
    writer.close()
    assert len(writers_nice) == 2
    assert [nice for nice, _ in writers_nice] == [max(trainer, BACKGROUND_NICE)] * 2
    assert _nice() == trainer  # the trainer's own thread is left alone
