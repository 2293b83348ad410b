"""The batched data path (issue 30): tensor items framed from templates instead of serialised
(byte for byte what torch's writer makes, its own writer where a frame is not certain),
staging and memory snapshots copied in one batch, local plans reused for an unchanged
structure."""

from __future__ import annotations

import errno
import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, default_planner
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import (
    TieredLoadPlanner,
    TieredSavePlanner,
    TieredStorageReader,
    TieredStorageWriter,
    _torch_compat,
    batch_copy,
    host_copy,
    item_frame,
    item_writer,
)
from dcp_tiered.backends import _local_reads
from dcp_tiered.errors import InsufficientSpaceError
from dcp_tiered.item_frame import Framer
from dcp_tiered.policy import layout
from dcp_tiered.writer import _datafile
from tests.conftest import counted_calls
from tests.test_save_load import failure

FRAMED_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _torch_bytes(t: torch.Tensor) -> bytes:
    out = io.BytesIO()
    _torch_compat.save_tensor(t, out)
    return out.getvalue()


def _framed(framer: Framer, t: torch.Tensor) -> bytes | None:
    frame = framer.frame(t)
    if frame is None:
        return None
    return frame.head + item_frame._bytes_of(t) + frame.tail


@pytest.mark.parametrize("dtype", FRAMED_DTYPES, ids=str)
def test_frames_are_torchs_own_bytes(dtype):
    framer = Framer()
    shapes = [(), (0,), (1,), (7,), (64,), (65,), (3, 300), (2, 3, 1, 5), (1, 1, 1, 1, 70), (4099,)]
    for shape in shapes:
        t = (
            torch.randn(shape).to(dtype)
            if dtype.is_floating_point
            else torch.ones(shape, dtype=dtype)
        )
        assert _framed(framer, t) == _torch_bytes(t), shape
        assert _framed(framer, t) == _torch_bytes(t), shape  # from the cache too


def test_a_torch_writer_that_differs_disables_framing(monkeypatch):
    real = item_frame._torch_bytes
    monkeypatch.setattr(item_frame, "_torch_bytes", lambda t: real(t) + b"\0")
    assert Framer().frame(torch.ones(3)) is None


def test_unusual_tensors_are_not_framed():
    framer = Framer()
    assert framer.frame(torch.ones(2, dtype=torch.complex64).conj()) is None
    assert framer.frame(torch.ones(4)[1:]) is None  # not at its storage's start
    assert framer.frame(torch.nn.Parameter(torch.ones(2))) is None
    assert framer.frame(torch.ones(2, requires_grad=True)) is None


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    out: dict = {f"f{i}": torch.randn(1 + 37 * i, generator=g) for i in range(40)}
    for i, dtype in enumerate(FRAMED_DTYPES):
        out[f"d{i}"] = (torch.randn(5, 7, generator=g) * 9).to(dtype)
    out["big"] = torch.randn(300_000, generator=g)  # written from its own memory
    out["t"] = torch.randn(6, 4, generator=g).t()  # not contiguous
    out["empty"] = torch.ones(0, 3)
    out["zero_d"] = torch.tensor(2.5)
    out["f64"] = torch.randn(9, generator=g, dtype=torch.float64)
    out["n"] = 7
    return out


def test_framed_steps_load_bit_exact_with_vanilla_dcp_and_ours(tmp_path, monkeypatch):
    for dtype in FRAMED_DTYPES:  # the first use's self-checks call torch's writer too
        item_frame.FRAMER.frame(torch.ones(1, dtype=dtype))
    calls = []
    real = _torch_compat.save_tensor
    monkeypatch.setattr(_torch_compat, "save_tensor", lambda t, s: (calls.append(t), real(t, s)))
    # float64 refused here as by a failed self-check: written by torch's writer
    monkeypatch.setitem(item_frame.FRAMER._dtypes, torch.float64, None)
    monkeypatch.setattr(item_frame.FRAMER, "_frames", {})
    src = _state()
    writer = TieredStorageWriter(tmp_path)
    dcp.save(src, checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    assert {t.dtype for t in calls} == {torch.float64}  # every other tensor was framed
    for reader in (FileSystemReader(tmp_path / "step-1"), TieredStorageReader(tmp_path)):
        out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in src.items()}
        dcp.load(out, storage_reader=reader, no_dist=True, checkpoint_id=None)
        for k, v in src.items():
            if isinstance(v, torch.Tensor):
                assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
            else:
                assert out[k] == v


def test_a_short_write_fails_the_save_and_keeps_the_previous_step(tmp_path, monkeypatch):
    src = _state()
    writer = TieredStorageWriter(tmp_path)
    dcp.save(src, checkpoint_id="step-1", storage_writer=writer, no_dist=True)

    def fail(f, views):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(item_writer.LocalBackend, "write_vectors", fail)
    with pytest.raises(CheckpointException) as e:
        dcp.save(src, checkpoint_id="step-2", storage_writer=writer, no_dist=True)
    assert isinstance(failure(e), OSError) and failure(e).errno == 28
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step-1"]


@pytest.mark.parametrize("sync_files", [True, False])
def test_data_files_start_to_the_disk_as_written_and_are_fsynced_once_all_are(
    tmp_path, monkeypatch, sync_files
):
    """Each batch of a data file is handed to the kernel's writeback as soon as it is written
    (the whole file, in order, nothing twice), and no data file is fsynced before every one of
    the rank's files is written: on ext4 one file's fsync commits the journal and stalls the
    other threads' writes. Without sync_files neither happens."""
    monkeypatch.setattr(item_writer, "_BATCH_BYTES", 2**20)  # many batches from a small state
    monkeypatch.setitem(item_frame.FRAMER._dtypes, torch.float64, None)  # torch's writer too
    monkeypatch.setattr(item_frame.FRAMER, "_frames", {})
    g = torch.Generator().manual_seed(5)
    src = _state()
    src.update({f"w{i}": torch.randn(100_000 + 999 * i, generator=g) for i in range(12)})
    src.update({f"s{i}": torch.randn(3_000, generator=g) for i in range(300)})
    events: list[tuple[str, str, int, int]] = []

    def name_of(fd: int) -> str:
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))

    real_writeback = _local_reads.start_writeback
    monkeypatch.setattr(
        _local_reads,
        "start_writeback",
        lambda fd, offset, n: (
            events.append(("writeback", name_of(fd), offset, n)),
            real_writeback(fd, offset, n),
        ),
    )
    real_fsync = os.fsync
    monkeypatch.setattr(
        os, "fsync", lambda fd: (events.append(("fsync", name_of(fd), 0, 0)), real_fsync(fd))
    )
    real_write = _datafile.write_file

    def write_file(save, f, *args):
        out = real_write(save, f, *args)
        events.append(("written", name_of(f.fileno()), 0, out.position))
        return out

    monkeypatch.setattr(_datafile, "write_file", write_file)
    writer = TieredStorageWriter(tmp_path, thread_count=2, sync_files=sync_files)
    dcp.save(src, checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    written = {name: size for kind, name, _, size in events if kind == "written"}
    assert len(written) == 2
    for name, size in written.items():
        assert (tmp_path / "step-1" / name).stat().st_size == size
    data_events = [e for e in events if e[1] in written]
    if not sync_files:
        assert [e[0] for e in data_events] == ["written", "written"]
    else:
        for name, size in written.items():
            ranges = [
                (offset, n) for kind, f, offset, n in events if (kind, f) == ("writeback", name)
            ]
            assert len(ranges) >= 3, ranges
            at = 0
            for offset, n in ranges:  # in order, each byte once, up to the file's end
                assert offset == at and n > 0, ranges
                at += n
            assert at == size
        last_write = max(k for k, e in enumerate(data_events) if e[0] == "written")
        syncs = [k for k, e in enumerate(data_events) if e[0] == "fsync"]
        assert sorted(data_events[k][1] for k in syncs) == sorted(written)
        assert min(syncs) > last_write
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in src.items()}
    dcp.load(out, storage_reader=FileSystemReader(tmp_path / "step-1"), no_dist=True)
    assert all(
        torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v
        for k, v in src.items()
    )


def test_batch_copy_copies_all_or_nothing():
    src = {"a": torch.ones(3), "b": [torch.full((2,), 2.0), {"c": 4, "d": [1, 2]}]}
    buf = {"a": torch.zeros(3), "b": [torch.zeros(2), {"c": 0, "d": [0, 0]}]}
    out = batch_copy.copy_into(src, buf)
    assert out["a"] is buf["a"] and torch.equal(buf["a"], src["a"])
    assert torch.equal(buf["b"][0], src["b"][0])
    assert out["b"][1]["d"] == [1, 2] and out["b"][1]["d"] is not src["b"][1]["d"]  # a copy
    for bad in (
        {"a": torch.ones(4), "b": src["b"]},  # another shape
        {"a": torch.ones(3, dtype=torch.float64), "b": src["b"]},  # another dtype
        {"a": torch.ones(3), "b": src["b"], "x": 1},  # another key
        {"a": 5, "b": src["b"]},  # a tensor became a value
    ):
        buf["a"].zero_()
        with pytest.raises(batch_copy.Mismatch):
            batch_copy.copy_into(bad, buf)
        assert not buf["a"].any()  # nothing copied


def test_a_dict_of_tensors_is_checked_as_closely_as_the_general_walk():
    """The flat-dict fast path (a module's state) refuses what the general walk refuses,
    on the first pairing and on the later ones that reuse the buffers' description."""
    names = [f"layer{i}.w" for i in range(50)]
    src = {n: torch.full((i + 1,), float(i)) for i, n in enumerate(names)}
    buf = {n: torch.zeros(i + 1) for i, n in enumerate(names)}
    known = batch_copy.new_descriptions()
    for _ in range(2):  # the second call uses the cached description of ``buf``
        out = batch_copy.copy_into(src, buf, descriptions=known)
        assert list(out) == names and all(out[n] is buf[n] for n in names)
        assert all(torch.equal(buf[n], src[n]) for n in names)
    shapes = dict(src, **{"layer3.w": torch.ones(1, 4)})  # same numel, another shape
    dtypes = dict(src, **{"layer7.w": torch.ones(8, dtype=torch.float64)})
    renamed = {("x" + n if n == "layer9.w" else n): t for n, t in src.items()}
    value = dict(src, **{"layer2.w": 3})  # a tensor became a value (general walk)
    for bad in (shapes, dtypes, renamed, value):
        for t in buf.values():
            t.zero_()
        for cache in (known, None):  # with the description kept, and made anew
            with pytest.raises(batch_copy.Mismatch):
                batch_copy.copy_into(bad, buf, descriptions=cache)
            assert not any(t.any() for t in buf.values())  # nothing copied
    reordered = dict(reversed(list(src.items())))  # the general walk pairs it by key
    out = batch_copy.copy_into(reordered, buf, descriptions=known)
    assert all(out[n] is buf[n] and torch.equal(buf[n], src[n]) for n in names)
    other = {n: torch.zeros(i + 2) for i, n in enumerate(names)}  # new buffers, new shapes
    with pytest.raises(batch_copy.Mismatch):
        batch_copy.copy_into(src, other, descriptions=known)
    assert set(known) == {id(buf), id(other)}  # each dict described once, by its owner's cache


def test_thousands_of_tensors_are_each_checked_before_they_are_copied(monkeypatch):
    """A dict of 5,000 tensors (host_copy checks stretches of them on one thread while the
    helper copies the stretches already checked): the copy is exact, no tensor is copied
    before its stretch was checked, a large tensor is copied in pieces (both threads take
    them), and a shape or dtype that changed anywhere (the first stretch, the last) raises
    Mismatch; the buffers then take a good copy again."""
    import bisect

    count = 5000
    assert count >= host_copy._PIPELINE_MIN_TENSORS
    sizes = [20_000 if i % 700 == 0 else i % 37 + 1 for i in range(count)]  # some memcpy'd
    sizes[2500] = 10 * 2**20  # 40 MiB: more than one piece
    src = {f"t{i}": torch.randn(n) for i, n in enumerate(sizes)}
    buf = {k: torch.zeros_like(v) for k, v in src.items()}
    number = {id(t): i for i, t in enumerate(buf.values())}
    starts = sorted((t.data_ptr(), i) for i, t in enumerate(buf.values()))
    known = batch_copy.new_descriptions()
    events: list[tuple[str, int, int]] = []
    real_check, real_run = batch_copy.Expected.check, host_copy._run

    def check(self, start, end):
        real_check(self, start, end)
        events.append(("checked", start, end))

    def run(segments, dsts, srcs):
        for d, _, n in segments:  # the tensor whose bytes the piece starts in
            at = bisect.bisect_right(starts, (d, count)) - 1
            events.append(("piece", starts[at][1], n))
        events.extend(("copied", number[id(d)], 0) for d in dsts)
        return real_run(segments, dsts, srcs)

    monkeypatch.setattr(batch_copy.Expected, "check", check)
    monkeypatch.setattr(host_copy, "_run", run)
    for _ in range(2):  # the second time with the buffers' description kept
        events.clear()
        out = batch_copy.copy_into(src, buf, descriptions=known)
        assert all(out[k] is buf[k] and torch.equal(buf[k], v) for k, v in src.items())
        checked_to = 0
        copied, pieces = set(), []
        for kind, i, n in events:
            if kind == "checked":
                assert i == checked_to  # in order, each tensor once
                checked_to = n
                continue
            assert i < checked_to, events[-20:]  # never ahead of the checks
            if kind == "piece":
                pieces.append((i, n))
            else:
                copied.add(i)
        assert checked_to == count and len(events) > 2
        large = {i for i, n in enumerate(sizes) if 4 * n >= host_copy.MEMCPY_MIN_BYTES}
        assert copied == set(range(count)) - large
        assert {i for i, _ in pieces} == large
        assert sum(n for i, n in pieces if i == 2500) == 4 * sizes[2500]
        assert max(n for _, n in pieces) <= host_copy._SEGMENT_PIECE_BYTES
    for bad in (
        dict(src, t4990=src["t4990"].reshape(1, -1)),  # same bytes, another shape
        dict(src, t10=src["t10"].double()),
    ):
        with pytest.raises(batch_copy.Mismatch):
            batch_copy.copy_into(bad, buf, descriptions=known)
    for t in buf.values():
        t.zero_()
    batch_copy.copy_into(src, buf, descriptions=known)
    assert all(torch.equal(buf[k], v) for k, v in src.items())


def _trained_state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}  # an OrderedDict inside


def test_a_modules_state_dict_takes_the_batched_paths(tmp_path, monkeypatch):
    """``nn.Module.state_dict()`` is an OrderedDict, the commonest state there is: staging and
    the memory tier copy it in one batch, not by torch's per-tensor walk (or a new plan every
    snapshot), and what they copy is the state."""
    from dcp_tiered.staging import DoubleBufferStager
    from dcp_tiered.tiers import memory_copy
    from dcp_tiered.tiers.memory import MemoryTier

    state = _trained_state()
    walked = []
    monkeypatch.setattr(
        _torch_compat, "copy_state_dict", lambda *a, **k: walked.append(1) or {}
    )  # the general path: must not be taken
    stager = DoubleBufferStager(share_memory=False, timeout_secs=10)
    for _ in range(3):  # allocated, then reused from each of the two buffer sets
        staged = stager.stage(state)
        stager.after_execute()
        assert not walked
        assert torch.equal(staged["model"]["0.weight"], state["model"]["0.weight"])
        assert staged["model"]["0.weight"] is not state["model"]["0.weight"]
        assert staged["optim"]["param_groups"] == state["optim"]["param_groups"]
    tier = MemoryTier(tmp_path / "shm", 0)
    planned = []
    real_plan = memory_copy.plan
    monkeypatch.setattr(
        memory_copy, "plan", lambda *a, **k: planned.append(p := real_plan(*a, **k)) or p
    )
    try:
        for i in range(4):  # each slot planned once, then its plan reused
            tier.save(f"step-{i}", state).result()
        assert len(planned) == 2 and all(p is not None for p in planned)
        back = {
            "model": type(state["model"])(
                (k, torch.zeros_like(v)) for k, v in state["model"].items()
            ),
            "optim": _trained_state()["optim"],
        }
        tier.load("step-3", back)
    finally:
        tier.close()
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())


def test_an_unchanged_structure_reuses_the_local_plan_and_its_split_into_files(
    tmp_path, monkeypatch
):
    made = counted_calls(monkeypatch, default_planner, "create_default_local_save_plan")
    splits = counted_calls(monkeypatch, item_writer, "split_by_size")
    writer = TieredStorageWriter(tmp_path, thread_count=2)
    state = {"w": torch.ones(4, 3), "opt": {"m": torch.zeros(4, 3), "step": 1}}

    def save(step: str, sd: dict) -> None:
        planner = TieredSavePlanner(enable_plan_caching=True, cache_key=f"test@{tmp_path}")
        dcp.save(sd, checkpoint_id=step, storage_writer=writer, planner=planner, no_dist=True)

    save("step-1", state)
    save("step-2", {"w": torch.full((4, 3), 2.0), "opt": {"m": torch.ones(4, 3), "step": 2}})
    assert len(made) == 1  # the second save reused the plan
    assert len(splits) == 1  # and DCP's cached final plan: its items split as before
    grown = {"w": torch.full((5, 3), 3.0), "opt": {"m": torch.ones(5, 3), "step": 3}}
    save("step-3", grown)
    assert len(made) == 2  # a new shape: planned again
    assert len(splits) == 2
    assert len(list((tmp_path / "step-3").glob("*.distcp"))) == 2  # one file per thread
    for step, want in (("step-2", 2.0), ("step-3", 3.0)):
        shape = (4, 3) if step == "step-2" else (5, 3)
        out = {"w": torch.zeros(shape), "opt": {"m": torch.zeros(shape), "step": 0}}
        dcp.load(
            out, checkpoint_id=step, storage_reader=TieredStorageReader(tmp_path), no_dist=True
        )
        assert torch.equal(out["w"], torch.full(shape, want))
        assert out["opt"]["step"] == int(want)


def test_the_load_planner_makes_dcps_read_items_without_its_search(tmp_path, monkeypatch):
    src = {"w": torch.ones(4, 3), "o": {"m": torch.zeros(7), "step": 3}, "s": torch.tensor(1.0)}
    writer = TieredStorageWriter(tmp_path)
    dcp.save(src, checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    reader = TieredStorageReader(tmp_path)
    reader.reset("step-1")
    metadata = reader.read_metadata()

    def plan(planner, state):
        planner.set_up_planner(state, metadata, True)
        sent = planner.create_local_plan()  # what DCP gathers to the coordinator
        if isinstance(planner, TieredLoadPlanner):
            assert sent.items == []  # the whole reads stay on this rank
        return planner.finish_plan(planner.create_global_plan([sent])[0]).items

    searched = counted_calls(monkeypatch, default_planner, "create_default_local_load_plan")
    target = {"w": torch.zeros(4, 3), "o": {"m": torch.ones(7), "step": 0}, "s": torch.tensor(0.0)}
    mine = TieredLoadPlanner()
    ours = plan(mine, target)
    assert searched == []
    dcps = plan(default_planner.DefaultLoadPlanner(), target)
    assert len(searched) == 1
    # the plain tensors are left to the reader that returned the metadata (whole_reads): the
    # read items made are DCP's, less those
    left = mine.column_targets() or {}
    assert sorted(left) == ["o.m", "s", "w"]
    assert ours == [item for item in dcps if item.dest_index.fqn not in left]
    dcp.load(target, storage_reader=TieredStorageReader(tmp_path), planner=TieredLoadPlanner(),
             checkpoint_id="step-1", no_dist=True)  # fmt: skip
    assert torch.equal(target["w"], src["w"]) and target["o"]["step"] == 3
    with pytest.raises(ValueError, match="Size mismatch"):  # DCP's own check, as before
        plan(TieredLoadPlanner(), {"w": torch.zeros(5, 3)})


def test_a_batched_copy_keeps_no_buffers_alive():
    """Descriptions live with their owner: buffers dropped by it (a writer closed, a new
    structure staged) are freed, whatever batch_copy saw of them."""
    import gc
    import weakref

    src = {f"w{i}": torch.ones(4) for i in range(10)}
    buf = {f"w{i}": torch.zeros(4) for i in range(10)}
    gone = weakref.ref(buf["w3"])
    known = batch_copy.new_descriptions()
    batch_copy.copy_into(src, buf, descriptions=known)
    batch_copy.copy_into(src, buf)
    del buf, known
    gc.collect()
    assert gone() is None


def test_a_full_disk_while_writing_one_data_file_names_that_file(tmp_path, monkeypatch):
    """The files are written side by side and closed together: the typed error still names
    the file whose write failed, not the last one opened."""
    src = _state()
    src.update({f"w{i}": torch.randn(100_000) for i in range(4)})
    writer = TieredStorageWriter(tmp_path, thread_count=2)
    real_write = _datafile.write_file

    def first_file_full(save, f, *args):
        if os.path.basename(f.name) == layout.data_file_name(0, 0):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(save, f, *args)

    monkeypatch.setattr(_datafile, "write_file", first_file_full)
    with pytest.raises(CheckpointException) as e:
        dcp.save(src, checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    error = failure(e)
    assert isinstance(error, InsufficientSpaceError), error
    names = sorted(p.name for p in (tmp_path).rglob("*.distcp"))
    assert names == []  # the temporary directory is gone with both files
    assert layout.data_file_name(0, 0) in str(error)
    assert layout.data_file_name(0, 1) not in str(error)
