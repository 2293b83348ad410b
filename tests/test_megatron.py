"""megatron-core through dcp_tiered: real megatron-core 0.16, 2 CPU ranks, gloo.

The GPT forward needs three test-only CUDA patches (tests/_megatron.py); the save and load
paths under test need none. Megatron's own optimizers need CUDA, so torch Adam stands in,
sharded with mcore's own optimizer helpers.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, read_json, run_example, skip_without_megatron, torchrun, visible

skip_without_megatron()
pytestmark = [pytest.mark.multirank, pytest.mark.framework]


def results(out: Path) -> list[dict]:
    return [read_json(out / f"result-{r}.json") for r in range(2)]


def losses(out: Path, rank: int = 0) -> dict[int, float]:
    lines = [json.loads(x) for x in (out / f"losses-{rank}.jsonl").read_text().splitlines()]
    return {x["iteration"]: x["loss"] for x in lines if "iteration" in x}


def starts(out: Path) -> list[int]:
    lines = [json.loads(x) for x in (out / "losses-0.jsonl").read_text().splitlines()]
    return [x["start"] for x in lines if "start" in x]


def visible(directory: Path) -> list[str]:
    """What a Megatron user sees in a directory: our own dot-files (locks, records) left out."""
    return sorted(n for n in os.listdir(directory) if not n.startswith(".dcp-tiered"))


def facade(
    out: Path, *args: str, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    return torchrun(
        "mcore.py",
        2,
        "--out",
        str(out),
        "--phase",
        "facade",
        *args,
        timeout=300,
        check=check,
        env=env,
    )


REFERENCE_ITERS = 14


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted facade run of REFERENCE_ITERS iterations, which the restart tests compare
    with: iteration N's loss depends only on the N - 1 before it (no schedule over the run's
    length), so a run of fewer iterations is a prefix of this one."""
    out = tmp_path_factory.mktemp("mcore-reference")
    facade(out, "--iters", str(REFERENCE_ITERS))
    return out


def reference_losses(reference: Path, iters: int, rank: int = 0) -> dict[int, float]:
    """The uninterrupted run's losses of iterations 1..``iters``."""
    assert iters <= REFERENCE_ITERS
    return {it: loss for it, loss in losses(reference, rank).items() if it <= iters}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_strategy_saves_through_the_tiers_and_stock_mcore_loads_it(tmp_path, mode):
    torchrun(
        "mcore.py",
        2,
        "--out",
        str(tmp_path),
        "--phase",
        "strategy",
        *(["--async"] if mode == "async" else []),
        timeout=300,
    )
    for rank, r in enumerate(results(tmp_path)):
        for loader in ("stock", "tiered"):
            got = r[loader]
            assert got["mismatches"] == [], f"rank {rank}, {loader} load differs: {got}"
            assert got["losses"] == r["reference"], f"rank {rank}, {loader}: losses differ"
            assert got["iteration"] == 3
        if mode == "async":  # training moved the weights on while the write was pending
            assert r["trained_while_in_flight"]
    files = results(tmp_path)[0]["files"]
    assert {"manifest.json", ".metadata", "common.pt", "metadata.json"} <= set(files)
    verify = subprocess.run(
        [sys.executable, "-m", "dcp_tiered.cli", "verify", str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_resharding_saved_on_axis_0_loads_split_on_axis_1(tmp_path):
    torchrun("mcore.py", 2, "--out", str(tmp_path), "--phase", "reshard", timeout=300)
    assert results(tmp_path) == [{"stock": True, "tiered": True}] * 2


def test_facade_resumes_after_sigkill_and_keeps_max_ckpt_num(tmp_path, reference):
    run = tmp_path / "run"
    log = run / "ckpt.log"
    killed = facade(run, "--kill-at", "7", "--log-file", str(log), check=False)
    assert killed.returncode != 0
    assert max(losses(run)) == 7
    facade(run, "--attempt", "1", "--log-file", str(log))  # another init: the load must win
    assert starts(run) == [0, 7]  # iteration 7 lived only in host memory
    expected = reference_losses(reference, 12)
    for rank in range(2):
        assert losses(run, rank) == reference_losses(reference, 12, rank)
    assert len(expected) == 12
    ckpt = run / "ckpt"
    # storage every 4 + the memory-only iteration 7, persisted on restore; max_ckpt_num=2
    assert visible(ckpt) == ["iter_0000008", "iter_0000012", "latest_checkpointed_iteration.txt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "12"
    text = log.read_text()
    for it in range(1, 13):
        if it % 4:
            assert f"saved iteration {it} to memory" in text
        else:
            assert f"saving iteration {it} to {ckpt}/iter_{it:07d}" in text
            assert f"iteration {it} committed" in text
    for gone in ("iter_0000004", "iter_0000007"):
        assert f"({gone}: retention of the storage tier)" in text
    assert "restored iteration 7 from memory" in text
    # Nothing written outside the save directory, the memory directory and the log.
    assert sorted(os.listdir(run)) == [
        "ckpt",
        "ckpt.log",
        "losses-0.jsonl",
        "losses-1.jsonl",
        "shm",
    ]
    assert visible(run / "shm") == ["rank-0", "rank-1"]


def test_facade_sweeps_the_directory_a_crashed_storage_save_left(tmp_path):
    """SIGKILL during iteration 8's storage write, after the save claimed iter_0000008/ (and
    mcore < 0.19 wrote common.pt there): the next start removes exactly what the save made, and
    the job then keeps max_ckpt_num committed iter_ directories and nothing else under
    Megatron's names."""
    from tests._megatron import WRITES_COMMON_PT

    run, log = tmp_path / "run", tmp_path / "run" / "ckpt.log"
    killed = facade(
        run, "--iters", "8", "--kill-in-storage-save", "8", "--log-file", str(log), check=False
    )
    assert killed.returncode != 0
    half = run / "ckpt" / "iter_0000008"
    made = [".dcp-tiered-pending.json", *(["common.pt"] if WRITES_COMMON_PT else [])]
    assert sorted(os.listdir(half)) == sorted(made)
    facade(run, "--iters", "10", "--attempt", "1", "--log-file", str(log))
    text = log.read_text()
    for name in made:
        assert (
            f"deleting {half}/{name} (left by a save of iter_0000008 that never committed)" in text
        )
    dirs = sorted(n for n in os.listdir(run / "ckpt") if n.startswith("iter_"))
    assert len(dirs) == 2 and all((run / "ckpt" / d / "manifest.json").exists() for d in dirs)
    assert not any("pending" in f for d in dirs for f in os.listdir(run / "ckpt" / d))
    assert "overwritten by a new save" not in text  # nothing was overwritten


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_facade_falls_back_past_corrupt_copies(tmp_path, nccl_like, reference):
    run = tmp_path / "run"
    facade(run)  # 12 iterations: the disk holds 8 and 12, memory 10 and 11
    for data in (run / "ckpt" / "iter_0000012").glob("*.distcp"):
        flip_byte(data, data.stat().st_size // 2)
    for slot in (run / "shm" / "rank-0").glob("slot-*.json"):  # rank 0's copy only
        if json.loads(slot.read_text())["step"] == "iter_0000011":
            flip_byte(slot.with_suffix(".data"), 100)
    log = run / "restart.log"
    # Beside a default group that refuses our collectives, as an NCCL-only one would.
    facade(run, "--iters", "14", "--attempt", "1", "--log-file", str(log), env=nccl_like.env)
    assert nccl_like.refused(processes=2) == []
    assert starts(run) == [0, 10]
    assert losses(run) == reference_losses(reference, 14)
    text = log.read_text()
    # The disk step's flipped byte is proof (it is quarantined); a memory copy is only skipped.
    assert "cannot restore iter_0000012 from storage, trying an older step (proven bad)" in text
    assert "IntegrityError: corrupt data in step 'iter_0000012'" in text
    assert re.search(
        r"rank0 dcp_tiered.lifecycle cannot restore iter_0000011 from memory, trying an older "
        r"step \([^)]*\): rank 0: IntegrityError: memory-tier iter_0000011 of rank 0",
        text,
    )
    assert re.search(
        r"rank1 dcp_tiered.lifecycle cannot restore iter_0000011 from memory, trying an older "
        r"step \([^)]*\): failed on another rank",
        text,
    )
    assert "restored iteration 10 from memory" in text


def test_facade_restores_from_s3_on_a_fresh_node(tmp_path, s3, reference):
    remote = ["--remote", s3.url(), "--storage-options", json.dumps(s3.options())]
    run = tmp_path / "run"
    facade(run, "--iters", "8", "--max-ckpt", "1", *remote)
    for gone in ("ckpt", "shm"):  # a fresh node: no memory snapshots, no local disk
        subprocess.run(["rm", "-rf", str(run / gone)], check=True)
    facade(run, "--iters", "10", "--attempt", "1", *remote)
    assert starts(run) == [0, 8]
    assert losses(run) == reference_losses(reference, 10)


def test_facade_refuses_to_start_from_scratch_when_the_remote_cannot_be_read(tmp_path, s3):
    """A fresh node whose remote names a bucket that does not exist: every rank raises
    PermanentTierError when the facade starts, saying what to fix, instead of training from
    iteration 0."""
    remote = [
        "--remote",
        "s3://no-such-bucket-dcp-tiered/run",
        "--storage-options",
        json.dumps(s3.options()),
    ]
    proc = facade(tmp_path / "run", "--iters", "2", *remote, check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    for rank in range(2):
        assert f"[rank{rank}]: dcp_tiered.errors.PermanentTierError" in out, out[-3000:]
    assert "NoSuchBucket" in out and "create the bucket" in out
    assert not (tmp_path / "run" / "losses-0.jsonl").exists()  # no training step ran


def test_facade_keeps_every_step_the_remote_does_not_hold(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("uploads fail: the remote root is under a regular file")
    run = tmp_path / "run"
    remote = ["--remote", f"file://{blocker}/remote", "--fast-retry"]  # fails without backoff
    proc = facade(run, "--max-ckpt", "1", *remote, check=False)
    assert proc.returncode != 0  # close() reports that the last checkpoint is not durable
    assert "UploadFailedError" in proc.stderr + proc.stdout
    assert sorted(p for p in os.listdir(run / "ckpt") if p.startswith("iter_")) == [
        "iter_0000004",
        "iter_0000008",
        "iter_0000012",
    ]


def test_facade_disk_full_fails_the_save_and_keeps_the_last_checkpoint(tmp_path, tmpfs):
    disk = tmpfs(2)  # room for two ~0.6 MB checkpoints (admission plans 1.3 MB), not three
    run = tmp_path / "run"
    proc = facade(run, "--ckpt", str(disk), "--margin", "0", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"SaveFailedError: Megatron checkpoint 'iter_0000012' in {disk} was not saved" in out
    assert "InsufficientSpaceError" in out and "still names the previous checkpoint" in out
    assert (disk / "latest_checkpointed_iteration.txt").read_text() == "8"
    assert visible(disk) == ["iter_0000004", "iter_0000008", "latest_checkpointed_iteration.txt"]
    verify = subprocess.run(
        [sys.executable, "-m", "dcp_tiered.cli", "verify", str(disk)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_facade_refuses_a_state_it_could_not_restore_unless_trusted(tmp_path):
    """A scheduler state holding an object weights_only loading refuses: without allow_pickle
    the memory save and the storage save (where only rank 0's common.pt holds it) raise
    ConfigError on both ranks and write nothing; with it, memory and storage restore it."""
    torchrun("mcore.py", 2, "--out", str(tmp_path), "--phase", "trust", timeout=300)
    for r in results(tmp_path):
        for it in (1, 2):
            assert r[f"refused-{it}"] and "Position" in r[f"refused-{it}"], r
            assert "allow_pickle=True only for checkpoints you trust" in r[f"refused-{it}"]
        assert "opt_param_scheduler" in r["refused-1"] and "common state" in r["refused-2"]
        assert not [n for n in r["plain-left"] if n.startswith("iter_")], r
        assert r["from-memory"] == [3, "pos 3"] and r["from-storage"] == [3, "pos 3"], r


def test_converter_from_the_legacy_layout(tmp_path):
    torchrun("mcore.py", 2, "--out", str(tmp_path), "--phase", "legacy-save", timeout=300)

    def convert(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "dcp_tiered.cli",
                "convert",
                "megatron",
                str(tmp_path / "legacy"),
                str(tmp_path / "converted"),
                *extra,
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
            check=False,
        )

    first = convert()
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == str(tmp_path / "converted" / "iter_0000001")
    assert (tmp_path / "converted" / "latest_checkpointed_iteration.txt").read_text() == "1"
    again = convert()
    assert again.returncode == 2 and "--overwrite" in again.stderr
    torchrun("mcore.py", 2, "--out", str(tmp_path), "--phase", "legacy-load", timeout=300)
    for rank, r in enumerate(results(tmp_path)):
        assert r["compared"] == 29
        assert r["mismatches"] == [], f"rank {rank}: {r['mismatches']}"
        assert r["iteration"] == 1 and r["scheduler"] == {"num_steps": 1, "max_lr": 0.01}


class _Payload:
    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_converter_refuses_to_unpickle_code(tmp_path):
    import torch

    legacy = tmp_path / "legacy"
    own = legacy / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    own.parent.mkdir(parents=True)
    (legacy / "latest_checkpointed_iteration.txt").write_text("2")
    payload = _Payload()
    payload.marker = tmp_path / "pwned"
    torch.save(
        {"iteration": 2, "model": {"w": torch.ones(2)}, "x": payload},
        own,
        pickle_protocol=pickle.HIGHEST_PROTOCOL,
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dcp_tiered.cli",
            "convert",
            "megatron",
            str(legacy),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert str(own) in proc.stderr and "--trust-source" in proc.stderr
    assert not payload.marker.exists()


def test_example_trains_and_resumes(tmp_path):
    def example(iters: int) -> str:
        return run_example(
            "megatron_gpt.py", "--save", str(tmp_path / "run"), "--iters", str(iters), ranks=2
        )

    assert "resumed from iteration 0" in example(7)
    assert "resumed from iteration 7" in example(12)
    # storage every 5, and iteration 7 (memory only when the first run ended) on restore
    assert sorted(p for p in os.listdir(tmp_path / "run") if p.startswith("iter_")) == [
        "iter_0000007",
        "iter_0000010",
    ]
