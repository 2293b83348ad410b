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
        [
            sys.executable,
            str(REPO / "benchmarks" / "suite.py"),
            "--sizes",
            "0.03",
            "--ranks",
            "1,2",
            "--runs",
            "1",
            "--s3-sizes",
            "0.03",
            "--s3-ranks",
            "2",
            "--no-training",
            "--plan-tensors",  # figures 11 and 12 from 200 small tensors, not 2000: ~13 s less
            "200",
            "--dir",
            str(tmp_path),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    result = json.loads(out.read_text())
    assert result["machine"]["cores"] >= 1
    one, two = result["configs"]
    assert (one["world"], two["world"]) == (1, 2)
    assert set(one["ratios"]) == {"1", "2", "3", "4", "7", "10", "11", "12"}
    assert set(two["ratios"]) == {str(n) for n in range(1, 13) if n != 9}
    assert all(r > 0 for c in (one, two) for r in c["ratios"].values())
    assert not list(tmp_path.glob("dcp-tiered-suite-*"))  # the work directory is removed


def test_scale_harness_runs_and_writes_every_field(tmp_path):
    out = tmp_path / "scale.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "scale.py"),
            "--models",
            "tiny",
            "--shardings",
            "fsdp2,fsdp2+tp8",
            "--ranks",
            "8",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["sharding"], r["world"]) for r in rows] == [("fsdp2", 8), ("fsdp2+tp8", 8)]
    for r in rows:
        ours, vanilla = r["ours"], r["vanilla"]
        assert ours["items"] > 0 and ours["files_per_step"] == 16  # 8 ranks x 2 files
        assert ours["manifest_bytes"] > 0 and vanilla["metadata_bytes"] > 0
        assert ours["gathered_bytes"] > 0 and ours["coordinator_peak_bytes"] > 0
        assert ours["reader_peak_bytes"] > 0 and ours["reader_read_items"] > 0
        assert ours["caching"] == "accepted"  # DCP's plan caching is supported
        assert r["vanilla_cached"]["repeat_plan_s"] >= 0
        assert r["s3"]["none"]["save_requests_total"] > 0
        assert r["s3"]["hash"]["restore_requests"]["LIST"] > 0
        assert ours["handshake"]["total_ops"] == 0  # one node: no handshake
    assert not list(tmp_path.glob("dcp-tiered-scale-*"))  # scratch removed


def test_peer_benchmarks_run_without_the_peers(tmp_path):
    """benchmarks/peers.py --quick in the test venv, where no peer is installed: every figure
    of ours is measured, and the peers' columns say "not installed" instead of failing."""
    out = tmp_path / "peers.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "peers.py"),
            "--quick",
            "--states",
            "2k",
            "--s3-configs",
            "2k",
            "--dir",
            str(tmp_path),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    result = json.loads(out.read_text())
    assert result["local"]["2k"]["tensors"] == 100  # the quick 2,000-tensor state
    rows = {r["figure"]: r["cells"] for r in result["rows"]}
    restore = rows["cold restore vs the fastest peer"]["2k"]
    assert restore["ratio"] > 0 and restore["peer"] == "dcp_restore"  # DCP is always there
    assert rows["stall vs memcpy into reused buffers"]["2k"]["ratio"] > 0
    assert rows["memory-tier snapshot (until valid) vs memcpy"]["2k"]["ratio"] > 0
    if not result["machine"]["peers"]["dlrover"]:
        assert rows["stall vs DLRover (save to memory)"]["2k"]["text"] == "not installed"
    if not result["machine"]["peers"]["s3torchconnector"]:
        assert rows["S3 restore vs s3torchconnector"]["2k"]["text"] == "not installed"
    assert result["s3"]["2k"]["samples"]["s3_ours_restore"][0] > 0
    assert (
        result["training"]["vs_none"]["ours"] > 0 and result["training"]["vs_none"]["ours-disk"] > 0
    )
    assert result["training"]["verdicts"]["dcp"] in (True, False)  # ours-disk against DCP
    cpu = result["training"]["background_cpu_s"]
    assert cpu["ours-disk"] > cpu["none"] >= 0  # a disk save's background work is counted
    assert not list(tmp_path.glob("dcp-tiered-peers-*"))  # the work directory is removed


def test_dcp_floor_runs_and_writes_every_figure(tmp_path):
    """benchmarks/dcp_floor.py: DCP's own share beside ours, one quick run."""
    out = tmp_path / "floor.json"
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "dcp_floor.py"), "--state", "2k", "--quick"]
        + ["--runs", "1", "--json", str(out), "--dir", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=300,
        cwd=REPO,
    )
    samples = json.loads(out.read_text())["samples"]
    figures = {"dcp_save_floor", "planners_save", "ours_commit", "dd", "dcp_load_floor"}
    figures |= {"planners_load", "cold_read", "ours_restore"}
    assert set(samples) == figures
    assert all(len(v) == 1 and v[0] > 0 for v in samples.values())


def test_the_20k_commit_is_judged_against_its_own_target():
    """Issue 30's time to committed: at most 1.2x dd for 2,000 and 32 MiB tensors, 2x for
    20,000. The same ratio passes for one state and fails for the others."""
    saved = list(sys.path)  # benchmarks/peers.py puts its own directories first
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import peers
    finally:
        sys.path[:] = saved
    samples = {"ours_commit": [1.9], "dd": [1.0]}
    local = {name: {"samples": samples} for name in ("large", "2k", "20k")}
    report = peers.summarise(local, {}, None, {})
    row = next(r for r in report["rows"] if r["figure"].startswith("time to committed vs dd"))
    assert {n: c["pass"] for n, c in row["cells"].items()} == {
        "large": False,
        "2k": False,
        "20k": True,
    }
    text = peers.render(report, {n: {"tensors": 1, "bytes": 2**20} for n in local}, {})
    assert "<= 1.2 (20,000 tensors: <= 2.0)" in text
