"""torchtitan's checkpoint manager on the tiers: real torchtitan 0.3.0, FSDP2, 2 CPU ranks, gloo.

The worker (tests/workers/titan.py) drives the manager as torchtitan's Trainer does, selected
with torchtitan's own override mechanism. torchtitan's ``async_with_pinned_mem`` builds a
``DefaultStager`` that needs an accelerator (on this CPU-only machine it raises "Non-blocking
copy requires that the current accelerator is available"); the adapter stages through the
writer instead, so that mode runs here too.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import read_json, torchrun

pytest.importorskip("torchtitan.components.checkpointer")
pytestmark = [pytest.mark.framework]
MODES = ["disabled", "async", "async_with_pinned_mem"]


def titan(out: Path, *args: str, check: bool = True, env: dict | None = None):
    out.mkdir(parents=True, exist_ok=True)
    return torchrun(
        "titan.py",
        2,
        "--out",
        str(out),
        "--folder",
        str(out / "ckpt"),
        *args,
        timeout=300,
        check=check,
        env=env,
    )


def runs(out: Path, rank: int) -> list[list[dict]]:
    """Rank ``rank``'s records, one list per process (each begins with what it restored)."""
    found: list[list[dict]] = []
    for line in (out / f"log-{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "pid" in record:
            found.append([])
        found[-1].append(record)
    return found


def assert_resumed(before: list[dict], after: list[dict], step: int) -> None:
    """``after`` restored, bit for bit, the state ``before`` had after ``step``, from other
    initial weights, and went on exactly as ``before`` did (for the steps both trained)."""
    logged = {r["step"]: r for r in before if "step" in r}
    assert after[0]["start"] == step
    assert after[0]["initial"] != logged[step]["digest"]
    assert after[0]["digest"] == logged[step]["digest"]
    both = [r for r in after[1:] if r["step"] in logged]
    assert both and both[0]["step"] == step + 1
    assert [(r["step"], r["loss"], r["digest"]) for r in both] == [
        (r["step"], logged[r["step"]]["loss"], logged[r["step"]]["digest"]) for r in both
    ]


def step_dirs(path: Path) -> list[str]:
    return sorted((n for n in os.listdir(path) if n.startswith("step-")), key=lambda n: int(n[5:]))


@pytest.mark.multirank
@pytest.mark.parametrize("mode", [*MODES, "torchft-async"])
def test_each_async_mode_restores_from_the_remote_alone_bit_exact(tmp_path, mode, nccl_like):
    """Saves every 2 steps through 6 (keep_latest_k=2), then trains on unsaved to 8. The node
    is lost: a fresh one, with other initial weights, restores step-6 from the remote tier
    alone, bit for bit, and trains 7 and 8 exactly as the first job did. Beside a default group
    that refuses dcp_tiered's collectives, as an NCCL-only one would."""
    ft = mode.startswith("torchft-")
    args = [
        "--mode",
        mode.removeprefix("torchft-"),
        "--remote",
        f"file://{tmp_path / 'remote'}",
        "--save-until",
        "6",
        *(["--ft"] if ft else []),
    ]
    titan(tmp_path, *args, env=nccl_like.env)
    assert step_dirs(tmp_path / "ckpt") == ["step-4", "step-6"]  # retention: keep_latest_k
    assert step_dirs(tmp_path / "remote") == ["step-2", "step-4", "step-6"]  # keeps every one
    first = {r: runs(tmp_path, r)[0] for r in range(2)}
    shutil.rmtree(tmp_path / "ckpt")  # a fresh node: no local disk
    titan(tmp_path, *args, "--attempt", "1", env=nccl_like.env)
    assert nccl_like.refused(processes=4) == []
    for rank in range(2):
        assert_resumed(first[rank], runs(tmp_path, rank)[1], 6)
        assert [r["step"] for r in runs(tmp_path, rank)[1][1:]] == [7, 8]
    assert first[0][-1]["digest"] != first[1][-1]["digest"]  # FSDP2: each rank its own shards


@pytest.mark.multirank
def test_a_crash_in_an_async_save_resumes_from_the_step_before(tmp_path):
    """Rank 0 is SIGKILLed as it writes step-6 (async): the restart sweeps what the save left,
    restores step-4 bit for bit and trains on exactly. torchtitan's own search for a step
    would have matched the hidden directory the crash left (see the next test)."""
    killed = titan(tmp_path, "--mode", "async", "--kill-in-save", "6", check=False)
    assert killed.returncode != 0
    left = [n for n in os.listdir(tmp_path / "ckpt") if ".step-6." in n]
    assert left, os.listdir(tmp_path / "ckpt")  # the crashed save's hidden directory
    first = {r: runs(tmp_path, r)[0] for r in range(2)}
    titan(tmp_path, "--mode", "async", "--attempt", "1")
    for rank in range(2):
        resumed = runs(tmp_path, rank)[1]
        assert_resumed(first[rank], resumed, 4)
        assert [r["step"] for r in resumed[1:]] == [5, 6, 7, 8]
    assert not [n for n in os.listdir(tmp_path / "ckpt") if ".step-6." in n]
    assert step_dirs(tmp_path / "ckpt") == ["step-6", "step-8"]


def test_torchtitans_own_step_search_takes_a_hidden_directory_ours_does_not(tmp_path):
    """Why the adapter never uses CheckpointManager._find_load_step on its folder: a
    directory left by a commit that never finished, with its .metadata written, is step 9
    to torchtitan, and nothing to dcp_tiered."""
    from torchtitan.components.checkpointer import CheckpointManager

    from dcp_tiered.shims.torchtitan import TieredCheckpointMixin

    crashed = tmp_path / ".step-9.0123456789abcdef.tmp"
    crashed.mkdir()
    (crashed / ".metadata").write_bytes(b"not committed")
    stock = SimpleNamespace(folder=str(tmp_path))
    assert CheckpointManager._find_load_step(stock, str(tmp_path)) == 9
    ours = SimpleNamespace(
        root=str(tmp_path), tiers=SimpleNamespace(remote=None, storage_options=None)
    )
    assert TieredCheckpointMixin.committed(ours) == []


@pytest.mark.multirank
def test_close_raises_on_every_rank_when_a_step_cannot_become_durable(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("uploads fail: the remote root is under a regular file")
    remote = ["--remote", f"file://{blocker}/remote", "--fast-retry"]
    proc = titan(tmp_path / "run", "--mode", "async", "--steps", "6", *remote, check=False)
    assert proc.returncode != 0
    for rank in range(2):
        end = read_json(tmp_path / "run" / f"end-{rank}.json")["error"]
        assert end.startswith("SaveFailedError: torchtitan: not every step became durable"), end
    # Retention never deleted a step the remote does not hold.
    assert step_dirs(tmp_path / "run" / "ckpt") == ["step-2", "step-4", "step-6"]


@pytest.mark.multirank
def test_a_finished_jobs_model_only_last_step_is_not_resumed(tmp_path):
    """torchtitan's default last-step save holds the model only: a restart says the training
    finished (as a typed error on every rank) instead of resuming from it or from scratch."""
    titan(tmp_path, "--mode", "disabled", "--steps", "4", "--model-only-last")
    again = titan(tmp_path, "--mode", "disabled", "--steps", "4", "--model-only-last", check=False)
    assert again.returncode != 0
    out = again.stdout + again.stderr
    for rank in range(2):
        assert f"[rank{rank}]: dcp_tiered.errors.ConfigError: step-4 in" in out, out[-3000:]
    assert "model-only checkpoint torchtitan saves at the last step" in out
    assert len(runs(tmp_path, 0)) == 1  # the restart trained nothing


def test_the_override_entry_replaces_exactly_torchtitans_manager_config():
    from dataclasses import dataclass, field

    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.config import Configurable, OverrideConfig, apply_overrides

    from dcp_tiered.shims.torchtitan import TieredCheckpointManager, TierOptions

    @dataclass(kw_only=True, slots=True)
    class Job(Configurable.Config):
        checkpoint: CheckpointManager.Config = field(default_factory=CheckpointManager.Config)

    job = Job(checkpoint=CheckpointManager.Config(enable=True, interval=7, keep_latest_k=3))
    entry = ("dcp_tiered.shims.torchtitan.tiered_checkpoint", {"remote": "s3://b/run"})
    assert len(apply_overrides(OverrideConfig(imports=[entry]), job)) == 1
    assert type(job.checkpoint) is TieredCheckpointManager.Config
    assert (job.checkpoint.interval, job.checkpoint.keep_latest_k) == (7, 3)
    assert job.checkpoint.tiers == TierOptions(remote="s3://b/run")
    assert job.checkpoint._owner is TieredCheckpointManager  # what build() constructs


def test_what_the_adapter_cannot_serve_is_refused_with_a_typed_error(tmp_path):
    import torch

    from dcp_tiered.errors import ConfigError
    from dcp_tiered.shims.torchtitan import TieredCheckpointManager

    def build(**options):
        model = torch.nn.Linear(2, 2)
        return TieredCheckpointManager.Config(enable=True, keep_latest_k=0, **options).build(
            dataloader=None,
            model_parts=[model],
            optimizers=None,
            lr_schedulers=None,
            states={},
            sd_adapter=object(),
            base_folder="",
        )

    with pytest.raises(ConfigError, match="dcp-tiered export --format safetensors"):
        build(folder=str(tmp_path), last_save_in_hf=True)
    with pytest.raises(ConfigError, match="checkpoint.tiers.remote"):
        build(folder="s3://bucket/ckpt")
