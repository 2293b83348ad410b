"""Cross-rank agreement runs on the checkpoint layer's own gloo groups, never the training one."""

from __future__ import annotations

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
