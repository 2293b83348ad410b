"""SIGKILL one rank or all of them at chosen and random moments of an async save.

After every kill: 'latest' is the previous committed step (or the new one, if the kill came
after its rename) and loads bit-exact, no partial step is visible, and the next save succeeds.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import TieredStorageReader, TieredStorageWriter
from tests._model import AppState, build, full_state, make_opt, mismatches
from tests.conftest import torchrun, visible

pytestmark = pytest.mark.multirank

# Every kill point once in the default suite, the victims (rank 0, the coordinator; rank 1; every
# rank) spread over them; `scripts/test -m slow -k test_crash` adds the other victims.
BEFORE_COMMIT = [
    ("stage", "1"),
    pytest.param("stage", "0", marks=pytest.mark.slow),
    pytest.param("stage", "all", marks=pytest.mark.slow),
    ("local-plan", "all"),
    pytest.param("local-plan", "1", marks=pytest.mark.slow),
    ("global-plan", "0"),
    ("write-first-byte", "0"),
    pytest.param("write-first-byte", "1", marks=pytest.mark.slow),
    pytest.param("write-first-byte", "all", marks=pytest.mark.slow),
    ("write-middle", "all"),
    pytest.param("write-middle", "0", marks=pytest.mark.slow),
    pytest.param("write-middle", "1", marks=pytest.mark.slow),
    ("fsync-data", "1"),
    pytest.param("fsync-data", "0", marks=pytest.mark.slow),
    ("after-write-data", "all"),
    pytest.param("after-write-data", "1", marks=pytest.mark.slow),
    ("before-manifest", "0"),
    ("between-manifest-and-metadata", "0"),
    ("before-rename", "0"),
]
AFTER_COMMIT = [("after-rename", "0")]
# Random moments: two in the default suite; the soak below runs 300.
RANDOM_SEEDS = [1, 2, *(pytest.param(seed, marks=pytest.mark.slow) for seed in (3, 4))]


def _load_latest(root) -> tuple[str, dict]:
    model = build(seed=5)
    opt = make_opt(model)
    from tests._model import train_step

    train_step(model, opt, 42)
    reader = TieredStorageReader(root)
    dcp.load({"app": AppState(model, opt)}, storage_reader=reader, no_dist=True)
    return reader.checkpoint_id, full_state(model, opt)


def _crash_and_check(tmp_path, point: str, victim: str, seed: int = 0) -> str:
    root, refdir = tmp_path / "ckpt", tmp_path
    proc = torchrun(
        "crash.py",
        2,
        "--root",
        str(root),
        "--refdir",
        str(refdir),
        "--point",
        point,
        "--victim",
        victim,
        "--seed",
        str(seed),
        check=False,
        timeout=180,
    )
    steps = sorted(n for n in os.listdir(root) if not n.startswith("."))
    assert steps in (["step-1"], ["step-1", "step-2"]), (steps, proc.stderr[-3000:])
    latest, got = _load_latest(root)
    assert latest == steps[-1]
    ref = torch.load(refdir / f"{latest}.pt", weights_only=True)
    assert mismatches(ref, got) == [], f"{latest} does not load bit-exact"
    # The next save succeeds, and a restarted writer leaves no temporary directory behind.
    model = build(seed=1)
    app = AppState(model, make_opt(model))
    writer = TieredStorageWriter(root)
    writer.recover()  # the explicit recovery step (the first save runs it too)
    assert [n for n in visible(root) if n.startswith(".")] == []
    dcp.save({"app": app}, checkpoint_id="step-3", storage_writer=writer, no_dist=True)
    step3, got3 = _load_latest(root)
    assert step3 == "step-3" and mismatches(full_state(model, app.opt), got3) == []
    return latest


@pytest.mark.parametrize("point,victim", BEFORE_COMMIT)
def test_kill_before_commit_keeps_previous_step(tmp_path, point, victim):
    assert _crash_and_check(tmp_path, point, victim) == "step-1"


@pytest.mark.parametrize("point,victim", AFTER_COMMIT)
def test_kill_after_rename_leaves_complete_new_step(tmp_path, point, victim):
    assert _crash_and_check(tmp_path, point, victim) == "step-2"


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_kill_all_ranks_at_random_moment(tmp_path, seed):
    _crash_and_check(tmp_path, "random", "all", seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 400))
def test_soak_random_kills(tmp_path, seed):
    """Soak: `scripts/test -m slow -k soak` runs 300 random kills."""
    _crash_and_check(tmp_path, "random", "all" if seed % 3 else str(seed % 2), seed)
