"""A rank of the job dies (SIGKILL, as a lost node): the next ``save`` on the survivors raises a
typed error (PeerLostError, or ReplicationError naming this rank's replication partners and
their nodes) that says what to do, instead of gloo's bare RuntimeError. Two real processes
on gloo, started without torchrun (whose agent would stop the survivor first)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, WORKERS
from tests.s3server import free_port


def _run(tmp_path, mode: str) -> dict:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKERS / "partner_dies.py"),
                str(rank),
                port,
                str(tmp_path),
                mode,
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert procs[1].returncode == -9, outs[1][-3000:]  # killed, as planned
    assert procs[0].returncode == 0, outs[0][-3000:]
    return json.loads((tmp_path / "outcome.json").read_text())


@pytest.mark.parametrize("mode", ["replication", "plain"])
def test_a_lost_rank_is_a_typed_error_that_says_what_to_do(tmp_path, mode):
    got = _run(tmp_path, mode)
    expected = "ReplicationError" if mode == "replication" else "PeerLostError"
    assert got["raised"] == expected, got
    assert {"PeerLostError", "DcpTieredError", "RuntimeError"} <= set(got["mro"])
    assert "Restart the job" in got["message"]
    if mode == "replication":
        assert "rank 1 on node n1" in got["message"], got["message"]
