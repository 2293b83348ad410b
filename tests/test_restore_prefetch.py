"""A restore reads the step's files into the page cache while DCP plans it: the manifest's
sections, then the data files this rank wrote, within a budget, on a thread of its own. Only
plain files of ours are read (never through a link, never a FIFO), and a file that cannot be
read leaves the restore to its own reads, which check every byte as before."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import TieredStorageReader, TieredStorageWriter
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.reader import _prefetch


def _state() -> dict:
    g = torch.Generator().manual_seed(2)
    return {f"t{i}": torch.randn(1000 + 300 * i, generator=g) for i in range(40)}


def _saved(tmp_path) -> dict:
    state = _state()
    writer = TieredStorageWriter(tmp_path, thread_count=2)
    dcp.save(state, checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    writer.close()
    return state


def _loaded(tmp_path, state: dict) -> dict:
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(
        out, checkpoint_id="step-1", storage_reader=TieredStorageReader(tmp_path), no_dist=True
    )
    return out


def _finished(monkeypatch) -> threading.Event:
    """An event set once the prefetch thread has finished."""
    done, real_run = threading.Event(), _prefetch.Prefetch._run

    def run(*a):
        try:
            real_run(*a)
        finally:
            done.set()

    monkeypatch.setattr(_prefetch.Prefetch, "_run", run)
    return done


def _record(monkeypatch) -> tuple[list[tuple[str, int, int]], threading.Event]:
    """The pieces of files prefetch reads (name, offset, length), and an event set once it
    has finished."""
    read, real_prefetch = [], LocalBackend.prefetch

    def prefetch(self, *names, offset, length):
        read.append((names[-1], offset, length))
        real_prefetch(self, *names, offset=offset, length=length)

    monkeypatch.setattr(LocalBackend, "prefetch", prefetch)
    return read, _finished(monkeypatch)


def test_a_restore_reads_the_sections_then_this_ranks_data_files_ahead(tmp_path, monkeypatch):
    state = _saved(tmp_path)
    step = tmp_path / "step-1"
    # another rank's file (a restore at another world size would read it): not this rank's
    shutil.copy(step / "__0_0.distcp", step / "__1_0.distcp")
    read, done = _record(monkeypatch)
    out = _loaded(tmp_path, state)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert done.wait(10)
    names = [n for n, _, _ in read]
    data = [n for n in names if n.endswith(".distcp")]
    assert data == ["__0_0.distcp", "__0_1.distcp"]
    assert names.index(data[0]) == len(names) - 2  # every manifest file before them
    assert all(not n.endswith(".distcp") for n in names[: len(names) - 2]) and names[:-2]
    sizes = {n: (step / n).stat().st_size for n in names}
    assert all(offset == 0 and length == sizes[n] for n, offset, length in read)


def test_the_prefetch_starts_with_a_load_and_stops_at_its_budget(tmp_path, monkeypatch):
    _saved(tmp_path)
    read, done = _record(monkeypatch)
    monkeypatch.setattr(_prefetch, "MAX_BYTES", 3000)
    reader = TieredStorageReader(tmp_path)
    reader.reset("step-1")
    metadata = reader.read_metadata()
    assert not done.wait(0.5)  # a look at the metadata reads nothing ahead: no load follows
    reader.set_up_storage_reader(metadata, True)  # what DCP's load calls next
    assert done.wait(10)
    assert sum(length for _, _, length in read) <= 3000


def test_a_file_the_prefetch_cannot_read_leaves_the_restore_to_its_own_reads(tmp_path, monkeypatch):
    state = _saved(tmp_path)

    def failing(self, *names, offset, length):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(LocalBackend, "prefetch", failing)
    done = _finished(monkeypatch)
    out = _loaded(tmp_path, state)
    assert done.wait(10)
    assert all(torch.equal(out[k], v) for k, v in state.items())


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_the_prefetch_reads_no_link_and_no_fifo(tmp_path, kind):
    """A link (out of the root, to anything) or a FIFO (a read would block for ever) in
    place of a data file: refused at once, nothing read."""
    backend = LocalBackend(tmp_path)
    (tmp_path / "step-1").mkdir()
    target = tmp_path / "step-1" / "__0_0.distcp"
    if kind == "link":
        outside = tmp_path.parent / f"{tmp_path.name}-outside.bin"
        outside.write_bytes(b"x" * 4096)
        os.symlink(outside, target)
    else:
        os.mkfifo(target)
    finished = []
    t = threading.Thread(
        target=lambda: finished.append(_prefetch.Prefetch(backend, "step-1", 2**20).stop()),
        daemon=True,
    )
    t.start()
    t.join(10)
    assert finished == [None]  # returned, having logged it: no hang, no error raised
    with pytest.raises(OSError):
        backend.prefetch("step-1", "__0_0.distcp", offset=0, length=4096)


def test_a_finished_load_has_stopped_its_reads_ahead(tmp_path, monkeypatch):
    """A load reads what it needs itself: once it is done, no prefetch thread is left."""
    state = _saved(tmp_path)
    monkeypatch.setattr(_prefetch, "PIECE_BYTES", 1000)  # many pieces: it could go on
    out = _loaded(tmp_path, state)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert "dcp-tiered-prefetch" not in {t.name for t in threading.enumerate()}


def test_prefetch_reads_a_file_up_to_its_end(tmp_path):
    backend = LocalBackend(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"abc" * 1000)
    backend.prefetch("d", "f", offset=0, length=10**9)  # past the end: stops there
    backend.prefetch("d", "f", offset=2999, length=5)
    backend.prefetch("d", "f", offset=0, length=0)
    assert (tmp_path / "d" / "f").read_bytes() == b"abc" * 1000
