"""The trust option of every entry point: a state that saves must restore, or be refused when
it is saved (``allow_pickle=False``, the default); with ``allow_pickle=True`` it saves and
restores. The manager's own test is in test_manager.py; these are the shims', in one process
where the shim allows it (the protocol each framework calls, driven directly)."""

from __future__ import annotations

import os
from collections import namedtuple

import pytest
import torch

from dcp_tiered import ConfigError, IntegrityError
from dcp_tiered.lifecycle import Conventions, Lifecycle


class Position:
    """A class of the test's own: torch's weights_only loading refuses it (io.BytesIO would not
    do: megatron-core allowlists it for the whole process when imported)."""

    def __init__(self, text: bytes) -> None:
        self.text = text


Point = namedtuple("Point", "x y")  # a class weights_only refuses (a leaf, not a tuple)

TRUST_HINT = "allow_pickle=True only for checkpoints you trust"


def test_lifecycle_refuses_before_writing_and_the_next_save_works(tmp_path):
    """The one place every shim's save goes through: nothing is written, the path and the
    type are named, and the next save works."""
    life = Lifecycle(Conventions("Test"))
    try:
        with pytest.raises(ConfigError, match=r"'opt.sched.obj' \(Position\)") as e:
            life.save(
                str(tmp_path),
                "step-1",
                {"w": torch.ones(2), "opt": {"sched": {"obj": Position(b"x")}}},
                sync=True,
            )
        assert TRUST_HINT in str(e.value) and "step-1" in str(e.value)
        assert not any(tmp_path.iterdir())  # nothing written, not even a temporary directory
        life.save(str(tmp_path), "step-2", {"w": torch.ones(2)}, sync=True)
        assert (tmp_path / "step-2" / "manifest.json").is_file()
        # A namedtuple's own class must load too: it is checked as one value. A value that
        # cannot be pickled at all is an answer too (never an exception on one rank alone).
        with pytest.raises(ConfigError, match=r"'p' \(Point\)"):
            life.save(str(tmp_path), "step-3", {"p": Point(1, 2)}, sync=True)
        with pytest.raises(ConfigError, match=r"'f' \(function\).*cannot be pickled"):
            life.save(str(tmp_path), "step-3", {"f": lambda: 1}, sync=True)
    finally:
        life.close()
    trusted = Lifecycle(Conventions("Test"), allow_pickle=True)
    try:
        trusted.save(str(tmp_path), "step-4", {"obj": Position(b"y")}, sync=True)
        assert (tmp_path / "step-4" / "manifest.json").is_file()
    finally:
        trusted.close()


# ------------------------------------------------------------------ DeepSpeed's engine


@pytest.fixture
def ds_shim(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from dcp_tiered.shims import deepspeed as ds_shim

    return ds_shim


def _ds_save(ds_shim, engine, save_dir, tag, state) -> str:
    """One checkpoint through DeepSpeed's checkpoint-engine protocol, as its engine calls it."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    info = CheckpointCommitInfo(tag=tag, save_dir=str(save_dir), save_latest=True)
    engine.create(info)
    path = os.path.join(str(save_dir), tag, "mp_rank_00_model_states.pt")
    engine.makedirs(os.path.dirname(path), exist_ok=True)
    engine.save(state, path)
    engine.commit(info)
    engine.wait()
    return path


def test_deepspeed_engine_refuses_an_unrestorable_state_unless_trusted(tmp_path, ds_shim):
    state = {"module": {"w": torch.arange(4.0)}, "client": {"pos": Position(b"batch 17")}}
    engine = ds_shim.TieredCheckpointEngine(ds_shim.Options(mode="sync"))
    try:
        with pytest.raises(ConfigError) as e:
            _ds_save(ds_shim, engine, tmp_path, "global_step1", state)
        msg = str(e.value)
        assert "mp_rank_00_model_states.pt.client.pos" in msg and "(Position)" in msg
        assert TRUST_HINT in msg and "DeepSpeed" in msg
        assert not (tmp_path / "global_step1").exists() and not (tmp_path / "latest").exists()
        # The engine goes on: the next save of a plain state works and loads back.
        path = _ds_save(
            ds_shim,
            engine,
            tmp_path,
            "global_step2",
            {"module": {"w": torch.arange(4.0)}, "client": {"pos": 17}},
        )
        assert engine.load(path)["client"] == {"pos": 17}
    finally:
        engine.flush()

    trusted = ds_shim.TieredCheckpointEngine(ds_shim.Options(mode="sync", allow_pickle=True))
    try:
        path = _ds_save(ds_shim, trusted, tmp_path, "global_step3", state)
        back = trusted.load(path)
        assert back["client"]["pos"].text == b"batch 17"
        assert torch.equal(back["module"]["w"], torch.arange(4.0))
    finally:
        trusted.flush()
    # An engine that does not trust it still refuses to unpickle it.
    plain = ds_shim.TieredCheckpointEngine(ds_shim.Options(mode="sync"))
    try:
        with pytest.raises(IntegrityError, match=TRUST_HINT):
            plain.load(path)
    finally:
        plain.flush()
    # trusted_classes: the class allowed by name, weights_only loading kept.
    named = ds_shim.TieredCheckpointEngine(
        ds_shim.Options(mode="sync", trusted_classes=(Position,))
    )
    try:
        path = _ds_save(ds_shim, named, tmp_path, "global_step4", state)
        assert named.load(path)["client"]["pos"].text == b"batch 17"
    finally:
        named.flush()


def test_deepspeed_install_and_attach_take_the_option(ds_shim):
    import deepspeed.runtime.engine as ds_engine

    try:
        ds_shim.install(mode="sync", allow_pickle=True)
        factory = ds_engine.create_checkpoint_engine
        assert factory.args[0].allow_pickle is True
    finally:
        ds_shim.uninstall()


# ------------------------------------------------------------------ HF Trainer


def test_hf_wrap_refuses_an_unrestorable_scheduler_state_unless_trusted(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from dcp_tiered.shims.hf import wrap

    class Sched(torch.optim.lr_scheduler.LambdaLR):
        """A scheduler whose state holds a user's object."""

        def state_dict(self):
            return {**super().state_dict(), "pos": self.pos}

        def load_state_dict(self, state):
            self.pos = state.pop("pos")
            super().load_state_dict(state)

    def trainer(out, *, allow_pickle: bool, pos: bytes) -> Trainer:
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = Sched(opt, lambda _: 1.0)
        sched.pos = Position(pos)
        args = TrainingArguments(
            output_dir=str(out), report_to=[], use_cpu=True, save_strategy="no", max_steps=1
        )
        tr = Trainer(model=model, args=args, optimizers=(opt, sched))
        tr.create_optimizer_and_scheduler(num_training_steps=1)
        return wrap(tr, mode="sync", allow_pickle=allow_pickle)

    tr = trainer(tmp_path, allow_pickle=False, pos=b"p1")
    with pytest.raises(ConfigError, match=r"'scheduler.pos' \(Position\)") as e:
        tr._save_checkpoint(tr.model, None)
    assert TRUST_HINT in str(e.value) and "HF Trainer" in str(e.value)
    assert not tr.dcp_tiered.committed()
    tr.dcp_tiered.lifecycle.close()

    tr = trainer(tmp_path, allow_pickle=True, pos=b"p2")
    tr._save_checkpoint(tr.model, None)
    tr.dcp_tiered.lifecycle.close()
    assert tr.dcp_tiered.committed() == ["checkpoint-0"]
    back = trainer(tmp_path, allow_pickle=True, pos=b"")
    back.dcp_tiered.load_optimizer_and_scheduler(str(tmp_path / "checkpoint-0"))
    assert back.lr_scheduler.pos.text == b"p2"
    back.dcp_tiered.lifecycle.close()
