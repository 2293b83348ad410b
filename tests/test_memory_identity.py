"""Memory snapshots carry their run and world size: a restore takes only its own run's, of the
same ranks (issue 29). Real shared-memory directories, real processes for the world-size
change."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from dcp_tiered import CheckpointManager, Every, ForeignRunError, SavePolicy
from dcp_tiered.tiers.memory import MemoryTier
from tests.conftest import torchrun
from tests.test_ownership import digest

POLICY = SavePolicy(memory=Every(steps=1), local=Every(steps=100), remote=None)


def app(v: float) -> dict:
    return {"m": {"w": torch.full((32, 32), v), "step": int(v)}}


def run(local, memory, steps, **kw) -> int | None:
    mgr = CheckpointManager(local=local, memory=memory, policy=POLICY, **kw)
    state = app(0)
    start = mgr.restore(state)
    for step in steps:
        mgr.save(step, app(step))
    mgr.close()
    return start


def test_a_new_run_never_resumes_from_another_runs_memory_snapshots(tmp_path, shm):
    assert run(tmp_path / "a", shm, range(1, 4)) is None
    before = digest(shm)
    # A new run (its own, empty local root) with the same memory directory: refused at start,
    # naming the directory and its run; nothing there changes.
    with pytest.raises(ForeignRunError, match="memory directory") as e:
        CheckpointManager(local=tmp_path / "b", memory=shm, policy=POLICY)
    assert str(shm) in str(e.value)
    assert digest(shm) == before
    # The run itself, restarted on its root, resumes from its memory snapshot.
    mgr = CheckpointManager(local=tmp_path / "a", memory=shm, policy=POLICY)
    state = app(0)
    assert mgr.restore(state) == 4 and torch.equal(state["m"]["w"], app(3)["m"]["w"])
    mgr.close()


def test_snapshots_written_before_run_ids_are_never_restored(tmp_path, shm):
    legacy = MemoryTier(shm, 0)  # as dcp_tiered wrote them before run identities
    legacy.save("step-7", app(7)).result()
    legacy.close()
    mgr = CheckpointManager(local=tmp_path / "a", memory=shm, policy=POLICY)
    state = app(0)
    assert mgr.restore(state) is None and torch.equal(state["m"]["w"], app(0)["m"]["w"])
    mgr.close()


def test_copies_of_another_run_or_world_size_are_never_counted(shm, tmp_path):
    """A partner's copies (replication) and a rank's own slots alike: a slot left by another
    run (here copied in beside the run's own) is seen by neither; nor, by the same run at
    another world size, its own."""
    other = tmp_path / "other-shm"
    for root, run_id in ((shm, "run-a"), (other, "run-b")):
        tier = MemoryTier(root, 1, directory="replica-1", run_id=run_id, world_size=2)
        tier.save(f"step-{run_id[-1]}", app(1)).result()
        tier.close()
    for ext in ("data", "json"):  # run-b's slot 0 becomes slot 1 beside run-a's slot 0
        (shm / "replica-1" / f"slot-1.{ext}").write_bytes(
            (other / "replica-1" / f"slot-0.{ext}").read_bytes()
        )
    mine = MemoryTier(shm, 1, directory="replica-1", run_id="run-a", world_size=2)
    assert list(mine.steps()) == ["step-a"]
    assert mine.raw("step-b") is None and mine.lease("step-b") is None
    assert list(MemoryTier(shm, 1, directory="replica-1").steps()) == ["step-a", "step-b"]
    wider = MemoryTier(shm, 1, directory="replica-1", run_id="run-a", world_size=4)
    assert wider.steps() == {}


@pytest.mark.multirank
def test_a_world_size_change_restores_from_disk_not_from_memory(tmp_path, shm):
    """Every rank's snapshot has the shapes a single rank needs (a replicated model), but it
    was taken by 2 ranks: at 1 rank the restore takes the disk tier's step (the README's
    promise), not a memory snapshot that would drop rank 1's part silently."""
    args = ["--memory", str(shm), "--disk", str(tmp_path / "disk"), "--report"]
    torchrun("ws_change.py", 2, *args, str(tmp_path / "two.json"), "--steps", "8")
    torchrun("ws_change.py", 1, *args, str(tmp_path / "one.json"), "--steps", "10")
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["restored"]["tier"] == "local" and one["start"] == 7, one


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
