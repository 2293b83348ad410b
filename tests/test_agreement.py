"""Cross-rank agreement runs on the checkpoint layer's own gloo groups, never the training one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import read_json, torchrun

pytestmark = pytest.mark.multirank


def test_the_manager_never_runs_a_collective_on_the_training_group(tmp_path):
    """Beside a default group that refuses CPU collectives (as an NCCL-only one does), the
    manager saves to every tier, reports one rank's failure on every rank, and restores."""
    out = tmp_path / "result.json"
    torchrun("cpu_less_default_group.py", 2, "--root", str(tmp_path), "--out", str(out))
    for rank in range(2):
        r = read_json(tmp_path / f"result.json.{rank}")
        assert r["refused"] == [], f"rank {rank} ran collectives on the default group: {r}"
        assert r["failed"] and "injected write failure" in r["failed"], r
        # step 6 failed (on disk, rank 1): the newest whole step is 5, in host memory
        assert r["restored_step"] == 5 and r["restored"] == rank + 5


def test_a_world_of_one_agrees_without_a_collective():
    """A one-rank job (torchrun --nproc_per_node=1) votes on every save: with no other rank
    to hear from, the vote is its own flags, with no collective (0.5 ms of every save)."""
    script = """
import torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
from dcp_tiered.agreement import Agreement

def refuse(*args, **kwargs):
    raise AssertionError("a collective in a world of one")

agree = Agreement(60)
dist.all_reduce = dist.all_gather_object = refuse
assert agree.world_size == 1
assert agree.vote([0, 3, 1]) == [0, 3, 1] and agree.any(True) and not agree.any(False)
assert agree.gather({"rank": 0}) == [{"rank": 0}]
print("agreed")
"""
    out = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "agreed" in out.stdout, out.stderr[-2000:]
