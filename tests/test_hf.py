"""HF Trainer through dcp_tiered.shims.hf: real transformers + accelerate, 1 process and 2-process
DDP (gloo). A tiny GPT-2 with dropout trains 8 steps, saving every 2 with save_total_limit 2."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import read_json, run_example, run_hf

pytestmark = pytest.mark.framework

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def run(
    tmp_path: Path, nproc: int, phase: str, *args: str, env: dict | None = None, fails: bool = False
) -> dict:
    """Runs the worker; returns what rank 0 recorded (with ``fails``: what train() raised)."""
    proc = run_hf(tmp_path, nproc, phase, *args, env=env, check=False)
    assert (proc.returncode != 0) == fails, proc.stderr[-4000:]
    return json.loads((tmp_path / f"{phase}{'-end-0' if fails else ''}.json").read_text())


def full(hf_full, tmp_path: Path, nproc: int, mode: str = "async", zero: int | None = None) -> dict:
    """The uninterrupted run with these settings (the session's ``hf_full``): its params go to
    ``tmp_path`` as this test's own; returns what rank 0 recorded."""
    ref = hf_full(nproc, mode, zero)
    shutil.copy(ref / "params-full.pt", tmp_path / "params-full.pt")
    return read_json(ref / "full.json")


def same_params(tmp_path: Path, a: str, b: str) -> list[str]:
    x = torch.load(tmp_path / f"params-{a}.pt", weights_only=True)
    y = torch.load(tmp_path / f"params-{b}.pt", weights_only=True)
    assert set(x) == set(y)
    return [k for k in x if not torch.equal(x[k], y[k])]


@pytest.mark.parametrize("nproc,mode", [(1, "async"), (2, "async"), (1, "sync")])
def test_resume_from_step_4_of_8_is_bit_identical(tmp_path, nproc, mode, nccl_like, hf_full):
    done = full(hf_full, tmp_path, nproc, mode)
    assert done["left"] == ["checkpoint-6", "checkpoint-8"]  # save_total_limit=2
    assert {"manifest.json", ".metadata", "trainer_state.json"} <= set(done["files"])
    stopped = run(tmp_path, nproc, "stop", "--mode", mode)
    assert stopped["step"] == 4 and stopped["left"] == ["checkpoint-2", "checkpoint-4"]
    assert same_params(tmp_path, "full", "stop")  # really stopped early
    # Beside a default group that refuses our collectives, as an NCCL-only one would.
    resumed = run(tmp_path, nproc, "resume", "--mode", mode, env=nccl_like.env)
    assert nccl_like.refused(processes=nproc) == []
    assert resumed["step"] == 8
    assert same_params(tmp_path, "full", "resume") == []


def test_under_deepspeed_a_fresh_node_resumes_from_s3_alone(tmp_path, s3, hf_full):
    """HF + DeepSpeed: Trainer's own layout, the DeepSpeed step committed by dcp_tiered inside
    it, Trainer's files (trainer_state.json, each rank's RNG state) carried inside the step.
    train() returns once the steps are durable on S3; with the output directory gone (a fresh
    node), resume_from_checkpoint=True rebuilds checkpoint-4 from S3 and resumes bit-exact,
    passing over a directory a crashed save left."""
    pytest.importorskip("deepspeed")
    remote = ["--remote", s3.url(), "--storage-options", json.dumps(s3.options())]
    done = full(hf_full, tmp_path, 2, zero=2)
    assert done["left"] == ["checkpoint-6", "checkpoint-8"]  # save_total_limit=2, ours
    stopped = run(tmp_path, 2, "stop", "--zero", "2", *remote)
    assert {
        "trainer_state.json",
        "latest",
        "global_step4",
        "rng_state_0.pth",
        "rng_state_1.pth",
    } <= set(stopped["files"])
    step = tmp_path / "run" / "checkpoint-4" / "global_step4"
    assert {"manifest.json", "mp_rank_00_model_states.pt"} <= set(os.listdir(step))
    shutil.rmtree(tmp_path / "run")  # the node is gone; only S3 holds the run
    # ...and the new node crashed once mid-save: Trainer's files of checkpoint-6 are there, its
    # step is not. Trainer's own pick would be checkpoint-6; the newest committed step is 4.
    (tmp_path / "run" / "checkpoint-6").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint-6" / "trainer_state.json").write_text('{"global_step": 6}')
    resumed = run(tmp_path, 2, "resume", "--zero", "2", *remote)
    assert resumed["step"] == 8
    assert same_params(tmp_path, "full", "resume") == []


@pytest.mark.parametrize("nproc,zero", [(1, []), (2, ["--zero", "2"])], ids=["hf", "hf-deepspeed"])
def test_rotation_never_deletes_a_step_that_is_not_durable(tmp_path, nproc, zero):
    if zero:
        pytest.importorskip("deepspeed")
    (tmp_path / "not-a-dir").write_text("uploads under this path fail")
    end = run(
        tmp_path,
        nproc,
        "full",
        "--remote",
        f"file://{tmp_path}/not-a-dir/remote",
        "--fast-retry",  # the uploads fail either way; not after a minute of backing off
        *zero,
        fails=True,
    )
    # The end of train() says the steps are not durable, instead of returning as if they were.
    assert end["error"].startswith("SaveFailedError") and "not durable" in end["error"]
    # save_total_limit=2, but no step reached the remote tier: all four are the only copies.
    left = sorted(p.name for p in (tmp_path / "run-full").glob("checkpoint-*"))
    assert left == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]


def test_resume_on_a_fresh_node_from_s3(tmp_path, s3, hf_full):
    remote = ["--remote", s3.url(), "--storage-options", json.dumps(s3.options())]
    full(hf_full, tmp_path, 1)
    run(tmp_path, 1, "stop", *remote)  # waits until its steps are durable on S3
    shutil.rmtree(tmp_path / "run")  # the node is gone; only S3 holds the run
    resumed = run(tmp_path, 1, "resume", *remote)
    assert resumed["step"] == 8
    assert same_params(tmp_path, "full", "resume") == []


def test_example_trains_and_resumes(tmp_path):
    def example(steps: int) -> str:
        return run_example(
            "hf_trainer.py",
            "--output-dir",
            str(tmp_path / "out"),
            "--max-steps",
            str(steps),
            timeout=240,
        )

    assert "resumed from: none" in example(6)
    assert "resumed from: checkpoint-6" in example(10)
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == [
        "checkpoint-10",
        "checkpoint-8",
    ]
