"""The benchmark suite runs end to end on a tiny state (its figures are not judged here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_suite_runs_and_writes_every_figure(tmp_path):
    out = tmp_path / "suite.json"
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "suite.py"), "--sizes", "0.03",
         "--ranks", "1,2", "--runs", "1", "--s3-sizes", "0.03", "--s3-ranks", "2",
         "--no-training", "--dir", str(tmp_path), "--out", str(out)],
        check=True, capture_output=True, timeout=600,
    )
    result = json.loads(out.read_text())
    assert result["machine"]["cores"] >= 1
    one, two = result["configs"]
    assert (one["world"], two["world"]) == (1, 2)
    assert set(one["ratios"]) == {"1", "2", "3", "4", "7", "10", "11", "12"}
    assert set(two["ratios"]) == {str(n) for n in range(1, 13) if n != 9}
    assert all(r > 0 for c in (one, two) for r in c["ratios"].values())
    assert not list(tmp_path.glob("dcp-tiered-suite-*"))  # the work directory is removed
