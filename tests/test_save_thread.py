"""CheckpointManager.save and the adapters' saves (Lifecycle.save) run on a thread of their own
while the caller waits (dcp_tiered/lifecycle/save_thread.py): the caller's heap stays the
training step's. The save behaves as if inline: the same decisions and errors, at the caller's
priority, and an async save's lowering of its own thread never reaches the thread standing in
for the caller; a save asked for on that thread runs there."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from dcp_tiered import CheckpointManager, ConfigError, Every, SavePolicy, TieredStorageWriter
from dcp_tiered._priority import BACKGROUND_NICE, as_the_caller, lower_this_thread
from dcp_tiered.lifecycle import Conventions, Lifecycle
from dcp_tiered.lifecycle.save_thread import SaveThread


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


class App:
    """A Stateful app state that records the thread each save reads it on."""

    def __init__(self, seen: list[str], fail: bool = False) -> None:
        self.seen, self.fail, self.w = seen, fail, torch.arange(1000.0)

    def state_dict(self) -> dict:
        self.seen.append(threading.current_thread().name)
        if self.fail:
            raise ValueError("the app state cannot be read now")
        return {"w": self.w}

    def load_state_dict(self, state: dict) -> None:
        self.w.copy_(state["w"])


def test_saves_run_off_the_callers_thread_and_return_as_if_inline(tmp_path):
    seen: list[str] = []
    policy = SavePolicy(memory=Every(steps=1), local=Every(steps=2), remote=None)
    with CheckpointManager(
        memory=tmp_path / "shm", local=tmp_path / "disk", policy=policy, events=None
    ) as mgr:
        decisions = [mgr.save(step, {"app": App(seen)}) for step in range(4)]
        mgr.wait()
    assert [(d.memory, d.local) for d in decisions] == [
        (False, True),
        (True, False),
        (False, True),
        (True, False),
    ]
    assert seen and all(name.startswith("dcp-tiered-save") for name in seen), seen
    assert threading.current_thread().name not in seen
    restored = App([])
    restored.w.zero_()
    with CheckpointManager(
        memory=tmp_path / "shm", local=tmp_path / "disk", policy=policy, events=None
    ) as mgr:
        assert mgr.restore({"app": restored}) == 4  # the step to start from: after step 3
    assert torch.equal(restored.w, torch.arange(1000.0))


def test_an_error_in_a_save_reaches_the_caller_unchanged(tmp_path):
    with CheckpointManager(local=tmp_path / "disk", events=None) as mgr:
        with pytest.raises(ValueError, match="cannot be read now"):
            mgr.save(0, {"app": App([], fail=True)}, force=True)
        assert mgr.save(1, {"app": App([])}, force=True).local  # the thread lives on


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-thread nice")
def test_a_thread_standing_in_for_the_caller_is_never_lowered():
    """An async save's thread lowers itself (writer.write_data); the same call on the thread
    that runs the caller's save must leave it at the caller's priority."""
    got: dict[str, int] = {}

    def run(name: str, initializer) -> None:
        initializer()
        lower_this_thread()
        got[name] = _nice()

    for name, initializer in (("stand-in", as_the_caller()), ("background", lambda: None)):
        t = threading.Thread(target=run, args=(name, initializer))
        t.start()
        t.join()
    assert got == {"stand-in": _nice(), "background": max(_nice(), BACKGROUND_NICE)}


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_an_adapters_save_runs_off_the_callers_thread(tmp_path, sync, monkeypatch):
    """Lifecycle.save is what the DeepSpeed engine, the HF wrapper and torchtitan call. On the
    thread that calls DCP: a blocking save's planning (the writer's set-up), an async save's
    staging (the writer's ``stage``; it plans on its own thread)."""
    seen: list[str] = []
    method = "set_up_storage_writer" if sync else "stage"
    original = getattr(TieredStorageWriter, method)

    def recording(self, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TieredStorageWriter, method, recording)
    life = Lifecycle(Conventions("Test"))
    try:
        life.save(str(tmp_path), "step-1", {"w": torch.ones(3)}, sync=sync)
        with pytest.raises(ConfigError, match="cannot be pickled"):  # raised on the thread
            life.save(str(tmp_path), "step-2", {"f": lambda: 1}, sync=sync)
        life.save(str(tmp_path), "step-3", {"w": torch.ones(3)}, sync=sync)
        life.finish()
    finally:
        life.close()
    assert len(seen) == 2 and all(name.startswith("dcp-tiered-save") for name in seen), seen
    assert (tmp_path / "step-3" / "manifest.json").is_file()
    assert not (tmp_path / "step-2").exists()


def test_a_save_asked_for_on_the_save_thread_runs_there():
    """One save's hook that saves (or closes) must not wait for the thread it runs on."""
    outer, inner = SaveThread(), SaveThread()
    names: list[str] = []

    def nested() -> str:
        names.append(threading.current_thread().name)
        got = outer.run(lambda: threading.current_thread().name)  # its own thread: inline
        names.append(inner.run(lambda: threading.current_thread().name))  # another's: inline
        outer.close()  # from its own thread: does not join itself
        return got

    result: list[str] = []
    caller = threading.Thread(target=lambda: result.append(outer.run(nested)), daemon=True)
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive(), "the save thread waited for itself"
    assert result == names[:1] and names == [names[0], names[0]]
    assert names[0].startswith("dcp-tiered-save")
    assert outer.run(lambda: 7) == 7  # made again after close
    outer.close()
    inner.close()


def test_an_adapters_memory_snapshot_is_copied_off_the_callers_thread(tmp_path, monkeypatch):
    """MemorySnapshots.save: the Megatron facade's snapshot every iteration (the manager's own
    runs on the manager's save thread, where it is not handed on again)."""
    from dcp_tiered.lifecycle.memory import MemorySnapshots
    from dcp_tiered.tiers.memory import MemoryTier

    seen: list[str] = []
    save = MemoryTier.save

    def recording(self, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(MemoryTier, "save", recording)
    snapshots = MemorySnapshots(
        tmp_path / "shm",
        0,
        world_size=1,
        run_id=None,
        allow_pickle=False,
        replication=None,
        timeout_secs=60,
    )
    try:
        snapshots.save("iter_0000001", {"w": torch.arange(8.0)}).result()
    finally:
        snapshots.close()
    policy = SavePolicy(memory=Every(steps=1), local=Every(steps=100), remote=None)
    with CheckpointManager(
        memory=tmp_path / "shm2", local=tmp_path / "disk", policy=policy, events=None
    ) as mgr:
        assert mgr.save(1, {"w": torch.arange(8.0)}).memory
    assert len(seen) == 2 and all(name.startswith("dcp-tiered-save") for name in seen), seen


@pytest.mark.framework
def test_the_megatron_strategys_saves_run_off_the_callers_thread(monkeypatch):
    """megatron-core calls the strategy's save (and async_save) from dist_checkpointing.save."""
    pytest.importorskip("megatron.core")
    from dcp_tiered.shims.megatron import TieredSaveShardedStrategy

    seen: list[str] = []

    def recording(self, sharded_state_dict, checkpoint_dir):
        seen.append(threading.current_thread().name)
        return checkpoint_dir

    monkeypatch.setattr(TieredSaveShardedStrategy, "_save", recording)
    monkeypatch.setattr(TieredSaveShardedStrategy, "_async_save", recording)
    strategy = object.__new__(TieredSaveShardedStrategy)  # the calls alone: no group needed
    strategy.save({}, "ckpt/iter_0000001")
    assert strategy.async_save({}, "ckpt/iter_0000002") == "ckpt/iter_0000002"
    assert len(seen) == 2 and all(name.startswith("dcp-tiered-save") for name in seen), seen
