"""One lifecycle under every entry point: the DeepSpeed engine, the Megatron facade and the HF
wrapper behave alike around a save, with the real frameworks on 2 gloo ranks.

Each run here also stands beside a default group that refuses dcp_tiered's collectives, as an
NCCL-only training group would: every agreement runs on the checkpoint layer's own gloo group.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests._model import mismatches
from tests.conftest import read_json, torchrun

pytestmark = pytest.mark.framework

DS_ENV = {"DS_ACCELERATOR": "cpu"}


def run_to_the_end(
    adapter: str, out: Path, remote: list[str], env: dict
) -> tuple[Path, list[dict]]:
    """Trains through ``adapter``, saving, and ends the job its documented way; returns the
    step committed locally and what each rank's ending raised."""
    if adapter == "deepspeed":
        torchrun(
            "ds_roundtrip.py",
            2,
            "--out",
            str(out),
            "--stage",
            "1",
            "--mode",
            "async",
            "--phase",
            "record-end",
            *remote,
            env={**DS_ENV, **env},
            timeout=240,
        )
        return out / "ckpt" / "global_step3", [read_json(out / f"end-{r}.json") for r in (0, 1)]
    if adapter == "megatron":
        proc = torchrun(
            "mcore.py",
            2,
            "--out",
            str(out),
            "--phase",
            "facade",
            "--iters",
            "4",
            *remote,
            env=env,
            timeout=240,
            check=False,
        )
        assert proc.returncode != 0  # close() raised
        return out / "ckpt" / "iter_0000004", [read_json(out / f"end-{r}.json") for r in (0, 1)]
    proc = torchrun(
        "hf_resume.py",
        2,
        "--out",
        str(out),
        "--phase",
        "stop",
        *remote,
        env={**DS_ENV, **env},
        timeout=240,
        check=False,
    )
    assert proc.returncode != 0  # train() raised
    return out / "run" / "checkpoint-4", [read_json(out / f"stop-end-{r}.json") for r in (0, 1)]


@pytest.mark.parametrize("adapter", ["deepspeed", "megatron", "hf"])
def test_a_remote_that_refuses_writes_fails_the_end_of_the_job_on_every_rank(
    tmp_path, s3, fault_proxy, nccl_like, adapter
):
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
    tmp_path, nccl_like, adapter
):
    """A user's own directory sits where a save goes (rank 0's node sees it). Every rank raises
    SaveFailedError at the same call, naming the cause and what to do; the directory is left
    untouched; once it is moved away, the next saves work on every rank and the tracker moves
    on. (DeepSpeed's case, an existing tag, is test_deepspeed's
    test_existing_tag_fails_on_every_rank_at_one_call_and_the_next_save_works.)"""
    if adapter == "megatron":
        torchrun(
            "mcore.py",
            2,
            "--out",
            str(tmp_path),
            "--phase",
            "facade",
            "--iters",
            "12",
            "--foreign-at",
            "8",
            env=nccl_like.env,
            timeout=240,
        )
        seen = [read_json(tmp_path / f"failed-{r}.json") for r in (0, 1)]
        assert [s["iteration"] for s in seen] == [8, 8]  # the same call on both ranks
        ckpt = tmp_path / "ckpt"
        assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == [
            "iter_0000004",
            "iter_0000012",
        ]
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "12"
        moved, step = tmp_path / "moved", "iter_0000008"
    else:
        torchrun(
            "hf_resume.py",
            2,
            "--out",
            str(tmp_path),
            "--phase",
            "foreign",
            env={**DS_ENV, **nccl_like.env},
            timeout=240,
        )
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


def test_a_fresh_node_restores_from_the_remote_alone_through_the_manager(
    tmp_path, s3, shm, nccl_like
):
    """CheckpointManager's side of the restore bullet (the shims': test_deepspeed's, test_hf's
    and test_megatron's fresh-node tests). A job saves to memory, disk and S3, and ends; the
    node is replaced (no memory, no disk); the restarted job restores the newest step on S3 on
    both ranks and finishes in the state of the first job, bit-exact."""
    url = s3.url()

    def job(out: str) -> list[dict]:
        torchrun(
            "managed_train.py",
            2,
            "--memory",
            str(shm),
            "--disk",
            str(tmp_path / "disk"),
            "--remote",
            url,
            "--steps",
            "10",
            "--disk-every",
            "steps:5",
            "--remote-every",
            "steps:5",
            "--out",
            str(tmp_path / out),
            env={"TEST_S3_ENDPOINT": s3.endpoint, **nccl_like.env},
            timeout=240,
        )
        return [read_json(tmp_path / f"{out}.rank{r}.json") for r in (0, 1)]

    first = job("first.pt")
    assert [r["restored"] for r in first] == [None, None]
    shutil.rmtree(tmp_path / "disk")
    shutil.rmtree(shm)  # a replacement node: only S3 holds the run
    second = job("second.pt")
    assert [r["restored"] for r in second] == [5, 5]  # the newest step on S3
    a = torch.load(tmp_path / "first.pt", weights_only=True)
    b = torch.load(tmp_path / "second.pt", weights_only=True)
    assert mismatches(a, b) == []
    assert nccl_like.refused(processes=4) == []


@pytest.mark.parametrize("zero", [None, 2], ids=["hf", "hf-deepspeed"])
def test_a_crash_mid_save_leaves_nothing_to_resume_from_and_is_swept(tmp_path, zero, hf_full):
    """Process 0 is SIGKILLed while it writes checkpoint-4's data. Nothing under Trainer's names
    passes for a checkpoint: plain HF has no checkpoint-4 at all; under DeepSpeed, Trainer has
    already written its own files into checkpoint-4, which is marked pending. The restart sweeps
    what the crash left, resumes from checkpoint-2 (Trainer's own pick would be checkpoint-4)
    and ends bit-exact with the uninterrupted run. (The other entry points' crash tests:
    test_crash, test_deepspeed's kill test, test_megatron's sweep test.)"""
    zero_args = [] if zero is None else ["--zero", str(zero)]

    def run(phase: str, check: bool = True):
        return torchrun(
            "hf_resume.py",
            2,
            "--out",
            str(tmp_path),
            "--phase",
            phase,
            *zero_args,
            env=DS_ENV,
            timeout=240,
            check=check,
        )

    reference = hf_full(2, "async", zero)  # the uninterrupted run, as test_hf's
    assert run("kill", check=False).returncode != 0
    left = tmp_path / "run"
    if zero is None:
        assert sorted(n for n in os.listdir(left) if n.startswith("checkpoint-")) == [
            "checkpoint-2"
        ]
    else:
        assert (left / "checkpoint-4" / ".dcp-tiered-pending.json").is_file()
        assert not (left / "checkpoint-4" / "global_step4" / "manifest.json").exists()
    run("resume")
    resumed = read_json(tmp_path / "resume.json")
    assert resumed["step"] == 8 and resumed["left"] == ["checkpoint-6", "checkpoint-8"]
    leftovers = [
        p.name
        for p in left.rglob("*")
        if p.name.endswith((".dcp-tiered-tmp", ".dcp-tiered-pending.json", ".dcp-tiered-old"))
    ]
    assert leftovers == []  # swept
    full = torch.load(reference / "params-full.pt", weights_only=True)
    assert mismatches(full, torch.load(tmp_path / "params-resume.pt", weights_only=True)) == []


@pytest.mark.parametrize("adapter", ["deepspeed", "hf"])
def test_a_full_disk_fails_the_save_on_every_rank_with_what_to_do(tmp_path, tmpfs, adapter):
    """The save directory is a real 2 MiB tmpfs, too small for a checkpoint with the writer's
    free-space margin: every rank raises SaveFailedError at the same call (DeepSpeed: flush;
    HF: train), naming InsufficientSpaceError and saying to free space; nothing is left behind
    under the framework's names. (Megatron's case: test_megatron's disk-full test.)"""
    out = tmpfs(2)
    if adapter == "deepspeed":
        torchrun(
            "ds_roundtrip.py",
            2,
            "--out",
            str(out),
            "--stage",
            "1",
            "--mode",
            "async",
            "--phase",
            "record-end",
            env=DS_ENV,
            timeout=240,
        )
        ends = [read_json(out / f"end-{r}.json") for r in (0, 1)]
        names = os.listdir(out / "ckpt") if (out / "ckpt").exists() else []
        assert not [n for n in names if n.startswith("global_step")], names
    else:
        proc = torchrun(
            "hf_resume.py",
            2,
            "--out",
            str(out),
            "--phase",
            "stop",
            env=DS_ENV,
            timeout=240,
            check=False,
        )
        assert proc.returncode != 0
        ends = [read_json(out / f"stop-end-{r}.json") for r in (0, 1)]
        assert not list((out / "run").glob("checkpoint-*"))
    for rank, end in enumerate(ends):
        error = end["error"] or ""
        assert error.startswith("SaveFailedError") and "InsufficientSpaceError" in error, error
        assert "free space" in error, f"rank {rank}: {error}"
