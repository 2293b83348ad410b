"""A save of the same structure as the writer's last reuses its ``.metadata`` bytes, with only
the step's name written anew: every step stays a vanilla DCP checkpoint that names itself."""

from __future__ import annotations

import copy
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from dcp_tiered import TieredStorageWriter
from dcp_tiered.planner import TieredSavePlanner, planner_for
from dcp_tiered.writer import _describe


def _state(scale: float, extra: bool = False) -> dict:
    state = {
        "model": {f"layer{i}.weight": torch.full((16, 4), scale * i) for i in range(6)},
        "optim": {"step": torch.tensor(scale), "lr": 0.1},
    }
    if extra:
        state["model"]["head"] = torch.ones(3, 5) * scale
    return state


def _vanilla_load(root, step: str, like: dict) -> dict:
    target = {k: {n: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
                  for n, v in part.items()} for k, part in like.items()}  # fmt: skip
    dcp.load(target, storage_reader=FileSystemReader(root / step))
    return target


def test_same_structure_reuses_the_metadata_bytes_and_every_step_names_itself(
    tmp_path, monkeypatch
):
    pickled = []
    original = _describe._vanilla
    monkeypatch.setattr(
        _describe, "_vanilla", lambda *a: pickled.append(a[2].checkpoint_id) or original(*a)
    )
    steps = ["s-1", "step-2", "a-much-longer-step-name-3", "step-4"]
    with TieredStorageWriter(tmp_path) as writer:
        planner = planner_for(writer)
        for n, step in enumerate(steps, start=1):
            dcp.save(_state(float(n)), checkpoint_id=step, storage_writer=writer, planner=planner)
        assert len(pickled) == 1, pickled  # the first save's; the next three reused its bytes
        # another structure: pickled afresh, then reused again
        for step in ("grown-5", "grown-6"):
            dcp.save(_state(7.0, extra=True), checkpoint_id=step, storage_writer=writer,
                     planner=planner)  # fmt: skip
        assert len(pickled) == 2, pickled
    first = FileSystemReader(tmp_path / steps[0]).read_metadata()
    for n, step in enumerate(steps, start=1):
        md = FileSystemReader(tmp_path / step).read_metadata()
        assert md.storage_meta.checkpoint_id == step
        assert md.state_dict_metadata == first.state_dict_metadata
        assert md.storage_data == first.storage_data  # same places, other bytes
        loaded = _vanilla_load(tmp_path, step, _state(0.0))
        assert torch.equal(loaded["model"]["layer5.weight"], torch.full((16, 4), 5.0 * n))
        assert torch.equal(loaded["optim"]["step"], torch.tensor(float(n)))
        assert loaded["optim"]["lr"] == 0.1  # a value: saved by the coordinator alone
    grown = _vanilla_load(tmp_path, "grown-6", _state(0.0, extra=True))
    assert torch.equal(grown["model"]["head"], torch.ones(3, 5) * 7.0)
    assert FileSystemReader(tmp_path / "grown-6").read_metadata().storage_meta.checkpoint_id == (
        "grown-6"
    )


def test_the_step_name_is_the_only_difference_from_a_fresh_pickle(tmp_path):
    """The reused bytes unpickle to what a fresh pickle of the same save does."""
    with TieredStorageWriter(tmp_path) as writer:
        planner = planner_for(writer)
        for step in ("step-1", "step-22"):
            dcp.save(_state(1.0), checkpoint_id=step, storage_writer=writer, planner=planner)
    with TieredStorageWriter(tmp_path / "fresh") as writer:  # a writer that kept nothing
        dcp.save(_state(1.0), checkpoint_id="step-22", storage_writer=writer)
    reused = pickle.loads((tmp_path / "step-22" / ".metadata").read_bytes())
    fresh = pickle.loads((tmp_path / "fresh" / "step-22" / ".metadata").read_bytes())
    assert reused.storage_meta == fresh.storage_meta
    assert reused.state_dict_metadata == fresh.state_dict_metadata
    assert reused.storage_data == fresh.storage_data
    assert reused.planner_data == fresh.planner_data and reused.version == fresh.version


def test_the_metadata_dcp_save_returns_pickles_as_the_steps_metadata_file(tmp_path):
    """DCP pickles the global metadata once more at the end of every save (it broadcasts it,
    in a world of one too): it pickles as the step's ``.metadata`` bytes, not item by item,
    and unpickles as a plain ``Metadata``; copies are of its fields only. The file itself names
    nothing of ours, so vanilla DCP reads it without dcp_tiered."""
    with TieredStorageWriter(tmp_path) as writer:
        planner = planner_for(writer)
        for step in ("step-1", "step-2"):
            md = dcp.save(_state(1.0), checkpoint_id=step, storage_writer=writer, planner=planner)
            on_disk = (tmp_path / step / ".metadata").read_bytes()
            sent = pickle.dumps(md)
            assert on_disk in sent and len(sent) < len(on_disk) + 64  # the file's bytes, once
            assert b"dcp_tiered" not in on_disk
            back = pickle.loads(pickle.dumps(md))
            assert type(back) is Metadata and back.storage_meta.checkpoint_id == step
            assert (
                back.storage_data == FileSystemReader(tmp_path / step).read_metadata().storage_data
            )
        for made in (copy.copy(md), copy.deepcopy(md)):
            assert made.state_dict_metadata == md.state_dict_metadata
            fields = pickle.loads(pickle.dumps(made))  # field by field, as any Metadata
            assert type(fields) is Metadata and fields.storage_data is None
            assert fields.state_dict_metadata == md.state_dict_metadata


def test_another_writer_with_our_planner_gets_the_metadata_pickled_field_by_field(tmp_path):
    planner = TieredSavePlanner(enable_plan_caching=True, cache_key="vanilla-writer")
    for step in ("a", "b"):
        md = dcp.save(
            _state(2.0), storage_writer=FileSystemWriter(tmp_path / step), planner=planner
        )
        back = pickle.loads(pickle.dumps(md))
        assert type(back) is Metadata and back.state_dict_metadata == md.state_dict_metadata
        assert back.storage_data == md.storage_data  # what DCP's own writer set on it
