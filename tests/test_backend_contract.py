"""The contract both backends keep (dcp_tiered/backends/base.py), checked the same way on the
local disk, a file:// remote and S3: what a tier may rely on whichever store is under it."""

from __future__ import annotations

import pytest

from dcp_tiered import RemoteConfig
from dcp_tiered.backends.base import Backend
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.backends.remote import RemoteBackend
from dcp_tiered.errors import ConfigError


@pytest.fixture(params=["local", "file", "s3"])
def backend(request, tmp_path) -> Backend:
    if request.param == "local":
        return LocalBackend(tmp_path / "root")
    if request.param == "file":
        return RemoteBackend(RemoteConfig(url=f"file://{tmp_path / 'remote'}"))
    s3 = request.getfixturevalue("s3")
    return RemoteBackend(RemoteConfig(url=s3.url(), storage_options=s3.options()))


def test_both_backends_declare_the_contract(backend):
    assert isinstance(backend, Backend)


def test_keys_are_written_read_listed_and_removed_alike(backend, caplog):
    assert not backend.exists("step-1/manifest.json")
    assert backend.children() == [] and backend.children("step-1/") == []
    with pytest.raises(FileNotFoundError):
        backend.read("step-1/manifest.json")
    if isinstance(backend, LocalBackend):  # a disk has directories; a store makes prefixes
        backend.make_dir("step-1")
    backend.write("step-1/manifest.json", b"one")
    assert backend.read("step-1/manifest.json") == b"one"
    assert backend.exists("step-1/manifest.json")
    assert backend.children() == ["step-1"] and backend.children("step-1") == ["manifest.json"]
    assert backend.children("step-1/") == ["manifest.json"]

    assert backend.atomic_write("step-1/manifest.json", b"two") is True
    assert backend.read("step-1/manifest.json") == b"two"
    assert backend.atomic_write("step-1/manifest.json", b"three", exclusive=True) is False
    assert backend.read("step-1/manifest.json") == b"two"  # the store decided: not replaced
    assert backend.atomic_write("latest.json", b"new", exclusive=True) is True
    assert backend.read("latest.json") == b"new"
    assert sorted(backend.children()) == ["latest.json", "step-1"]  # no temporary file left

    with caplog.at_level("INFO", logger="dcp_tiered"):
        backend.remove("step-1/manifest.json", reason="test: contract")
    assert any("test: contract" in r.getMessage() for r in caplog.records)  # every delete logged
    assert not backend.exists("step-1/manifest.json")
    backend.remove("step-1/manifest.json", reason="test: gone already")  # absent: nothing


@pytest.mark.parametrize("key", ["../escape", "/etc/passwd", "a//b", "a/../b", ""])
def test_no_key_reaches_outside_the_root(backend, key):
    with pytest.raises(ConfigError):
        backend.read(key)
    with pytest.raises(ConfigError):
        backend.atomic_write(key, b"x")


def test_deleting_a_remote_step_whose_name_starts_like_the_hashed_prefix_removes_its_save(
    tmp_path,
):
    """A step named ``dataset-1`` is not the hashed ``data/`` prefix: deleting it removes its
    save's objects too (they were left behind while prefixes were told apart by their first
    four letters), and still nothing a save of ours does not write."""
    import json
    import time

    from dcp_tiered.policy import layout
    from dcp_tiered.policy.prefixes import PrefixStrategy
    from dcp_tiered.tiers.remote import RemoteTier

    remote = RemoteBackend(RemoteConfig(url=f"file://{tmp_path / 'remote'}"))
    marker = layout.marker_body("dataset-1", "0a1b", time.time_ns(), PrefixStrategy(), "run-a")
    keys = layout.keys_of_marker("dataset-1", marker)
    ours = [keys.file("__0_0.distcp"), keys.manifest, keys.metadata, keys.node_record(0)]
    for key in ours:
        remote.write(key, b"x")
    remote.write("dataset-1/0a1b/notes.txt", b"someone else's")
    remote.create_exclusive(f"dataset-1/{layout.REMOTE_MARKER}", json.dumps(marker).encode())
    assert RemoteTier(remote).steps() == ["dataset-1"]

    RemoteTier(remote).delete("dataset-1", reason="test: delete", run_id="run-a")
    assert RemoteTier(remote).steps() == []
    assert not any(remote.exists(key) for key in ours)
    assert remote.read("dataset-1/0a1b/notes.txt") == b"someone else's"
