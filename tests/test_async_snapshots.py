"""Memory snapshots copied beside training (``CheckpointManager(async_snapshots=True)``).

``save`` returns once the snapshot is decided and everything but its tensors' bytes is taken;
the copy goes on on the save thread until ``wait_staged``. A tensor changed during the copy
(a loop that forgot ``wait_staged``) fails that snapshot with StateChangedError, never commits
it, and leaves the previous snapshot whole. The copy is held at a gate here, so each test
decides what happens while it runs. Multi-rank: test_manager_resume.py (SIGKILL, resumed
bit-exact from snapshots copied this way)."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from dcp_tiered import (
    CheckpointManager,
    Every,
    SaveFailedError,
    SavePolicy,
    StateChangedError,
    tensor_versions,
)
from dcp_tiered.tiers import memory_slots
from dcp_tiered.tiers.memory import MemoryTier
from tests.conftest import Gate

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
EVERY_STEP = SavePolicy(memory=Every(steps=1), local=Every(steps=1000), remote=None)


def _gate(monkeypatch) -> Gate:
    """Holds every memory-tier copy until opened."""
    return Gate(monkeypatch, MemoryTier, "_copy_bytes")


PICKLED: list[str] = []


class Meta:
    """A value only pickle saves (allow_pickle=True); records when it is encoded."""

    def __init__(self, note: str) -> None:
        self.note = note

    def __reduce__(self):
        PICKLED.append(self.note)
        return (Meta, (self.note,))


def _manager(tmp_path, shm) -> CheckpointManager:
    return CheckpointManager(
        memory=shm, local=tmp_path / "disk", events=None, policy=EVERY_STEP, async_snapshots=True
    )


def _in_memory(shm) -> list[str]:
    return sorted(memory_slots.list_steps(shm), key=lambda n: int(n.split("-")[1]))


def test_save_returns_before_the_copy_and_wait_staged_waits_for_it(tmp_path, shm, monkeypatch):
    w = torch.arange(1 << 16, dtype=torch.float32)
    mgr = _manager(tmp_path, shm)
    mgr.save(0, {"w": w})  # step 0 goes to disk (due at 0): the memory snapshots follow
    mgr.wait()
    gate = _gate(monkeypatch)
    decision = mgr.save(1, {"w": w})  # returns with its copy held at the gate
    assert decision.memory and gate.entered.wait(30)
    waiter = threading.Thread(target=mgr.wait_staged)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "wait_staged returned while the copy was still held"
    gate.open.set()
    waiter.join(30)
    assert not waiter.is_alive()
    mgr.close()
    assert _in_memory(shm) == ["step-1"]
    back = {"w": torch.zeros_like(w)}
    with CheckpointManager(memory=shm, local=tmp_path / "disk", events=None) as again:
        assert again.restore(back) == 2
    assert torch.equal(back["w"], w)


@pytest.mark.parametrize(
    "change",
    [
        lambda w: w.add_(1.0),  # what an optimizer step does to it
        lambda w: setattr(w, "data", w + 1.0),  # other memory: no counter moves
    ],
    ids=["in-place", "other-memory"],
)
def test_a_tensor_changed_during_the_copy_is_never_committed(tmp_path, shm, monkeypatch, change):
    """A loop that changes the state without wait_staged: the snapshot that read it fails
    with StateChangedError, raised by the next save as every tier failure is; the previous
    snapshot stays whole in its slot, and the failed slot is the one written next."""
    w, b = torch.zeros(1 << 16), torch.zeros(8)
    mgr = _manager(tmp_path, shm)
    mgr.save(0, {"w": w, "b": b})
    mgr.save(1, {"w": w, "b": b})  # the snapshot to keep
    mgr.wait()
    gate = _gate(monkeypatch)
    mgr.save(2, {"w": w, "b": b})
    assert gate.entered.wait(30)
    change(w)  # no wait_staged
    gate.open.set()
    mgr.wait_staged()  # the copy is over; its failure belongs to the tier
    with pytest.raises(SaveFailedError) as raised:
        mgr.save(3, {"w": w, "b": b})
    message = str(raised.value)
    assert "StateChangedError" in message and "wait_staged()" in message
    assert '1 tensor(s) changed while the snapshot copied them (["w"])' in message
    assert _in_memory(shm) == ["step-1"]  # step 2 never committed
    monkeypatch.undo()
    mgr.save(4, {"w": w, "b": b})
    mgr.close()
    assert _in_memory(shm) == ["step-1", "step-4"]  # step 4 took the torn slot, not step 1's
    back = {"w": torch.full_like(w, 9.0), "b": torch.ones(8)}
    with CheckpointManager(memory=shm, local=tmp_path / "disk", events=None) as again:
        assert again.restore(back) == 5
    assert torch.equal(back["w"], w) and torch.equal(back["b"], b)


def test_values_are_encoded_before_save_returns(tmp_path, shm, monkeypatch):
    """Non-tensor values are encoded before the caller goes on, while the tensors still copy:
    whatever the loop does to them after ``save`` returns cannot reach the snapshot."""
    w = torch.ones(1024)
    mgr = CheckpointManager(
        memory=shm,
        local=tmp_path / "disk",
        events=None,
        policy=EVERY_STEP,
        async_snapshots=True,
        allow_pickle=True,
    )
    mgr.save(0, {"w": w, "meta": Meta("step 0")})
    mgr.wait()
    gate = _gate(monkeypatch)
    PICKLED.clear()
    mgr.save(1, {"w": w, "meta": Meta("step 1")})
    assert gate.entered.wait(30)  # the copy has not begun ...
    assert PICKLED == ["step 1"]  # ... and the value is already encoded
    gate.open.set()
    mgr.close()


def test_close_wait_and_outcomes_wait_for_the_copy(tmp_path, shm, monkeypatch):
    """Every call that reads or ends the saves waits for a copy beside training first: none
    returns (or reports) while it is held, and the snapshot is committed by the time it does."""
    w = torch.ones(1 << 14)
    mgr = _manager(tmp_path, shm)
    mgr.save(0, {"w": w})
    mgr.wait()
    for step, call in ((1, mgr.outcomes), (2, mgr.wait), (3, mgr.close)):
        with monkeypatch.context() as m:
            gate = _gate(m)
            mgr.save(step, {"w": w})
            assert gate.entered.wait(30)
            caller = threading.Thread(target=call)
            caller.start()
            caller.join(0.3)
            assert caller.is_alive(), f"{call.__name__} returned while the copy was held"
            gate.open.set()
            caller.join(30)
            assert not caller.is_alive()
    assert _in_memory(shm) == ["step-2", "step-3"]


def test_an_unexpected_error_after_save_returned_is_raised_by_the_next_save(
    tmp_path, shm, monkeypatch
):
    """Not a tier's kind of error (a RuntimeError from torch, say) once the caller has gone
    on: it is the step's failure, reported as failed and raised by the next save (on every
    rank, after their vote), not by whichever call happens to wait for the copy."""
    w = torch.ones(1 << 14)
    mgr = _manager(tmp_path, shm)
    mgr.save(0, {"w": w})
    mgr.save(1, {"w": w})
    mgr.wait()

    def broken(*args, **kwargs):
        raise RuntimeError("injected after the caller went on")

    with monkeypatch.context() as m:
        m.setattr(MemoryTier, "_copy_bytes", broken)
        mgr.save(2, {"w": w})  # returns: the error comes after the release
        mgr.wait_staged()  # does not raise it either
        assert mgr.outcome(2)["memory"].state == "failed"
    with pytest.raises(SaveFailedError, match="injected after the caller went on"):
        mgr.save(3, {"w": w})
    mgr.save(4, {"w": w})
    mgr.close()
    assert _in_memory(shm) == ["step-1", "step-4"]


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda ps: torch.optim.AdamW(ps, foreach=True),
        lambda ps: torch.optim.AdamW(ps, foreach=False),
        lambda ps: torch.optim.AdamW(ps, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ],
    ids=["adamw-foreach", "adamw-for-loop", "adamw-fused", "sgd-momentum"],
)
def test_every_optimizer_step_moves_a_version_counter_of_the_state(optimizer):
    """What the check relies on: an optimizer's update moves the counter of at least one
    tensor of the model's and the optimizer's state. A for-each or for-loop step moves every
    one it changes; the fused kernels move none of the parameters' or moments' counters, only
    the step counters' (updated by their own in-place add), which the state holds too."""
    model = torch.nn.Linear(16, 4)
    opt = optimizer(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()  # the state tensors exist from here on
    model(torch.randn(2, 16)).sum().backward()
    tensors = [*model.parameters()] + [
        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    before = tensor_versions.read(tensors)
    tensor_versions.require_unchanged(tensors, before, str, "unchanged")  # no false alarm
    opt.step()
    with pytest.raises(StateChangedError, match="changed while the snapshot copied"):
        tensor_versions.require_unchanged(tensors, before, lambda i: f"t{i}", "here")


def test_a_forward_that_updates_buffers_moves_a_counter_and_inference_tensors_have_none():
    """BatchNorm's forward updates its running statistics in its kernel, which moves no
    counter, and adds to num_batches_tracked in place, which does: its state_dict holds both,
    so the check sees the forward. Inference tensors carry no counter: not checked."""
    bn = torch.nn.BatchNorm1d(4)
    names, buffers = zip(*bn.state_dict(keep_vars=True).items())
    before = tensor_versions.read(buffers)
    bn(torch.randn(8, 4))
    with pytest.raises(StateChangedError, match=r"1 tensor\(s\) changed .*num_batches_tracked"):
        tensor_versions.require_unchanged(buffers, before, names.__getitem__, "bn")
    with torch.inference_mode():
        frozen = torch.ones(3)
    assert tensor_versions.read([frozen, bn.running_mean])[0][0] is None
    tensor_versions.require_unchanged([frozen], tensor_versions.read([frozen]), str, "x")
