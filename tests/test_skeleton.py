"""The tensors-plus-skeleton split the framework shims store their files with."""

from __future__ import annotations

import enum
import io
from collections import OrderedDict

import pytest
import torch

from dcp_tiered import IntegrityError
from dcp_tiered.shims import skeleton


class Stage(enum.IntEnum):
    TWO = 2


class Scaler:
    def __init__(self) -> None:
        self.scale = 4.0


def test_split_and_join_keep_structure_types_and_tensors():
    state = OrderedDict(
        [(0, {"exp_avg": torch.arange(5.0), "step": torch.tensor(3)}), (1, {"exp_avg": None})]
    )
    original = {
        "state": state,
        "groups": [(1, torch.ones(2, dtype=torch.bfloat16))],
        "n": 7,
        "stage": Stage.TWO,
        "scaler": Scaler(),
    }
    parts = skeleton.split(original)
    assert isinstance(parts["skeleton"], bytes)
    assert sorted(k for k in parts if k != "skeleton") == ["t0", "t1", "t2"]
    back = skeleton.join(dict(parts), where="test", trusted=[Stage, Scaler])
    assert type(back["state"]) is OrderedDict and list(back["state"]) == [0, 1]  # int keys
    assert torch.equal(back["state"][0]["exp_avg"], torch.arange(5.0))
    assert back["groups"][0][1].dtype == torch.bfloat16 and isinstance(back["groups"][0], tuple)
    assert back["stage"] is Stage.TWO and back["scaler"].scale == 4.0 and back["n"] == 7


def test_untrusted_class_is_refused_without_running_anything(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (marker.write_text, ("pwned",))

    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    with pytest.raises(IntegrityError, match="trusted"):
        skeleton.join({"skeleton": buf.getvalue()}, where="step-1/file.pt")
    assert not marker.exists()


def test_missing_tensor_is_an_integrity_error():
    parts = skeleton.split({"a": torch.zeros(2)})
    del parts["t0"]
    with pytest.raises(IntegrityError, match="tensor 0"):
        skeleton.join(parts, where="f.pt")
