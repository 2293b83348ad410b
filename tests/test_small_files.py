"""The local backend's one atomic small-file write (``LocalBackend._atomic_write``), through
every way in: ``replace_root_file``, ``create_root_file``, ``write_atomically`` (a file in a
step's directory), the contract's ``atomic_write`` and ``backends.local.replace_file`` (the
frameworks' trackers and stubs).
Each leaves the old content or the new, never a temporary file, also when the write fails."""

from __future__ import annotations

import threading

import pytest

from dcp_tiered.backends.local import LocalBackend, replace_file
from dcp_tiered.policy.layout import TMP_SUFFIX


def _names(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_every_way_in_replaces_whole_and_leaves_no_temporary_file(tmp_path):
    backend = LocalBackend(tmp_path / "root")  # created by the first root-level write
    backend.replace_root_file("a.json", b"1")
    backend.replace_root_file("a.json", b"22")
    assert backend.create_root_file("b.json", b"first") is True
    assert backend.create_root_file("b.json", b"second") is False  # exists: untouched
    (tmp_path / "root" / "step-1").mkdir()
    backend.write_atomically("step-1", "trainer_state.json", b"{}")
    backend.write_atomically("step-1", "trainer_state.json", b'{"step": 1}')
    replace_file(tmp_path / "root" / "latest", b"step-1")
    root = tmp_path / "root"
    assert _names(root) == ["a.json", "b.json", "latest", "step-1"]
    assert _names(root / "step-1") == ["trainer_state.json"]
    assert [(root / n).read_bytes() for n in ("a.json", "b.json", "latest")] == [
        b"22",
        b"first",
        b"step-1",
    ]
    assert (root / "step-1" / "trainer_state.json").read_bytes() == b'{"step": 1}'


def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(tmp_path):
    backend = LocalBackend(tmp_path)
    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-1" / "taken").mkdir()  # a directory where the file must go
    with pytest.raises(IsADirectoryError):
        backend.write_atomically("step-1", "taken", b"x")
    assert _names(tmp_path / "step-1") == ["taken"]  # no .taken.<pid>-<tid>.dcp-tiered-tmp
    (tmp_path / "root.json").mkdir()
    with pytest.raises(IsADirectoryError):
        backend.replace_root_file("root.json", b"x")
    assert not [n for n in _names(tmp_path) if n.endswith(TMP_SUFFIX)]


def test_threads_writing_one_file_at_once_each_write_it_whole(tmp_path):
    """Each thread writes aside under a name of its own: none renames another's half-written
    file into place."""
    backend = LocalBackend(tmp_path)
    (tmp_path / "step-1").mkdir()
    payloads = [bytes([i]) * 65536 for i in range(8)]
    errors: list[OSError] = []

    def write(data: bytes) -> None:
        try:
            for _ in range(20):
                backend.write_atomically("step-1", "f", data)
        except OSError as e:  # in a thread it would only be a warning
            errors.append(e)

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert (tmp_path / "step-1" / "f").read_bytes() in payloads
    assert _names(tmp_path / "step-1") == ["f"]
