"""Saved at 2 ranks (FSDP2 / FSDP1, sync / THREAD / PROCESS), loads bit-exact at 1, 2 and 3."""

from __future__ import annotations

import pytest

from tests import _manifests as manifests
from tests.conftest import read_json, torchrun, visible

pytestmark = pytest.mark.multirank


def _save_then_load(tmp_path, kind: str, mode: str, load_worlds=(1, 2, 3), extra=()):
    root, ref = tmp_path / "ckpt", tmp_path / "ref.pt"
    torchrun(
        "roundtrip.py",
        2,
        "save",
        "--root",
        str(root),
        "--kind",
        kind,
        "--mode",
        mode,
        "--ref",
        str(ref),
        *extra,
    )
    for world in load_worlds:
        out = tmp_path / f"load{world}.json"
        torchrun(
            "roundtrip.py",
            world,
            "load",
            "--root",
            str(root),
            "--kind",
            kind,
            "--ref",
            str(ref),
            "--out",
            str(out),
        )
        result = read_json(out)
        assert result["world"] == world
        assert result["mismatches"] == [], f"load at {world} ranks differs: {result}"


def test_fsdp2_sync_save_reshards_to_1_2_3_ranks(tmp_path):
    _save_then_load(tmp_path, "fsdp2", "sync")


def test_fsdp1_sharded_state_dict_reshards_to_1_2_3_ranks(tmp_path):
    _save_then_load(tmp_path, "fsdp1", "sync")


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_fsdp2_async_save(tmp_path, mode):
    _save_then_load(tmp_path, "fsdp2", mode, load_worlds=(2, 3))


def test_async_save_on_dedicated_group_while_training(tmp_path):
    """Training collectives on the default group run while the save's run on its own group;
    the checkpoint equals the state at the save call."""
    _save_then_load(tmp_path, "fsdp2", "thread", load_worlds=(2,), extra=("--train-during-save",))


def test_two_nodes_each_with_own_root_commit_atomically(tmp_path):
    """2 simulated nodes x 2 ranks, each node writing to its own local root."""
    import json
    import shutil

    root, ref = tmp_path / "ckpt", tmp_path / "ref.pt"
    torchrun(
        "roundtrip.py",
        4,
        "save",
        "--root",
        str(root),
        "--nodes",
        "2",
        "--mode",
        "thread",
        "--ref",
        str(ref),
    )
    node0, node1 = root / "node0" / "step-2", root / "node1" / "step-2"
    files0 = sorted(p.name for p in node0.iterdir())
    files1 = sorted(p.name for p in node1.iterdir())
    shards0 = [f"__{r}_{i}.distcp" for r in (0, 1) for i in (0, 1)]
    shards1 = [f"__{r}_{i}.distcp" for r in (2, 3) for i in (0, 1)]
    # Node 0 (the coordinator's) holds every manifest section and DCP's .metadata; node 1
    # the same index, the shared section (items every rank reads) and its own section only.
    sections = ["manifest.node-0.json", "manifest.node-1.json", "manifest.shared.json"]
    assert files0 == [".metadata", *shards0, "manifest.json", *sections]
    assert files1 == [*shards1, "manifest.json", *sections[1:]]
    m0, m1 = (manifests.index(d) for d in (node0, node1))
    assert m0 == m1 and m0["world_size"] == 4
    assert sorted(manifests.files(node0)) == shards0 + shards1
    assert set(manifests.files(node1)) >= set(shards1)  # and files holding shared items
    assert not [p for p in visible(root / "node0") if p.startswith(".")]
    assert not [p for p in visible(root / "node1") if p.startswith(".")]
    # With node 1's shards brought over (the remote tier's job later), node 0 loads it all.
    for name in shards1:
        shutil.copy(node1 / name, node0 / name)
    out = tmp_path / "load.json"
    torchrun(
        "roundtrip.py",
        2,
        "load",
        "--root",
        str(root / "node0"),
        "--ref",
        str(ref),
        "--out",
        str(out),
    )
    assert read_json(out)["mismatches"] == []


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_back_to_back_async_saves_are_each_isolated(tmp_path, mode):
    """Four async saves without waiting: double buffering and ordering keep each one exact."""
    out = tmp_path / "out.json"
    torchrun(
        "back_to_back.py", 2, "--root", str(tmp_path / "ck"), "--mode", mode, "--out", str(out)
    )
    assert read_json(out)["bad"] == []


def test_two_nodes_upload_to_s3_and_a_lost_node_restores_from_it(tmp_path, s3):
    """2 nodes x 2 ranks each upload their own shards; node 1's disk is then lost and the job
    restores, resharded to 3 ranks on 3 nodes: rank 0 reads its node's local copy where it
    can, ranks 1 and 2 (an emptied and a new node) read from S3."""
    import json
    import shutil

    root, ref = tmp_path / "ckpt", tmp_path / "ref.pt"
    remote = ["--remote", s3.url(), "--storage-options", json.dumps(s3.options())]
    torchrun(
        "roundtrip.py",
        4,
        "save",
        "--root",
        str(root),
        "--nodes",
        "2",
        "--mode",
        "thread",
        "--ref",
        str(ref),
        *remote,
    )
    shutil.rmtree(root / "node1")
    out = tmp_path / "load.json"
    torchrun(
        "roundtrip.py",
        3,
        "load",
        "--root",
        str(root),
        "--nodes",
        "2",
        "--ref",
        str(ref),
        "--out",
        str(out),
        *remote,
    )
    assert read_json(out)["mismatches"] == []
