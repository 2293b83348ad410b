from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"


def torchrun(script: str, nproc: int, *args: str, timeout: float = 240, check: bool = True,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run tests/workers/<script> on ``nproc`` real gloo ranks."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", "--max-restarts=0", str(WORKERS / script), *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-8000:]}"
        )
    return proc


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture
def run_ranks():
    return torchrun
