"""Pure modules (layout, manifest) without any I/O or process."""

from __future__ import annotations

import dataclasses
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
from dcp_tiered.policy import layout, manifest, manifest_build, manifest_entries, step_names
from tests import _manifests

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
    assert step_names.newest(named) == f"step-{max(n for n, _ in steps)}"


@given(st.integers(0, 10**9))
def test_step_names_parse_what_they_build(n):
    for names in step_names.KNOWN:
        assert names.parse(names.build(n)) == n
        assert step_names.order_number(names.build(n)) == n


def test_step_names_are_exact_grammars():
    assert step_names.MEGATRON.build(100) == "iter_0000100"
    assert step_names.HF.build(7) == "checkpoint-7"
    assert step_names.DEEPSPEED.build(7) == "global_step7"
    # Names that merely look like a framework's step are not its steps.
    for names, foreign in [
        (step_names.STEP, ["step-", "step-03", "step-3.bak", "step-+3", "step-٣", "Step-3"]),
        (step_names.MEGATRON, ["iter_100", "iter_00000100", "iter_abc0001"]),
        (step_names.HF, ["checkpoint-007", "checkpoint-7\n", "checkpoint-7-old"]),
        (step_names.DEEPSPEED, ["global_step", "global_step-7", "xglobal_step7"]),
    ]:
        assert [names.parse(n) for n in foreign] == [None] * len(foreign), names
    # Ordering keeps a user's own names in their trailing-number order, as before.
    assert step_names.order_number("epoch3-run20") == 20
    assert step_names.order_number("final") is None
    assert step_names.newest([("step-9", 5), ("final", 9), ("step-10", 1)]) == "step-10"


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


def _build(md, locs, **kw):
    args = dict(step="step-3", save_id="s", world_size=2, nodes=[[0, 1]], committed_at_ns=5)
    args.update(kw)
    return manifest_build.build(metadata=md, locations=locs, versions={"torch": "x"}, **args)


def _parse(built):
    m = manifest.parse(built.index, where="m.json")
    for node, data in built.sections.items():
        m = manifest.parse_section(m, node, data, where=f"node-{node}")
    return m


@settings(max_examples=30)
@given(st.lists(st.tuples(st.integers(2, 9), st.integers(1, 5)), min_size=1, max_size=5))
def test_manifest_round_trips_metadata(shapes):
    md, locs = _metadata(shapes)
    parsed = _parse(_build(md, locs))
    assert parsed.metadata.state_dict_metadata == md.state_dict_metadata
    assert parsed.metadata.planner_data == md.planner_data
    assert dict(parsed.locations) == locs
    assert parsed.step == "step-3" and parsed.world_size == 2 and parsed.complete


def test_a_repeated_structure_reuses_the_index_members_only_it_decides(monkeypatch):
    """The index's tensors, properties, paths and chunk writers are encoded once for the
    metadata objects DCP's plan caching hands every save of one structure; checksums and
    names are the save's own, and a chunk another rank wrote is encoded again (a stale list
    of writers would fail the sections' check when parsed)."""
    made = []
    real = manifest_build._fragment
    monkeypatch.setattr(manifest_build, "_fragment", lambda *a: made.append(1) or real(*a))
    md, locs = _metadata([(4, 3), (6, 2)])
    _parse(_build(md, locs))
    other = {k: dataclasses.replace(v, checksum="0badf00d") for k, v in locs.items()}
    again = _parse(_build(md, other, step="step-4"))
    assert len(made) == 1
    assert again.step == "step-4" and dict(again.locations) == other
    assert again.metadata.state_dict_metadata == md.state_dict_metadata
    second = MetadataIndex("layer1.weight", torch.Size([3, 0]))
    moved = dict(locs)
    moved[second] = dataclasses.replace(locs[second], relative_path="__1_0.distcp", rank=1)
    parsed = _parse(_build(md, moved))
    assert len(made) == 2 and dict(parsed.locations) == moved
    assert parsed.writers["layer1.weight"] == [0, 1]
    _parse(_build(md, locs))  # and back: encoded again, not the rank-1 one
    assert len(made) == 3


def test_whole_tensor_entries_decode_as_the_general_decoder_does():
    """The index's common entry (a tensor saved whole by one rank) has a shorter decoder; it
    gives what the general one gives, and hands every other entry (sharded, bytes, zero-size,
    booleans for integers, a rank out of range) to the general decoder, which decides."""
    shapes = [(), (7,), (3, 5), (2, 3, 4)]
    sdm = {}
    locs = {}
    for i, shape in enumerate(shapes):
        fqn = f"w{i}"
        chunk = ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))
        dtype = torch.float32 if i % 2 else torch.bfloat16
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), [chunk])
        locs[MetadataIndex(fqn, chunk.offsets)] = manifest.ItemLocation(
            "__1_0.distcp", 100 * i, 100, "deadbeef", 1, 10**6, "cafef00d"
        )
    md = Metadata(sdm)
    index = _build(md, locs).index
    body = _manifests.as_version_2(json.loads(index))  # an entry per tensor
    props = [manifest.decode_properties(p) for p in body["properties"]]
    for fqn, entry, ranks in body["tensors"]:
        whole = manifest_entries.whole_tensor(entry, ranks, props, 2)
        assert whole is not None, entry
        assert whole == (manifest_entries.decode_entry(entry, fqn, props, 10), [1])
    assert _parse(_build(md, locs)).metadata.state_dict_metadata == sdm
    one = {"type": "tensor", "props": 0, "size": [4], "grid": [[[4, 1]]]}
    odd = [
        (one, [[1, 0, 2]]),  # two chunks' writers
        (one, [[True, 0, 1]]),
        (one, [[0, False, 1]]),
        (one, [[2, 0, 1]]),  # rank 2 of 2
        (dict(one, size=[0], grid=[[[0, 1]]]), [[0, 0, 1]]),
        (dict(one, size=[4], grid=[[[2, 2]]]), [[0, 0, 1]]),
        (dict(one, props=1), [[0, 0, 1]]),
        (dict(one, props=True), [[0, 0, 1]]),
        (dict(one, type="bytes"), [[0, 0, 1]]),
        ({"type": "tensor", "props": 0, "size": [], "chunks": [[0]]}, [[0, 0, 1]]),
    ]
    for entry, ranks in odd:
        assert manifest_entries.whole_tensor(entry, ranks, props[:1], 2) is None, (entry, ranks)
    # shapes seen before are not made again, and never stand in for a lookalike: a boolean
    # size equals 1 as a key, but is still refused
    shapes: dict = {}
    a = manifest_entries.whole_tensor(one, [[0, 0, 1]], props[:1], 2, shapes)
    b = manifest_entries.whole_tensor(dict(one), [[1, 0, 1]], props[:1], 2, shapes)
    assert a is not None and b is not None and a[1] == [0] and b[1] == [1]
    assert a[0] == b[0] and a[0].chunks[0] is not b[0].chunks[0]  # equal, not one object
    assert list(shapes) == [(4,)]
    unit = {"type": "tensor", "props": 0, "size": [1], "grid": [[[1, 1]]]}
    assert manifest_entries.whole_tensor(unit, [[0, 0, 1]], props[:1], 2, shapes) is not None
    for lookalike in (dict(unit, size=[True]), dict(unit, size=[1.0])):
        assert manifest_entries.whole_tensor(lookalike, [[0, 0, 1]], props[:1], 2, shapes) is None


def test_manifest_index_stays_small_as_ranks_grow():
    """A tensor sharded over N ranks costs the index the same few bytes whatever N (its
    grid of splits and its writers as one progression); the items are in the sections."""
    sizes, section = {}, {}
    for n in (8, 64, 512):
        rows = 4 * n
        chunks = [
            ChunkStorageMetadata(torch.Size([r * 4, 0]), torch.Size([4, 16])) for r in range(n)
        ]
        md = Metadata(
            {
                "w": TensorStorageMetadata(
                    TensorProperties(torch.float32), torch.Size([rows, 16]), chunks
                )
            }
        )
        locs = {
            MetadataIndex("w", c.offsets): manifest.ItemLocation(
                f"__{r}_0.distcp", 0, 300, "deadbeef", r, 300, "cafef00d", 64
            )
            for r, c in enumerate(chunks)
        }
        nodes = [list(range(k, k + 8)) for k in range(0, n, 8)]
        built = _build(md, locs, world_size=n, nodes=nodes)
        sizes[n] = len(json.dumps(json.loads(built.index)["tensors"]))
        parsed = _parse(built)
        assert (
            dict(parsed.locations) == locs
            and parsed.metadata.state_dict_metadata == md.state_dict_metadata
        )
        section[n] = max(len(s) for s in built.sections.values())  # 8 ranks' items each
    assert sizes[512] - sizes[8] < 32, sizes  # digits of the size, not the chunk list
    assert section[512] - section[8] < 64, section  # digits of ranks and ids


def test_chunks_interleaved_by_rank_still_encode_as_a_grid():
    """TP 8 then FSDP on the same dim: rank dp * 8 + tp holds rows tp * R/8 + dp * 4, so DCP's
    chunk list (in rank order) is not row-major. The index still stores a grid and a few
    progressions: its size does not grow with the ranks."""
    sizes = {}
    for n in (64, 512):
        per_tp = n // 8
        rows = 4 * n
        order = [(dp, tp) for dp in range(per_tp) for tp in range(8)]  # rank order
        chunks = [
            ChunkStorageMetadata(torch.Size([tp * rows // 8 + dp * 4, 0]), torch.Size([4, 16]))
            for dp, tp in order
        ]
        md = Metadata(
            {
                "w": TensorStorageMetadata(
                    TensorProperties(torch.float32), torch.Size([rows, 16]), chunks
                )
            }
        )
        locs = {
            MetadataIndex("w", c.offsets): manifest.ItemLocation(
                f"__{r}_0.distcp", 0, 300, "deadbeef", r, 300, "cafef00d", 64
            )
            for r, c in enumerate(chunks)
        }
        nodes = [list(range(k, k + 8)) for k in range(0, n, 8)]
        built = _build(md, locs, world_size=n, nodes=nodes)
        sizes[n] = len(json.dumps(json.loads(built.index)["tensors"]))
        parsed = _parse(built)
        assert dict(parsed.locations) == locs
        got = parsed.metadata.state_dict_metadata["w"].chunks
        assert sorted(got, key=lambda c: tuple(c.offsets)) == got
        assert sorted(map(str, got)) == sorted(map(str, chunks))
    assert sizes[512] - sizes[64] < 64, sizes


def test_manifest_sections_are_checked_against_the_index():
    md, locs = _metadata([(4, 2)])
    built = _build(md, locs, world_size=2, nodes=[[0], [1]])
    m = manifest.parse(built.index, where="m.json")
    sharded = [i for i in locs if i.fqn != "extra"]
    assert not m.complete and m.nodes_holding(sharded) == {0}
    assert m.nodes_holding([MetadataIndex("extra")]) == {manifest.SHARED}
    tampered = built.sections[0].replace(b"deadbeef", b"deadbeee")
    with pytest.raises(ManifestError, match="does not match the index"):
        manifest.parse_section(m, 0, tampered, where="node-0")
    with pytest.raises(ManifestError, match="does not match the index"):
        manifest.parse_section(m, 0, built.sections[1], where="node-0")  # another node's


@pytest.mark.parametrize(
    "field,value",
    [("dtype", "os.system"), ("size", [-1]), ("chunks", [["x", 1]])],
)
def test_manifest_rejects_unknown_types_even_with_valid_checksum(field, value):
    from dcp_tiered.policy import manifest_codec

    md, locs = _metadata([(4, 2)])
    body = json.loads(_build(md, locs, world_size=1, nodes=[[0]]).index)
    entry = _manifests.entry_of(body, body["tensors"]["fqns"][0])[0]
    entry.pop("grid", None)
    (body["properties"][0] if field == "dtype" else entry)[field] = value
    body.pop("manifest_checksum")
    with pytest.raises(ManifestError):  # a careful forger: the checksum is right
        manifest.parse(manifest_codec.seal(body), where="m.json")


def test_version_1_manifests_still_parse():
    from dcp_tiered.policy import manifest_v1

    md, locs = _metadata([(4, 2), (6, 3)])
    data = manifest_v1.build(
        step="s",
        save_id="s",
        world_size=1,
        nodes=[[0]],
        committed_at_ns=0,
        metadata=md,
        locations=locs,
        versions={},
    )
    parsed = manifest.parse(data, where="m.json")
    assert parsed.complete and dict(parsed.locations) == locs and parsed.version == 1


def test_version_2_indexes_still_parse_as_version_3_ones_do():
    """A step saved by an earlier dcp_tiered has an index entry per tensor (version 2):
    it parses to the same metadata, writers and locations as the columns of version 3,
    for every kind of key (sharded, whole, 0-d, an empty dimension, bytes, a planner path
    that is not a tensor's)."""
    from dcp_tiered.policy import manifest_codec

    md, locs = _metadata([(4, 2), (6, 3)])
    sdm = dict(md.state_dict_metadata)
    for fqn, size in (("whole", (5, 3)), ("scalar", ()), ("empty", (0, 4)), ("twin", (5, 3))):
        chunk = ChunkStorageMetadata(torch.Size([0] * len(size)), torch.Size(size))
        sdm[fqn] = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size(size), [chunk])
        locs[MetadataIndex(fqn, chunk.offsets)] = manifest.ItemLocation(
            "__1_0.distcp", 100 * len(locs), 100, "deadbeef", 1, 10**6, "cafef00d"
        )
    paths = {"extra": ("extra",), "whole": ("m", "whole"), "loose": ("a", 3)}
    md = Metadata(sdm, planner_data=paths)
    built = _build(md, locs)
    body = json.loads(built.index)
    columns = body["tensors"]
    whole = [f for f, s in zip(columns["fqns"], columns["shape"]) if s >= 0]
    assert whole == ["whole", "scalar", "twin"] and len(columns["shapes"]) == 2, columns
    v3 = _parse(built)
    v2 = manifest.parse(manifest_codec.seal(_manifests.as_version_2(body)), where="m.json")
    for node, data in built.sections.items():
        v2 = manifest.parse_section(v2, node, data, where=f"node-{node}")
    assert (v3.version, v2.version) == (3, 2)
    for m in (v2, v3):
        assert m.metadata.state_dict_metadata == sdm and list(
            m.metadata.state_dict_metadata
        ) == list(sdm)
        assert m.metadata.planner_data == paths and dict(m.locations) == locs
    assert v2.writers == v3.writers and v3.writers["whole"] == [1]


def test_parsing_an_index_of_many_whole_tensors_makes_two_objects_each_for_the_collector():
    """A restore's first garbage collection walks every object the manifest's parse made and
    kept: whole tensors of one shape share one chunk list, and those of one writer one
    writers list, so a whole tensor costs its TensorStorageMetadata and its planner path (a
    tuple of strings, which the collector stops tracking once it has seen it), not five
    objects. The values are those of unshared lists."""
    import gc

    sdm, locs = {}, {}
    for i in range(2000):
        size = torch.Size((4, 1 + i % 3))
        chunk = ChunkStorageMetadata(torch.Size([0, 0]), size)
        sdm[f"t{i}"] = TensorStorageMetadata(TensorProperties(torch.float32), size, [chunk])
        locs[MetadataIndex(f"t{i}", chunk.offsets)] = manifest.ItemLocation(
            f"__{i % 2}_0.distcp", 100 * i, 100, "deadbeef", i % 2, 10**6, "cafef00d"
        )
    paths = {f"t{i}": ("model", f"t{i}") for i in range(2000)}
    built = _build(Metadata(sdm, planner_data=paths), locs)
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        parsed = manifest.parse(built.index, where="m.json")
        made = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert made < 2.2 * 2000, made  # 5 per tensor when each had lists of its own
    md = parsed.metadata.state_dict_metadata
    assert md == sdm and parsed.metadata.planner_data == paths
    assert parsed.writers["t0"] == [0] and parsed.writers["t1"] == [1]
    assert md["t0"].chunks is md["t3"].chunks and md["t0"].chunks is not md["t1"].chunks


_PATH_PART = st.one_of(
    st.text(max_size=3), st.integers(-5, 5), st.floats(allow_nan=False), st.booleans()
)


@settings(max_examples=200)
@given(
    st.lists(
        st.one_of(
            st.none(),
            st.lists(st.one_of(st.text(max_size=3), st.integers(0, 9)), max_size=3),
            st.lists(_PATH_PART, max_size=3),
            st.text(max_size=3),
            st.lists(st.lists(st.integers(), max_size=2), max_size=2),
        ),
        max_size=6,
    )
)
def test_planner_paths_decode_as_each_one_alone_would(paths):
    """The planner data's paths, checked and made tuples a column at a time, are what
    ``path_of`` makes of each path alone (None: no path for that key), whatever JSON holds."""
    from dcp_tiered.policy import manifest_entries, manifest_index

    fqns = [f"k{i}" for i in range(len(paths))]
    got = manifest_index.decode_paths({"paths": paths, "more": {}}, fqns)
    want = {f: manifest_entries.path_of(p) for f, p in zip(fqns, paths) if p is not None}
    assert got == want and list(got) == list(want)
    assert all(type(v) is tuple for v in got.values())


def test_remote_keys_keep_each_save_apart_and_refuse_hostile_markers():
    from dcp_tiered.policy.layout import RemoteKeys, keys_of_marker, save_id_of_key
    from dcp_tiered.policy.prefixes import PrefixStrategy

    new = RemoteKeys("step-1", "0a1b2c3d4e5f", PrefixStrategy.named("hash"))
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


def test_planner_data_paths_decode_as_before():
    """A key's path in the index's planner data: strings and ints as they are (in one step
    when that is all there is), booleans kept, anything else made a string."""
    assert manifest_entries.path_of(["model", "layers", 0, "w"]) == ("model", "layers", 0, "w")
    assert manifest_entries.path_of(["a", True, 1.5, None]) == ("a", True, "1.5", "None")
    assert manifest_entries.path_of([]) == ()
    assert manifest_entries.path_of("ab") == (
        "a",
        "b",
    )  # not a list: each element, as it always was


def test_manifest_sections_are_the_compact_json_of_their_members():
    """A section is spliced from JSON text made once per layout: it is exactly what
    json.dumps makes of its members (compact, UTF-8 as it is), in their order."""
    md, locs = _metadata([(4, 2), (6, 3)])
    built = _build(md, locs, step="шаг-3", world_size=2, nodes=[[0], [1]])
    assert set(built.sections) == {manifest.SHARED, 0, 1}
    for node, data in built.sections.items():
        body = json.loads(data)
        assert list(body) == ["format", "version", "step", "save_id", "node", "files"]
        assert body["node"] == node and body["step"] == "шаг-3"
        assert json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode() == data
        for entry in body["files"]:
            assert list(entry)[:3] == ["name", "size", "checksum"] and "crcs" in entry
    _parse(built)  # and reads back, every section checked against the index
