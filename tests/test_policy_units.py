"""Pure modules (layout, manifest) without any I/O or process."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_tiered import ConfigError, ManifestError
from dcp_tiered.policy import layout, manifest

names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,20}", fullmatch=True)


@given(names)
def test_valid_names_round_trip_through_tmp_dirs(name):
    if name == "latest":
        return
    assert layout.validate_step_name(name) == name
    parsed = layout.parse_hidden_dir(layout.tmp_dir_name(name, "abc123"))
    assert parsed == (name, "abc123", layout.TMP_SUFFIX)
    assert not layout.is_step_name(layout.tmp_dir_name(name, "abc123"))


escaping = st.builds(
    lambda a, sep, b: a + sep + b,
    st.text(max_size=10),
    st.sampled_from(["/", "..", "/../", "\x00"]),
    st.text(max_size=10),
)


@given(st.one_of(escaping, st.text(max_size=10).map(lambda s: "." + s)))
def test_names_that_could_escape_the_root_are_refused(name):
    with pytest.raises(ConfigError):
        layout.validate_step_name(name)


@given(
    st.lists(
        st.tuples(st.integers(0, 10**6), st.integers(0, 10**12)),
        min_size=1,
        unique_by=lambda t: t[0],
    )
)
def test_newest_is_highest_step_number(steps):
    named = [(f"step-{n}", t) for n, t in steps]
    assert layout.newest(named) == f"step-{max(n for n, _ in steps)}"


def _metadata(shapes: list[tuple[int, ...]]) -> tuple[Metadata, dict]:
    sdm, locs, offset = {}, {}, 0
    for i, shape in enumerate(shapes):
        fqn = f"layer{i}.weight"
        half = (shape[0] // 2,) + shape[1:]
        chunks = [
            ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(half)),
            ChunkStorageMetadata(
                torch.Size([half[0]] + [0] * (len(shape) - 1)),
                torch.Size((shape[0] - half[0],) + shape[1:]),
            ),
        ]
        sdm[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16), torch.Size(shape), chunks
        )
        for c in chunks:
            locs[MetadataIndex(fqn, c.offsets)] = manifest.ItemLocation(
                "__0_0.distcp", offset, 100, "deadbeef", 0, 10**6, "cafef00d"
            )
            offset += 100
    sdm["extra"] = BytesStorageMetadata()
    locs[MetadataIndex("extra")] = manifest.ItemLocation(
        "__0_0.distcp", offset, 7, "01234567", 0, 10**6, "cafef00d"
    )
    return Metadata(sdm, planner_data={"extra": ("extra",)}), locs


@settings(max_examples=30)
@given(st.lists(st.tuples(st.integers(2, 9), st.integers(1, 5)), min_size=1, max_size=5))
def test_manifest_round_trips_metadata(shapes):
    md, locs = _metadata(shapes)
    data = manifest.build(
        step="step-3",
        save_id="s",
        world_size=2,
        nodes=[[0, 1]],
        committed_at_ns=5,
        metadata=md,
        locations=locs,
        versions={"torch": "x"},
    )
    parsed = manifest.parse(data, where="m.json")
    assert parsed.metadata.state_dict_metadata == md.state_dict_metadata
    assert parsed.metadata.planner_data == md.planner_data
    assert dict(parsed.locations) == locs
    assert parsed.step == "step-3" and parsed.world_size == 2


@pytest.mark.parametrize(
    "field,value",
    [("dtype", "os.system"), ("size", [-1]), ("chunks", [{"offsets": ["x"], "sizes": [1]}])],
)
def test_manifest_rejects_unknown_types_even_with_valid_checksum(field, value):
    md, locs = _metadata([(4, 2)])
    body = json.loads(
        manifest.build(
            step="s",
            save_id="s",
            world_size=1,
            nodes=[[0]],
            committed_at_ns=0,
            metadata=md,
            locations=locs,
            versions={},
        )
    )
    body["state_dict_metadata"]["layer0.weight"][field] = value
    body.pop("manifest_checksum")
    body["manifest_checksum"] = manifest._self_checksum(body)  # a careful forger
    with pytest.raises(ManifestError):
        manifest.parse(json.dumps(body).encode(), where="m.json")


def test_remote_keys_keep_each_save_apart_and_refuse_hostile_markers():
    from dcp_tiered.policy.layout import RemoteKeys, keys_of_marker, save_id_of_key

    new = RemoteKeys("step-1", "0a1b2c3d4e5f", "hash")
    assert new.manifest == "step-1/0a1b2c3d4e5f/manifest.json"
    assert new.file("__0_0.distcp").startswith("data/") and "/step-1/0a1b2c3d4e5f/" in new.file(
        "__0_0.distcp"
    )
    assert save_id_of_key("step-1", new.file("__0_0.distcp")) == "0a1b2c3d4e5f"
    assert not new.owns("step-1/ffffffffffff/manifest.json") and not new.owns(
        "step-1/_COMMITTED.json"
    )
    old = keys_of_marker("step-1", {"save_id": "whatever", "prefix_strategy": "none"})
    assert old.save_id is None and old.manifest == "step-1/manifest.json"
    assert old.owns("step-1/__0_0.distcp") and old.owns("step-1/_nodes/node-0.json")
    assert not old.owns("step-1/0a1b2c3d4e5f/__0_0.distcp") and not old.owns(
        "step-1/_COMMITTED.json"
    )
    for bad in (
        {"layout": 2, "save_id": "../../etc"},
        {"layout": 2, "save_id": "ABC"},
        {"layout": 3, "save_id": "abc"},
        {"layout": 2, "save_id": "abc", "prefix_strategy": "weird"},
    ):
        with pytest.raises(ValueError):
            keys_of_marker("step-1", bad)
