"""What each save achieved, per tier: ``CheckpointManager.save`` returns once the state is
staged, so a save it reports as going to the disk may still be skipped there (no room after
all) or fail; ``wait()``, ``outcome(step)`` and ``outcomes()`` say which steps landed where.
Real tmpfs for the full disk, a real ``file://`` remote."""

from __future__ import annotations

import threading

import pytest
import torch

from dcp_tiered import (
    Admission,
    CheckpointManager,
    Every,
    RemoteConfig,
    RetryConfig,
    SaveFailedError,
    SaveOutcome,
    SavePolicy,
)
from dcp_tiered.policy.cadence import Decision
from dcp_tiered.writer import _datafile  # writes each data file, looked up per call

FAST = RetryConfig(max_attempts=3, initial_backoff_secs=0.02, max_backoff_secs=0.1)


def _state(mib: float) -> dict:
    return {"w": torch.full((int(mib * 2**18),), 1.5)}


def _states(outcomes: dict[str, SaveOutcome]) -> dict[str, str]:
    return {tier: o.state for tier, o in outcomes.items()}


def test_wait_says_which_steps_landed_on_which_tier(tmp_path, tmpfs):
    disk = tmpfs(6)
    remote = RemoteConfig(url=f"file://{tmp_path / 'remote'}", retry=FAST)
    policy = SavePolicy(memory=None, local=Every(steps=1), remote=Every(steps=2))
    lenient = Admission(disk_margin_bytes=0, memory_margin_bytes=0)
    options = {"free_space_margin_bytes": 0, "sync_files": False}
    with CheckpointManager(
        local=disk,
        remote=remote,
        policy=policy,
        admission=lenient,
        writer_options=options,
        events=None,
    ) as mgr:
        assert mgr.save(0, _state(1)) == Decision(local=True, remote=True)
        assert mgr.save(1, _state(1)) == Decision(local=True)
        # 8 MiB, admitted on the 1 MiB the last save staged: the disk has no room after all.
        assert mgr.save(2, _state(8)) == Decision(local=True, remote=True)
        report = mgr.wait()
        assert set(report) == {0, 1, 2}
        assert report[1] == {"local": SaveOutcome(1, "local", "committed")}
        assert report[0]["local"].state == "committed"
        assert report[0]["remote"].state in ("pending", "committed")
        assert _states(report[2]) == {"local": "skipped", "remote": "skipped"}
        assert "InsufficientSpaceError" in (report[2]["local"].reason or "")
        # Refused before writing (the size is known now): said at once, and by wait().
        assert mgr.save(3, _state(8)) == Decision()
        assert mgr.outcome(3)["local"].state == "skipped"
        assert "free" in (mgr.outcome(3)["local"].reason or "")  # the shortfall, in numbers
        later = mgr.wait()
        assert 3 in later and 1 not in later  # final outcomes are reported once
        assert 0 in later or mgr.outcome(0)["remote"].done  # a pending upload comes again
    # close() waited for the uploads: every outcome is final.
    final = mgr.outcomes()
    assert list(final) == [0, 1, 2, 3]
    assert _states(final[0]) == {"local": "committed", "remote": "committed"}
    assert all(o.done for tiers in final.values() for o in tiers.values())
    assert mgr.outcome(99) == {}


def test_a_failed_save_is_reported_failed_with_its_reason(tmp_path, tmpfs):
    disk = tmpfs(6)
    strict = Admission(disk_margin_bytes=0, memory_margin_bytes=0, when_full="raise")
    policy = SavePolicy(memory=None, local=Every(steps=1), remote=None)
    options = {"free_space_margin_bytes": 0, "sync_files": False}
    with CheckpointManager(
        local=disk, policy=policy, admission=strict, writer_options=options, events=None
    ) as mgr:
        mgr.save(0, _state(1))
        mgr.save(1, _state(8))
        report = mgr.wait()
        assert report[0]["local"].state == "committed"
        assert report[1]["local"].state == "failed"
        assert "InsufficientSpaceError" in (report[1]["local"].reason or "")
        with pytest.raises(SaveFailedError):
            mgr.save(2, _state(1))


def test_memory_snapshots_and_skips_at_the_in_flight_cap_are_reported(tmp_path, monkeypatch):
    policy = SavePolicy(memory=Every(steps=1), local=Every(steps=3), remote=None)
    with CheckpointManager(
        memory=tmp_path / "shm", local=tmp_path / "disk", policy=policy, events=None
    ) as mgr:
        for step in range(3):
            mgr.save(step, _state(0.25))
        report = mgr.wait()
    assert _states(report[0]) == {"local": "committed"}
    assert _states(report[1]) == {"memory": "committed"}
    assert _states(report[2]) == {"memory": "committed"}
    every_step = SavePolicy(memory=None, local=Every(steps=1), remote=None)
    with CheckpointManager(
        local=tmp_path / "disk2",
        policy=every_step,
        writer_options={"sync_files": False},
        admission=Admission(max_in_flight=1, when_busy="skip"),
        events=None,
    ) as mgr:
        # The first save's data write is held until the second has been refused, so it is in
        # flight then however fast the disk is.
        writing, release = threading.Event(), threading.Event()
        write_file = _datafile.write_file

        def held_write(*args, **kwargs):
            writing.set()
            assert release.wait(60), "the test never released the held write"
            return write_file(*args, **kwargs)

        monkeypatch.setattr(_datafile, "write_file", held_write)
        mgr.save(0, _state(1))
        assert writing.wait(60)
        try:
            assert mgr.save(1, _state(1)) == Decision()  # the first is still being written
        finally:
            release.set()
        skipped = mgr.outcome(1)["local"]
        assert skipped.state == "skipped" and "in flight" in (skipped.reason or "")
        assert mgr.wait()[0]["local"].state == "committed"
