"""The checks that need a GPU (tests/workers/gpu_checks.py), on every GPU of the machine with an
NCCL default group. Skipped where torch sees no CUDA device (this suite's CI machine); run on
a GPU machine with ``scripts/test tests/test_gpu.py``."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import torchrun

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_state_saves_and_restores_exactly_through_pinned_staging_on_nccl(tmp_path):
    ranks = torch.cuda.device_count()
    out = tmp_path / "seen.json"
    torchrun(
        "gpu_checks.py", ranks, "--root", str(tmp_path / "root"), "--out", str(out), "--gib", "0.25"
    )
    for rank in range(ranks):
        seen = json.loads((tmp_path / f"seen.json.{rank}").read_text())
        assert seen["backend"] == "nccl"
        assert seen["staged_on_cpu"] and seen["staged_pinned"] and seen["staged_exact"], seen
        assert seen["async_save_load_exact"], seen
        # restore returns the step to go on from: one past step 4
        assert seen["manager_exact"] and seen["manager_restored"] == "5", seen
        assert seen["disk_exact"] and seen["disk_restored"] == "5", seen
        assert seen["sync_save_load_exact"], seen
        assert seen["many_exact"] and seen["many_restored"] == "6", seen
