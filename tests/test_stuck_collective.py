"""A save stuck in one of DCP's collectives is named, once, with its cause and its fix."""

from __future__ import annotations

import json

import pytest

from dcp_tiered import ConfigError, TieredStorageWriter
from tests.conftest import torchrun


def test_a_rank_waiting_in_a_dcp_collective_logs_one_error_naming_the_phase_and_the_fix(tmp_path):
    out = tmp_path / "out.json"
    torchrun(
        "stuck_collective.py",
        2,
        "--root",
        str(tmp_path / "ckpt"),
        "--out",
        str(out),
        "--late-secs",
        "3",
    )
    got = [json.loads((tmp_path / f"out.json.{r}").read_text()) for r in (0, 1)]

    def errors(rank, step):
        return [r["msg"] for r in got[rank]["records"][step] if r["level"] == "ERROR"]

    # Both ranks on time: nothing to say.
    assert errors(0, "step-1") == [] and errors(1, "step-1") == []
    # Rank 1 late: rank 0 waits for the plans; rank 1 itself never waits.
    for rank, step, phase in (
        (0, "step-2", "plan gather"),
        (1, "step-3", "plan gather"),
        (0, "step-4", "final gather of write results before finish"),
    ):
        found = errors(rank, step)
        assert len(found) == 1, (rank, step, got[rank]["records"][step])
        msg = found[0]
        assert f"step {step}: rank {rank}" in msg and phase in msg
        assert "process_group=dcp_tiered.checkpoint_process_group()" in msg
        assert "training" in msg and "collective_timeout_warn_secs" in msg
        # ... and once the late rank arrives the save completes, saying so once.
        assert any(
            "left" in r["msg"] for r in got[rank]["records"][step] if r["level"] == "WARNING"
        )
    assert errors(1, "step-2") == [] and errors(0, "step-3") == [] and errors(1, "step-4") == []
    assert [g["loaded"] for g in got] == [3.0, 3.0]  # step-4 committed and loads
    assert [g["watchers"] for g in got] == [[], []]  # close() leaves no watch thread behind


def test_the_threshold_must_be_positive_or_none(tmp_path):
    with pytest.raises(ConfigError, match="collective_timeout_warn_secs"):
        TieredStorageWriter(tmp_path, collective_timeout_warn_secs=0)
    assert (
        TieredStorageWriter(
            tmp_path, collective_timeout_warn_secs=None
        ).collective_timeout_warn_secs
        is None
    )
