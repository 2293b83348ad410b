"""A disk save's staging copy made beside training (``CheckpointManager(async_snapshots=True)``,
with or without a memory tier).

``save`` returns once the step is decided and DCP has the state's structure; the copy of the
tensors' bytes into the staging buffers goes on on the save thread until ``wait_staged``. A
tensor changed during the copy (a loop that forgot ``wait_staged``) fails that save on every
rank before it writes anything, and the previous step stays whole. The copy is held at a gate
here, so each test decides what happens while it runs."""

from __future__ import annotations

import json
import threading
import warnings

import pytest
import torch

from dcp_tiered import CheckpointManager, Every, SaveFailedError, SavePolicy
from dcp_tiered.staging import DoubleBufferStager
from tests.conftest import Gate, torchrun

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
DISK_EVERY_STEP = SavePolicy(local=Every(steps=1), remote=None)


def _gate(monkeypatch) -> Gate:
    """Holds every staging copy until opened."""
    return Gate(monkeypatch, DoubleBufferStager, "_copy")


def _manager(tmp_path) -> CheckpointManager:
    return CheckpointManager(
        local=tmp_path / "disk", events=None, policy=DISK_EVERY_STEP, async_snapshots=True
    )


def _steps(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "disk").glob("step-*"))


def test_a_disk_save_returns_before_its_copy_and_wait_staged_waits_for_it(tmp_path, monkeypatch):
    w = torch.arange(1 << 16, dtype=torch.float32)
    mgr = _manager(tmp_path)
    gate = _gate(monkeypatch)
    decision = mgr.save(0, {"w": w})  # returns with its copy held at the gate
    assert decision.local and gate.entered.wait(30)
    waiter = threading.Thread(target=mgr.wait_staged)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "wait_staged returned while the copy was still held"
    gate.open.set()
    waiter.join(30)
    assert not waiter.is_alive()
    w.add_(1.0)  # after wait_staged: the staged copy has step 0's values
    mgr.close()
    assert _steps(tmp_path) == ["step-0"]
    back = {"w": torch.zeros_like(w)}
    with CheckpointManager(local=tmp_path / "disk", events=None) as again:
        assert again.restore(back) == 1
    assert torch.equal(back["w"], w - 1.0)


@pytest.mark.parametrize(
    "change",
    [
        lambda w: w.add_(1.0),  # what an optimizer step does to it
        lambda w: setattr(w, "data", w + 1.0),  # other memory: no counter moves
    ],
    ids=["in-place", "other-memory"],
)
def test_a_tensor_changed_during_a_disk_copy_fails_the_save_before_it_writes(
    tmp_path, monkeypatch, change
):
    w, b = torch.zeros(1 << 16), torch.zeros(8)
    mgr = _manager(tmp_path)
    mgr.save(1, {"w": w, "b": b})  # the step to keep
    mgr.wait()
    gate = _gate(monkeypatch)
    mgr.save(2, {"w": w, "b": b})
    assert gate.entered.wait(30)
    change(w)  # no wait_staged
    gate.open.set()
    mgr.wait_staged()
    outcome = mgr.wait()[2]["local"]  # its failure, as every background failure ...
    assert outcome.state == "failed" and "StateChangedError" in outcome.reason, outcome
    with pytest.raises(SaveFailedError) as raised:  # ... raised by the next save
        mgr.save(3, {"w": w, "b": b})
    message = str(raised.value)
    assert "StateChangedError" in message and "wait_staged()" in message
    assert "1 tensor(s) changed while the disk save copied them (w)" in message, message
    assert _steps(tmp_path) == ["step-1"]  # step 2 wrote nothing
    monkeypatch.undo()
    mgr.save(4, {"w": w, "b": b})
    mgr.close()
    assert _steps(tmp_path) == ["step-1", "step-4"]
    back = {"w": torch.full_like(w, 9.0), "b": torch.ones(8)}
    with CheckpointManager(local=tmp_path / "disk", events=None) as again:
        assert again.restore(back) == 5
    assert torch.equal(back["w"], w) and torch.equal(back["b"], b)


def test_values_are_taken_before_save_returns(tmp_path, monkeypatch):
    """Non-tensor values are copied before the caller goes on, while the tensors still copy:
    what the loop does to them after ``save`` returns cannot reach the step."""
    w = torch.ones(1024)
    sched = {"last_lrs": [0.1], "epoch": 3}
    mgr = _manager(tmp_path)
    gate = _gate(monkeypatch)
    mgr.save(0, {"w": w, "sched": sched})
    assert gate.entered.wait(30)  # the copy has not begun ...
    sched["last_lrs"].append(0.2)  # ... and the loop changes a value in place
    sched["epoch"] = 4
    gate.open.set()
    mgr.close()
    back = {"w": torch.zeros(1024), "sched": {"last_lrs": [], "epoch": 0}}
    with CheckpointManager(local=tmp_path / "disk", events=None) as again:
        assert again.restore(back) == 1
    assert back["sched"] == {"last_lrs": [0.1], "epoch": 3} and torch.equal(back["w"], w)


def test_one_rank_whose_state_changed_fails_the_save_on_every_rank(tmp_path):
    """Rank 1 changes a tensor during its copy, rank 0 does not: both raise at their next
    save (no rank left waiting in DCP's collectives), nothing of the step is committed, and
    both save again."""
    torchrun("disk_copy_beside.py", 2, "--root", str(tmp_path / "disk"), "--out", str(tmp_path))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["raised"] and "StateChangedError" in got["raised"], got
        assert got["steps"] == ["step-1", "step-3"], got
        assert got["restored"] == 4 and got["equal"], got
