"""One lifecycle under every entry point: the DeepSpeed engine, the Megatron facade and the HF
wrapper behave alike around a save, with the real frameworks on 2 gloo ranks.

Each run here also stands beside a default group that refuses dcp_tiered's collectives, as an
NCCL-only training group would: every agreement runs on the checkpoint layer's own gloo group.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import read_json, torchrun

pytestmark = pytest.mark.framework

DS_ENV = {"DS_ACCELERATOR": "cpu"}


def run_to_the_end(adapter: str, out: Path, remote: list[str], env: dict) -> tuple[Path, list[dict]]:
    """Trains through ``adapter``, saving, and ends the job its documented way; returns the
    step committed locally and what each rank's ending raised."""
    if adapter == "deepspeed":
        torchrun("ds_roundtrip.py", 2, "--out", str(out), "--stage", "1", "--mode", "async",
                 "--phase", "remote-down", *remote, env={**DS_ENV, **env}, timeout=240)
        return out / "ckpt" / "global_step3", [read_json(out / f"end-{r}.json") for r in (0, 1)]
    if adapter == "megatron":
        proc = torchrun("mcore.py", 2, "--out", str(out), "--phase", "facade", "--iters", "4",
                        *remote, env=env, timeout=240, check=False)
        assert proc.returncode != 0  # close() raised
        return out / "ckpt" / "iter_0000004", [read_json(out / f"end-{r}.json") for r in (0, 1)]
    proc = torchrun("hf_resume.py", 2, "--out", str(out), "--phase", "stop", *remote,
                    env={**DS_ENV, **env}, timeout=240, check=False)
    assert proc.returncode != 0  # train() raised
    return out / "run" / "checkpoint-4", [read_json(out / f"stop-end-{r}.json") for r in (0, 1)]


@pytest.mark.parametrize("adapter", ["deepspeed", "megatron", "hf"])
def test_a_remote_that_refuses_writes_fails_the_end_of_the_job_on_every_rank(
        tmp_path, s3, fault_proxy, nccl_like, adapter):
    """The remote answers every upload with 403 AccessDenied (a real S3 error through a proxy;
    listings still work). Ending the job the documented way (DeepSpeed: ``flush``; Megatron:
    ``close``; HF: ``train`` returning) must not report success: every rank raises
    SaveFailedError naming the remote and the cause, and the step stays committed locally.
    No collective of the checkpoint layer touched the (NCCL-like) default group."""
    url = s3.url()
    proxy = fault_proxy(0.0, deny=url.rsplit("/", 1)[1])  # every write under this run's prefix
    remote = ["--remote", url, "--storage-options", json.dumps(s3.options(proxy))]
    committed, ends = run_to_the_end(adapter, tmp_path, remote, nccl_like.env)
    for rank, end in enumerate(ends):
        error = end["error"] or ""
        assert error.startswith("SaveFailedError"), f"rank {rank}: {end}"
        assert url in error and "AccessDenied" in error, f"rank {rank}: {error}"
        assert "not durable" in error, f"rank {rank}: {error}"
    assert (committed / "manifest.json").is_file()  # the local copy is intact and committed
    assert nccl_like.refused(processes=2) == []


@pytest.mark.parametrize("adapter", ["megatron", "hf"])
def test_a_failed_save_raises_on_every_rank_at_one_call_and_the_next_save_works(
        tmp_path, nccl_like, adapter):
    """A user's own directory sits where a save goes (rank 0's node sees it). Every rank raises
    SaveFailedError at the same call, naming the cause and what to do; the directory is left
    untouched; once it is moved away, the next saves work on every rank and the tracker moves
    on. (DeepSpeed's case, an existing tag, is test_deepspeed's
    test_existing_tag_fails_on_every_rank_at_one_call_and_the_next_save_works.)"""
    if adapter == "megatron":
        torchrun("mcore.py", 2, "--out", str(tmp_path), "--phase", "facade", "--iters", "12",
                 "--foreign-at", "8", env=nccl_like.env, timeout=240)
        seen = [read_json(tmp_path / f"failed-{r}.json") for r in (0, 1)]
        assert [s["iteration"] for s in seen] == [8, 8]  # the same call on both ranks
        ckpt = tmp_path / "ckpt"
        assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == [
            "iter_0000004", "iter_0000012"]
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "12"
        moved, step = tmp_path / "moved", "iter_0000008"
    else:
        torchrun("hf_resume.py", 2, "--out", str(tmp_path), "--phase", "foreign",
                 env={**DS_ENV, **nccl_like.env}, timeout=240)
        seen = [read_json(tmp_path / f"foreign-{r}.json") for r in (0, 1)]
        assert seen[0]["at"] == seen[1]["at"]  # the same call on both ranks
        after = read_json(tmp_path / "foreign.json")  # trained again on the same Trainer
        assert after["step"] == 8 and after["left"] == ["checkpoint-6", "checkpoint-8"]
        moved, step = tmp_path / "moved-checkpoint-4", "checkpoint-4"
    for rank, s in enumerate(seen):
        error = s["error"] or ""
        assert error.startswith("SaveFailedError") and "ForeignPathError" in error, error
        assert f"'{step}'" in error and "move what is at that path away" in error, error
        assert "rank 0:" in error, f"rank {rank} does not name the rank that failed: {error}"
    assert (moved / "notes.txt").read_text() == "my notes"  # left as it was
    assert nccl_like.refused(processes=2) == []
