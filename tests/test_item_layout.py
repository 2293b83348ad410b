"""Repeated saves of one structure write their data files from a kept layout (issue 30):
the same bytes as framing every item anew, every step loadable by vanilla DCP and by our
reader (which checks each item's CRC32C against the manifest), and a state that no longer
matches the layout is framed anew rather than written wrong."""

from __future__ import annotations

import io
import json
from collections import OrderedDict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import (
    TieredSavePlanner,
    TieredStorageReader,
    TieredStorageWriter,
    item_layout,
    item_writer,
)
from tests.test_save_load import failure


def _state(seed: int) -> dict:
    """Every kind of item a layout handles: small and large tensors of several dtypes
    (under and over the copy threshold, one over the CRC-combining size), a 0-d, an empty
    and a non-contiguous one each side of the threshold, complex numbers, a bytes item."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(300, 256, generator=g)
    return {
        "small": {
            "f32": torch.randn(7, 5, generator=g),
            "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
            "i64": torch.randint(0, 1000, (11,), generator=g),
            "bool": torch.rand(13, generator=g) > 0.5,
            "zero_d": torch.tensor(float(seed)),
            "empty": torch.empty(0, 4),
            "strided": torch.randn(6, 8, generator=g).t(),
            "c64": torch.randn(5, dtype=torch.complex64, generator=g),
        },
        "large": {
            "f32": torch.randn(64, 100, generator=g),  # 25 KiB
            "f16": torch.randn(2**19 + 3, generator=g).half(),  # just over 1 MiB
            "strided": big.t(),
            "c64": torch.randn(4096, dtype=torch.complex64, generator=g),
        },
        "n": seed,
        "name": "run",
    }


def _blank(state: dict) -> dict:
    return {
        k: _blank(v) if isinstance(v, dict) else torch.zeros_like(v) if torch.is_tensor(v) else None
        for k, v in state.items()
    }


def _assert_equal(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, dict):
            _assert_equal(got[k], v)
        elif torch.is_tensor(v):
            want_values = v.resolve_conj().resolve_neg()
            assert got[k].dtype == v.dtype and torch.equal(got[k], want_values), k
        else:
            assert got[k] == v, k


def _loads_bit_exact(root, step: str, want: dict) -> None:
    out = _blank(want)
    dcp.load(out, storage_reader=FileSystemReader(root / step), no_dist=True)
    _assert_equal(out, want)
    out = _blank(want)
    dcp.load(out, checkpoint_id=step, storage_reader=TieredStorageReader(root), no_dist=True)
    _assert_equal(out, want)


class _Saver:
    def __init__(self, root, monkeypatch) -> None:
        self.root = root
        monkeypatch.setattr(item_layout, "_kept", OrderedDict())  # this test's layouts only
        self.writer = TieredStorageWriter(root, thread_count=2)
        self.framed: list[str] = []  # items framed one by one (DataFile), by fqn
        add = item_writer.DataFile.add
        monkeypatch.setattr(
            item_writer.DataFile,
            "add",
            lambda out, item, data: (self.framed.append(item.index.fqn), add(out, item, data)),
        )

    def save(self, step: str, state: dict) -> list[str]:
        """Saves ``state`` as ``step``; the fqns of the items framed one by one."""
        self.framed.clear()
        # keyed by the test's own root: a writer's id may be an earlier test's (DCP's plan
        # caches live as long as the process), whose plan the writer would then refuse
        planner = TieredSavePlanner(enable_plan_caching=True, cache_key=f"t@{self.root}")
        dcp.save(
            state, checkpoint_id=step, storage_writer=self.writer, planner=planner, no_dist=True
        )
        return list(self.framed)

    def data_files(self, step: str) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted((self.root / step).glob("*.distcp"))}

    def sections(self, step: str) -> list:
        """The manifest's per-file entries (sizes, file and item CRCs, offsets)."""
        files = []
        for p in sorted((self.root / step).glob("manifest.*.json")):
            files += json.loads(p.read_text())["files"]
        return files


def test_repeated_saves_write_the_bytes_and_checksums_of_framing_each_item(tmp_path, monkeypatch):
    saver = _Saver(tmp_path, monkeypatch)
    state = _state(1)
    assert saver.save("step-1", state)  # first sight of the plan's item lists: framed
    saver.save("step-2", state)  # seen again: the layout is made and written from
    assert saver.save("step-3", state) == []  # written from the kept layouts alone
    first = saver.data_files("step-1")
    assert len(first) == 2
    for step in ("step-2", "step-3"):
        assert saver.data_files(step) == first, step
        assert saver.sections(step) == saver.sections("step-1"), step
        _loads_bit_exact(tmp_path, step, state)


def test_new_values_every_save_load_bit_exact_with_vanilla_dcp_and_ours(tmp_path, monkeypatch):
    saver = _Saver(tmp_path, monkeypatch)
    state = _state(1)
    saver.save("step-0", state)
    for i in range(1, 5):
        new = _state(i + 10)
        # same structure, other memory: in place, fresh tensors, views and lazy conjugates
        for part in ("small", "large"):
            for name, t in state[part].items():
                if name == "strided":
                    state[part][name] = new[part][name]  # another non-contiguous view
                elif name == "c64" and i % 2:
                    state[part][name] = new[part][name].conj().conj().conj()  # conj bit set
                else:
                    t.copy_(new[part][name])
        state["n"] = 10 + i  # a bytes item of the same length
        framed = saver.save(f"step-{i}", state)
        if i >= 2:  # from the layouts: conjugates applied, views copied into place
            assert framed == [], framed
        _loads_bit_exact(tmp_path, f"step-{i}", state)


@pytest.mark.parametrize("change", ["bytes_length", "busy"])
def test_a_save_the_layout_cannot_take_is_framed_anew(tmp_path, monkeypatch, change):
    saver = _Saver(tmp_path, monkeypatch)
    state = _state(3)
    for step in ("step-1", "step-2"):
        saver.save(step, state)
    layouts = [k.layout for k in item_layout._kept.values() if k.layout is not None]
    assert len(layouts) == 2
    if change == "bytes_length":
        state["name"] = "r" * 5000  # serialises longer: the plan is the same, the layout not
        framed = saver.save("step-3", state)
        assert "name" in framed
        _loads_bit_exact(tmp_path, "step-3", state)
        saver.save("step-4", state)  # seen again after it was dropped: a new layout
        assert saver.save("step-5", state) == []
        _loads_bit_exact(tmp_path, "step-5", state)
    else:
        for layout in layouts:  # another save of the same plan is writing from them
            layout.busy.acquire()
        try:
            framed = saver.save("step-3", state)
        finally:
            for layout in layouts:
                layout.busy.release()
        assert len(framed) == len(state["small"]) + len(state["large"]) + 2  # every item
        assert saver.data_files("step-3") == saver.data_files("step-1")
        assert saver.save("step-4", state) == []  # the layouts were kept
    _loads_bit_exact(tmp_path, "step-4", state)


def test_a_layout_is_not_kept_past_its_staging_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(item_layout, "MAX_STAGING_BYTES", 4096)
    saver = _Saver(tmp_path, monkeypatch)
    state = _state(4)
    for step in ("step-1", "step-2", "step-3"):
        assert saver.save(step, state)  # always framed: no layout fits 4 KiB
    _loads_bit_exact(tmp_path, "step-3", state)


def test_a_lazy_conjugate_or_negation_restores_its_values_with_our_reader(tmp_path):
    """Their bytes are not their values: written as values (our reader views raw bytes)."""
    z = torch.randn(4096, dtype=torch.complex64)
    state = {
        "conj_small": torch.randn(5, dtype=torch.complex64).conj(),
        "conj_large": z.conj(),
        "neg": z.conj().imag,  # a view with the negative bit
    }
    assert state["conj_small"].is_conj() and state["neg"].is_neg()
    dcp.save(
        state, checkpoint_id="step-1", storage_writer=TieredStorageWriter(tmp_path), no_dist=True
    )
    _loads_bit_exact(tmp_path, "step-1", state)


def test_raw_views_are_a_saveable_tensors_bytes_in_place_or_none():
    """A tensor whose bytes are its values in row-major order gets a view of them where it
    lies (a row of a matrix, a Parameter, an odd stride on a size-1 dimension); every other
    one None, to be made plain first. A size other than the tensor's own is refused."""
    base = torch.randn(64, 100)
    z = torch.randn(2048, dtype=torch.complex64)
    cases = {
        "plain": (torch.randn(64, 100), True),
        "row_of_a_matrix": (base[3], True),
        "parameter": (torch.nn.Parameter(torch.randn(40, 100)), True),
        "requires_grad": (torch.randn(4000, requires_grad=True), True),
        "size_one_stride": (torch.randn(4096, 1).t(), True),  # (1, 4096), strides (1, 1)
        "transposed": (base.t(), False),
        "expanded": (torch.randn(1, 500).expand(8, 500), False),
        "conj": (z.conj(), False),
        "neg": (z.conj().imag, False),
        "meta": (torch.empty(5000, device="meta"), False),
        "empty": (torch.empty(0, 3), False),
    }
    tensors = [t for t, _ in cases.values()]
    sizes = [t.numel() * t.element_size() for t in tensors]
    views = item_writer.raw_views(tensors, sizes)
    for (name, (t, in_place)), view, n in zip(cases.items(), views, sizes):
        if not in_place:
            assert view is None, name
            continue
        assert view is not None and view.readonly, name
        plain = item_writer.as_saveable(t)
        assert bytes(view) == bytes(item_writer.memory_of(plain, n)), name
        assert view.nbytes == n, name
    assert item_writer.raw_views([base, base], [base.nbytes + 4, base.nbytes - 4]) == [None, None]


def test_a_large_tensor_in_place_anywhere_is_written_from_the_layout(tmp_path, monkeypatch):
    """A large tensor replaced by one of the same dtype and shape whose bytes lie elsewhere (a
    row of a bigger matrix, an odd stride on a size-1 dimension) is written from its own
    memory by the kept layout, not framed anew, and loads bit-exact by vanilla DCP and ours."""
    saver = _Saver(tmp_path, monkeypatch)
    state = {"a": torch.randn(64, 100), "b": torch.randn(1, 8192), "c": torch.randn(3), "n": 1}
    for step in ("step-1", "step-2"):
        saver.save(step, state)
    bigger = torch.randn(10, 64 * 100)
    state["a"] = bigger[3].view(64, 100)
    state["b"] = torch.randn(8192, 1).t()
    assert state["a"].storage_offset() and state["b"].stride() == (1, 1)
    assert saver.save("step-3", state) == []
    _loads_bit_exact(tmp_path, "step-3", state)
    state["a"] = torch.randn(100, 64).t()  # not in place: made plain, then the kept frame
    state["b"] = torch.randn(8192, 2)[:, 0].view(1, 8192)  # every other float: likewise
    assert not state["a"].is_contiguous() and not state["b"].is_contiguous()
    assert saver.save("step-4", state) == []
    _loads_bit_exact(tmp_path, "step-4", state)


@pytest.mark.parametrize("bytes_item", [True, False], ids=["with a bytes item", "tensors only"])
@pytest.mark.parametrize("which", ["small", "large"])
@pytest.mark.parametrize(
    "change", ["dtype", "shape", "class", "tensor for bytes", "bytes for tensor", "object", "none"]
)
def test_a_layout_writes_only_data_of_its_kinds_dtypes_and_shapes(
    tmp_path, change, which, bytes_item
):
    """A layout kept for one list of items writes nothing (None) for data that differs from
    what it was made of in any item's class, a tensor's dtype or shape (a bytes item's
    length: ``test_a_save_the_layout_cannot_take_is_framed_anew``): the caller frames such
    data anew (a small tensor copied into a slot of another dtype would be converted, and
    saved under its old frame). Data that matches is written."""
    if change == "tensor for bytes" and not bytes_item:
        pytest.skip("no bytes item")
    sizes = {"small": 40, "large": 5000}
    state = {"a": torch.ones(3, 2), "small": torch.zeros(40), "large": torch.zeros(5000)}
    planner = TieredSavePlanner()
    planner.set_up_planner({**state, "n": 7} if bytes_item else state, None, True)
    items = planner.create_local_plan().items
    data = planner.resolve_items(items)
    layout = item_layout.Layout(items, data)
    at = {item.index.fqn: k for k, item in enumerate(items)}
    new = list(data)
    k, n = at[which], sizes[which]
    if change == "dtype":
        new[k] = torch.zeros(n, dtype=torch.float64)
    elif change == "shape":
        new[k] = torch.zeros(n + 1)
    elif change == "class":
        new[k] = torch.nn.Parameter(torch.zeros(n))
    elif change == "tensor for bytes":
        new[at["n"]] = torch.zeros(1)
    elif change == "bytes for tensor":
        new[k] = io.BytesIO(b"x" * 4)
    elif change == "object":
        new[k] = object()
    staged = layout.stage(new)
    with open(tmp_path / "f", "wb") as f:
        written = None if staged is None else layout.write_staged(f, staged, writeback=False)
    if change == "none":
        assert written is not None and written.position == (tmp_path / "f").stat().st_size > 0
    else:
        assert written is None and (tmp_path / "f").stat().st_size == 0


def test_files_are_prepared_on_the_saving_thread_and_written_on_the_pool(tmp_path, monkeypatch):
    """The Python work per item (data looked up, checked against the layout, staged) runs on
    the thread that saves, one file after another; the writer threads only copy, checksum
    and write (calls that release the GIL)."""
    import threading

    saver = _Saver(tmp_path, monkeypatch)
    state = _state(4)
    for step in ("step-1", "step-2"):
        saver.save(step, state)
    seen: list[tuple[str, bool]] = []
    for name in ("stage", "write_staged"):
        real = getattr(item_layout.Layout, name)

        def spy(self, *a, _real=real, _name=name, **k):
            seen.append((_name, threading.current_thread() is threading.main_thread()))
            return _real(self, *a, **k)

        monkeypatch.setattr(item_layout.Layout, name, spy)
    assert saver.save("step-3", state) == []
    assert sorted(seen) == [("stage", True)] * 2 + [("write_staged", False)] * 2
    _loads_bit_exact(tmp_path, "step-3", state)


@pytest.mark.parametrize("failing", ["preparation", "thread start"])
def test_a_second_file_that_fails_leaves_both_layouts_free(tmp_path, monkeypatch, failing):
    """The second file fails after the first was handed to its thread, in its preparation or
    when it is handed over (the pool refuses it: its layout staged, never written): the save
    fails with that error, and both layouts are let go, so the next save of the same state
    writes both files from their layouts again."""
    from concurrent.futures import ThreadPoolExecutor

    from dcp_tiered.writer import _datafile

    saver = _Saver(tmp_path, monkeypatch)
    state = _state(5)
    for step in ("step-1", "step-2"):
        saver.save(step, state)
    staging = item_layout.Layout.stage
    if failing == "preparation":
        real, calls = staging, []

        def second_fails(self, tensors):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("the second file's data went away")
            return real(self, tensors)

        monkeypatch.setattr(item_layout.Layout, "stage", second_fails)
    else:

        class OneThread(ThreadPoolExecutor):
            def submit(self, *args, **kwargs):
                if self._threads:
                    raise RuntimeError("can't start new thread (went away)")
                return super().submit(*args, **kwargs)

        monkeypatch.setattr(_datafile, "ThreadPoolExecutor", OneThread)
    with pytest.raises(CheckpointException) as e:
        saver.save("step-3", state)
    assert "went away" in str(failure(e))
    assert not (tmp_path / "step-3").exists()
    layouts = [k.layout for k in item_layout._kept.values() if k.layout is not None]
    assert len(layouts) == 2 and not any(layout.busy.locked() for layout in layouts)
    monkeypatch.setattr(item_layout.Layout, "stage", staging)  # no failure from here on
    monkeypatch.setattr(_datafile, "ThreadPoolExecutor", ThreadPoolExecutor)
    assert saver.save("step-4", state) == []  # both from their layouts
    _loads_bit_exact(tmp_path, "step-4", state)


def test_a_file_job_is_written_once_and_lets_its_layout_go_once(tmp_path, monkeypatch):
    """The thread that writes a job takes its layout over: a later ``release`` (the saving
    thread giving up on the jobs it made) leaves the layout to whoever holds it next, and
    the job cannot be written again."""
    monkeypatch.setattr(item_layout, "_kept", OrderedDict())  # this test's layouts only
    state = {"a": torch.ones(3, 2), "b": torch.zeros(5000)}
    planner = TieredSavePlanner()
    planner.set_up_planner(state, None, True)
    items = planner.create_local_plan().items
    resolve = planner.resolve_items
    with open(tmp_path / "f0", "wb") as f:
        item_layout.prepare(items, resolve).write(f)  # seen once: no layout yet
    with open(tmp_path / "f1", "wb") as f:
        item_layout.prepare(items, resolve).write(f)  # the layout made
    kept = item_layout._kept[id(items)].layout
    assert kept is not None and not kept.busy.locked()
    job = item_layout.prepare(items, resolve)
    assert kept.busy.locked()  # staged: held for the write
    with open(tmp_path / "f2", "wb") as f:
        written = job.write(f)
    assert written.position == (tmp_path / "f2").stat().st_size
    assert not kept.busy.locked()
    other = item_layout.prepare(items, resolve)  # the next save's job holds it now
    job.release()  # the first job's saver gives up late: not the other's hold to drop
    assert kept.busy.locked()
    with pytest.raises(RuntimeError, match="written twice"):
        job.write(io.BytesIO())
    other.release()
    assert not kept.busy.locked()
    other.release()  # once only
