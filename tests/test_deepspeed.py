"""DeepSpeed through dcp_tiered's checkpoint engine: real DeepSpeed 0.19, 2 CPU ranks, gloo.

The default suite runs a smoke subset that still covers every stage, both dtypes and all three
modes once; ``-m slow`` runs the whole matrix (about 25 s per config on 2 cores).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_example, torchrun

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.multirank, pytest.mark.framework]

ENV = {"DS_ACCELERATOR": "cpu"}
SMOKE = [(0, False, "async"), (1, True, "decoupled"), (2, False, "sync"), (3, True, "async")]
FULL = [
    c
    for c in itertools.product(range(4), (False, True), ("sync", "async", "decoupled"))
    if c not in SMOKE
]


def roundtrip(tmp_path: Path, stage: int, bf16: bool, mode: str) -> list[dict]:
    args = ["--out", str(tmp_path), "--stage", str(stage), "--mode", mode]
    torchrun("ds_roundtrip.py", 2, *args, *(["--bf16"] if bf16 else []), timeout=240, env=ENV)
    return [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]


def check(results: list[dict], stage: int) -> None:
    for rank, r in enumerate(results):
        assert r["engine"] == "TieredCheckpointEngine"
        assert r["diffs"] == [], f"rank {rank}: state after load differs at {r['diffs']}"
        assert r["resumed"] == r["live"], f"rank {rank}: losses after resume differ"
        assert r["latest"] == "global_step3"
        assert r["client"] == {"note": "hi", "n": 3}
    files = results[0]["files"]
    assert "manifest.json" in files and ".metadata" in files
    stub = (
        "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    )
    assert stub in files  # DeepSpeed's loader globs for it
    if stage:
        assert any(f.endswith("optim_states.pt") for f in files)


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    """``round_trips(stage, bf16, mode)``: the directory of that round trip (ckpt/ and what each
    rank recorded), run once in this module: test_round_trip_is_bit_exact checks it, and
    DeepSpeed's tools read the tiered checkpoint it left. Tests only read it."""
    done: dict[tuple, Path] = {}

    def get(stage: int, bf16: bool, mode: str) -> Path:
        if (stage, bf16, mode) not in done:
            out = tmp_path_factory.mktemp(f"ds-{stage}-{bf16}-{mode}")
            roundtrip(out, stage, bf16, mode)
            done[stage, bf16, mode] = out
        return done[stage, bf16, mode]

    return get


@pytest.mark.parametrize("stage,bf16,mode", SMOKE)
def test_round_trip_is_bit_exact(round_trips, stage, bf16, mode):
    # ZeRO-3 + async is also the deadlock regression: DCP's collectives run on their own gloo
    # group while ZeRO-3 all-gathers parameters on the training group (the timeout bounds it).
    out = round_trips(stage, bf16, mode)
    check([json.loads((out / f"result-{r}.json").read_text()) for r in range(2)], stage)


@pytest.mark.slow
@pytest.mark.parametrize("stage,bf16,mode", FULL)
def test_round_trip_full_matrix(tmp_path, stage, bf16, mode):
    check(roundtrip(tmp_path, stage, bf16, mode), stage)


def test_kill_during_async_save_leaves_latest_on_the_previous_tag(tmp_path):
    args = ["--out", str(tmp_path), "--stage", "2", "--mode", "async"]
    proc = torchrun(
        "ds_roundtrip.py", 2, *args, "--phase", "kill", timeout=240, env=ENV, check=False
    )
    assert proc.returncode != 0
    save_dir = tmp_path / "ckpt"
    assert (save_dir / "latest").read_text() == "global_step3"
    assert "global_step5" not in os.listdir(save_dir)  # nothing partial is visible
    torchrun("ds_roundtrip.py", 2, *args, "--phase", "resume", timeout=240, env=ENV)
    for rank in range(2):
        resumed = json.loads((tmp_path / f"resume-{rank}.json").read_text())
        live = json.loads((tmp_path / f"live-{rank}.json").read_text())
        assert resumed["tag"] == "global_step3" and resumed["resumed"] == live["live"]


def test_example_trains_saves_and_resumes(tmp_path):
    def run(steps: int) -> str:
        return run_example(
            "deepspeed_train.py",
            "--save-dir",
            str(tmp_path / "run"),
            "--steps",
            str(steps),
            ranks=2,
            timeout=240,
            env=ENV,
        )

    first = run(10)
    assert "latest = global_step10" in first and "step 0 loss" in first
    second = run(15)  # resumes at step 10 from the published checkpoint
    assert "step 10 loss" in second and "step 9 loss" not in second
    assert "latest = global_step15" in second


# ------------------------------------------------------------------ converter and DeepSpeed's tools


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "dcp_tiered.cli", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env={**os.environ, **ENV},
        check=False,
    )
    assert not check or proc.returncode == 0, proc.stderr[-4000:]
    return proc


def load_converted(tmp_path: Path, root: Path, native: Path, nproc: int, live: bool) -> dict:
    out = tmp_path / f"converted-{nproc}.json"
    torchrun(
        "ds_converted.py",
        nproc,
        "--root",
        str(root),
        "--step",
        "global_step3",
        "--native",
        str(native),
        "--out",
        str(out),
        *(["--live", str(tmp_path / "live.pt")] if live else []),
        env=ENV,
    )
    return json.loads(out.read_text())


def check_converted(result: dict) -> None:
    assert result["params_vs_zero_to_fp32"] == []  # bit for bit, buffers included
    assert result["adam_vs_live"] == []
    assert result["adam_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert result["steps"] == [3.0]
    assert result["groups"] == [
        "emb.weight",
        "l1.weight",
        "l1.bias",
        "norm.weight",
        "norm.bias",
        "l2.weight",
        "l2.bias",
    ]


def convert_native(tmp_path: Path, stage: int, bf16: bool) -> None:
    torchrun(
        "ds_roundtrip.py",
        2,
        "--out",
        str(tmp_path),
        "--stage",
        str(stage),
        "--phase",
        "native",
        *(["--bf16"] if bf16 else []),
        timeout=240,
        env=ENV,
    )
    cli("convert", "deepspeed", str(tmp_path / "ckpt"), str(tmp_path / "dcp"))
    for nproc in (1, 2):  # plain PyTorch, then FSDP2
        check_converted(load_converted(tmp_path, tmp_path / "dcp", tmp_path / "ckpt", nproc, True))


def test_converter_equals_zero_to_fp32_and_loads_at_any_world_size(tmp_path):
    convert_native(tmp_path, 3, True)


@pytest.mark.slow
@pytest.mark.parametrize("stage,bf16", [(1, False), (2, True), (3, False)])
def test_converter_full_matrix(tmp_path, stage, bf16):
    convert_native(tmp_path, stage, bf16)


def test_deepspeed_tools_on_a_tiered_checkpoint(tmp_path, round_trips):
    ckpt = round_trips(2, False, "sync") / "ckpt"  # a SMOKE round trip's checkpoint
    z2f = subprocess.run(
        [sys.executable, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(tmp_path / "fp32")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **ENV},
        check=False,
    )
    assert z2f.returncode != 0
    assert f"dcp-tiered convert deepspeed {ckpt / 'global_step3'} OUT" in z2f.stderr
    assert "--native" in z2f.stderr
    # --native gives DeepSpeed's own files back; the DCP conversion equals zero_to_fp32 of them.
    cli("convert", "deepspeed", str(ckpt), str(tmp_path / "native"), "--native")
    assert (tmp_path / "native" / "latest").read_text() == "global_step3"
    cli("convert", "deepspeed", str(ckpt), str(tmp_path / "dcp"))
    result = load_converted(tmp_path, tmp_path / "dcp", tmp_path / "native", 1, False)
    assert result["params_vs_zero_to_fp32"] == [] and result["steps"] == [3.0]
    again = cli("convert", "deepspeed", str(ckpt), str(tmp_path / "dcp"), check=False)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_converter_refuses_to_unpickle_code(tmp_path):
    import torch

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    tag = tmp_path / "ckpt" / "global_step1"
    tag.mkdir(parents=True)
    torch.save({"module": {}, "x": Payload()}, tag / "mp_rank_00_model_states.pt")
    torch.save({}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    proc = cli("convert", "deepspeed", str(tag), str(tmp_path / "dcp"), check=False)
    assert proc.returncode == 2
    assert "mp_rank_00_model_states.pt" in proc.stderr and "--trust-source" in proc.stderr
    assert not marker.exists()
    assert not (tmp_path / "dcp").exists() or not os.listdir(tmp_path / "dcp")


# ------------------------------------------------------------------ lifecycle (issue 15)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_existing_tag_fails_on_every_rank_at_one_call_and_the_next_save_works(tmp_path, mode):
    """Saving a tag that exists (stock DeepSpeed overwrites, e.g. tag='last') raises
    SaveFailedError on every rank at the same call, naming the overwrite option; nothing stale
    is left, so the following saves work on every rank (this used to deadlock in async mode)."""
    torchrun(
        "ds_roundtrip.py",
        2,
        "--out",
        str(tmp_path),
        "--stage",
        "1",
        "--mode",
        mode,
        "--phase",
        "existing-tag",
        timeout=240,
        env=ENV,
    )
    results = [json.loads((tmp_path / f"existing-tag-{r}.json").read_text()) for r in range(2)]
    failing = 1 if mode == "sync" else 2  # async: raised by the next save, which waits for it
    for r in results:
        assert [c[1] for c in r["calls"]] == [
            "SaveFailedError" if i == failing else None for i in range(4)
        ], r["calls"]
        message = r["calls"][failing][2]
        assert (
            "'last'" in message
            and "overwrite=True" in message
            and "CheckpointExistsError" in message
        )
        assert r["flush"] is None and r["latest"] == "global_step3"
    steps = sorted(n for n in os.listdir(tmp_path / "ckpt") if (tmp_path / "ckpt" / n).is_dir())
    # async: the call that raised (global_step2's) reported the earlier failure and saved nothing
    assert steps == (["global_step2"] if mode == "sync" else []) + ["global_step3", "last"]
    assert (
        cli("verify", str(tmp_path / "ckpt"), "last").returncode == 0
    )  # the first 'last' is whole


def test_fresh_node_restores_from_s3_through_deepspeeds_own_load_checkpoint(
    tmp_path, s3, nccl_like
):
    """flush() leaves the last step durable on S3; with the local directory gone, DeepSpeed's
    own engine.load_checkpoint(dir) restores it bit-exact and training resumes identically.
    Beside a default group that refuses our collectives (as an NCCL-only one would)."""
    url = s3.url()
    args = [
        "--out",
        str(tmp_path),
        "--stage",
        "2",
        "--mode",
        "async",
        "--remote",
        url,
        "--storage-options",
        json.dumps(s3.options()),
    ]
    env = {**ENV, **nccl_like.env}
    torchrun("ds_roundtrip.py", 2, *args, "--phase", "remote-save", timeout=240, env=env)
    import shutil

    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.options())
    assert fs.exists(f"{url}/global_step3/_COMMITTED.json")  # durable when flush returned
    shutil.rmtree(tmp_path / "ckpt")  # the node is gone
    torchrun("ds_roundtrip.py", 2, *args, "--phase", "remote-restore", timeout=240, env=env)
    for rank in range(2):
        restored = json.loads((tmp_path / f"restored-{rank}.json").read_text())
        live = json.loads((tmp_path / f"live-{rank}.json").read_text())
        assert os.path.basename(os.path.dirname(restored["path"])) == "global_step3"
        assert restored["diffs"] == [], restored["diffs"]
        assert restored["resumed"] == live["live"]
        assert restored["client"] == "hi"
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step3"
    assert nccl_like.refused(processes=4) == []
