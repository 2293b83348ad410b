"""The README's demo command keeps working: crash, resume, and equal losses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.multirank


def test_demo_resumes_with_identical_losses(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from step-7" in proc.stdout  # the memory tier's, newer than the disk's step-6
    assert "resumed losses equal the uninterrupted run: YES" in proc.stdout
