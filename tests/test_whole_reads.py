"""Whole reads into plain CPU targets: the stored bytes are copied straight into the target's
memory (no per-item tensor views), bit-exact for every dtype and any alignment of the item in
its file; a target of another dtype, a non-contiguous one, or a planner that does not vouch
for its targets gets DCP's own conversion and copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from dcp_tiered import TieredLoadPlanner, TieredStorageReader, TieredStorageWriter
from dcp_tiered import reader_checks
from dcp_tiered.reader import _local


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {}
    # odd sizes first, so later items start at every alignment in the file
    for i, dtype in enumerate(
        [torch.int8, torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.complex128]
    ):
        for n in (1, 3, 7, 0, 33):
            value = (torch.randn(n, 2, generator=g) * 50).to(dtype)
            if dtype.is_complex:  # a nonzero imaginary part: a conjugate view would show it
                value = value + 1j * torch.randn(n, 2, generator=g, dtype=torch.float64)
            out[f"t{i}.{n}"] = value
    out["bool"] = torch.rand(17, generator=g) > 0.5
    out["scalar"] = torch.tensor(7.25)
    return out


@pytest.fixture
def saved(tmp_path):
    with TieredStorageWriter(tmp_path, sync_files=False) as writer:
        dcp.save(_state(), checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    return tmp_path


def _copies(monkeypatch) -> list[int]:
    """The sizes of the straight copies of stored bytes into targets, as they happen."""
    calls: list[int] = []
    original = _local._straight_copy

    def counted(dst, src, nbytes):
        calls.append(nbytes)
        return original(dst, src, nbytes)

    monkeypatch.setattr(_local, "_straight_copy", counted)
    return calls


def _load(root, target, planner) -> None:
    dcp.load(
        target,
        checkpoint_id="step-1",
        storage_reader=TieredStorageReader(root),
        planner=planner,
        no_dist=True,
    )


def test_every_dtype_and_alignment_is_copied_straight_in_bit_exact(saved, monkeypatch):
    copies = _copies(monkeypatch)
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    _load(saved, target, TieredLoadPlanner())
    for k, v in _state().items():
        assert torch.equal(
            target[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)
        ), k
    empty = sum(1 for v in target.values() if not v.numel())  # no bytes: read as archives
    assert len(copies) == len(target) - empty  # every other item took the straight copy


def test_other_dtypes_and_layouts_are_converted_as_dcp_converts(saved, monkeypatch):
    copies = _copies(monkeypatch)
    state = _state()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    target["t3.33"] = torch.zeros(33, 2, dtype=torch.float64)  # saved as float32
    target["t4.7"] = torch.zeros(2, 7, dtype=torch.int64).t()  # not contiguous
    conj = torch.zeros(7, 2, dtype=torch.complex128).conj()  # its memory holds the conjugate
    target["t5.7"] = conj
    _load(saved, target, TieredLoadPlanner())
    assert target["t3.33"].dtype == torch.float64
    assert torch.equal(target["t3.33"], state["t3.33"].double())
    assert torch.equal(target["t4.7"], state["t4.7"])
    assert torch.equal(conj, state["t5.7"])  # its value, not its memory, is the saved one
    empty = sum(1 for v in target.values() if not v.numel())
    assert len(copies) == len(target) - 3 - empty  # those three went through DCP's copy_

    vanilla = {k: torch.zeros_like(v) for k, v in state.items()}
    copies.clear()
    _load(saved, vanilla, DefaultLoadPlanner())  # vouches for nothing: every item delivered
    assert all(torch.equal(vanilla[k], v) for k, v in state.items())
    assert copies == []


def test_a_flipped_byte_is_caught_before_it_reaches_the_target(saved, monkeypatch):
    data = next(p for p in (saved / "step-1").iterdir() if p.name.endswith(".distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    with pytest.raises(dcp.api.CheckpointException, match="IntegrityError|corrupt"):
        _load(saved, target, TieredLoadPlanner())


def test_a_planner_subclass_commits_every_whole_read_detached(saved, monkeypatch):
    """DCP's commit_tensor is a no-op, and is skipped; a subclass's own still sees every
    tensor item, after its bytes are in, detached (as DCP's reader hands them over), also
    when the state holds Parameters that require grad."""
    copies = _copies(monkeypatch)
    committed: dict[str, torch.Tensor] = {}

    class Recording(TieredLoadPlanner):
        def commit_tensor(self, read_item, tensor):
            committed[read_item.dest_index.fqn] = tensor.clone()
            assert not tensor.requires_grad

    state = _state()
    target = {
        k: torch.nn.Parameter(torch.zeros_like(v)) if v.is_floating_point() else torch.zeros_like(v)
        for k, v in state.items()
    }
    _load(saved, target, Recording())
    assert copies  # the straight copies ran, and were committed
    assert set(committed) == set(state)
    for k, v in state.items():
        assert torch.equal(committed[k], v), k
        assert torch.equal(target[k].detach(), v), k
    assert any(isinstance(t, torch.nn.Parameter) and t.requires_grad for t in target.values())


def test_a_storage_record_tail_is_read_in_place_as_it_is_checked_from_a_copy():
    def tail(sig: bytes, a: int, b: int, wide: bool) -> bytes:
        size = (
            (a.to_bytes(8, "little") + b.to_bytes(8, "little"))
            if wide
            else (a.to_bytes(4, "little") + b.to_bytes(4, "little"))
        )
        return sig + b"\0" * 4 + size

    cases = []
    for sig in (b"PK\x07\x08", b"PK\x07\x09"):
        for wide in (False, True):
            for a, b in ((96, 96), (96, 95), (95, 96)):
                for pad in (b"", b"x" * 8, b"PK\x03\x04" + b"\0" * 30):
                    cases.append(tail(sig, a, b, wide) + pad)
    cases += [b"", b"PK\x07\x08", tail(b"PK\x07\x08", 96, 96, False)[:15]]
    for case in cases:
        buf = memoryview(b"\xaa" * 5 + case + b"\xbb" * 3)
        for end in (5 + len(case), len(buf)):
            expected = reader_checks.storage_tail_ok(buf[5:end], 96)
            assert reader_checks.storage_tail_at(buf, 5, end, 96) == expected, (case, end)
            # a block's tails checked at once: never yes where one at a time says no, and
            # yes for every 32-bit record (a zip64 one is left to the check one at a time)
            at_once = reader_checks.storage_tails_ok(
                buf, np.array([5]), np.array([end]), np.array([96])
            ).tolist()[0]
            assert at_once == (expected and not (wide_record(case) and not narrow(case))), case


def wide_record(case: bytes) -> bool:
    return (
        len(case) >= 24
        and case[8:16] == (96).to_bytes(8, "little") * 1
        and case[:4] == b"PK\x07\x08"
    )


def narrow(case: bytes) -> bool:
    return (
        len(case) >= 16
        and case[:4] == b"PK\x07\x08"
        and case[8:16] == (96).to_bytes(4, "little") * 2
    )


def test_a_block_of_tails_is_checked_item_by_item():
    """Many items of one block: each item's answer is its own (a bad one among good ones,
    one whose record would pass the block's end, one at the block's very end)."""
    good = b"PK\x07\x08" + b"\0" * 4 + (64).to_bytes(4, "little") * 2
    bad = b"PK\x07\x08" + b"\0" * 4 + (64).to_bytes(4, "little") + (63).to_bytes(4, "little")
    block = memoryview(b"".join([b"\1" * 64 + good, b"\1" * 64 + bad, b"\1" * 64 + good]))
    pos = np.array([64, 144, 224, 224, -1])
    ends = np.array([80, 160, 240, 239, 80])
    got = reader_checks.storage_tails_ok(block, pos, ends, np.full(5, 64)).tolist()
    assert got == [True, False, True, False, False]


def _section_edit(saved, edit) -> None:
    from tests import _manifests

    _manifests.tamper(saved / "step-1", edit_section=lambda s: [edit(f) for f in s["files"]])


@pytest.mark.parametrize(
    "case",
    [
        "upper-case CRCs",
        "a CRC that is not hex",
        "raw offsets one byte on",
        "raw offsets one byte back",
    ],
)
def test_a_section_that_lies_about_whole_reads_is_caught_naming_the_item(saved, case, monkeypatch):
    """The section (resealed) misstates items that the reader reads by columns: each such
    item fails its check there and the general path names it; no target gets the bytes of
    an item placed wrong (a CRC of digits only reads the same in upper case)."""
    copies = _copies(monkeypatch)

    def edit(f: dict) -> None:
        if case == "upper-case CRCs":
            f["crcs"] = f["crcs"].upper()
        elif case == "a CRC that is not hex":
            f["crcs"] = "zz" + f["crcs"][2:]
        else:
            step = 1 if case.endswith("on") else -1
            f["raw"] = [r + step if r > 0 else r for r in f["raw"]]

    _section_edit(saved, edit)
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    with pytest.raises(dcp.api.CheckpointException, match="IntegrityError"):
        _load(saved, target, TieredLoadPlanner())
    if case.startswith("raw"):
        assert copies == []  # every item was refused before any copy


def _planned(monkeypatch) -> list[list[str]]:
    """The fqns of the read items of each plan DCP hands a reader, as loads run."""
    plans: list[list[str]] = []
    original = TieredLoadPlanner.finish_plan

    def finish(self, new_plan):
        plan = original(self, new_plan)
        plans.append([item.dest_index.fqn for item in plan.items])
        return plan

    monkeypatch.setattr(TieredLoadPlanner, "finish_plan", finish)
    return plans


def test_whole_tensors_are_left_to_our_reader_and_every_one_is_read(saved, monkeypatch):
    """With our reader, the plan holds no read item for a tensor copied straight in (the
    reader reads it from the manifest's columns); every value still arrives, bit-exact."""
    plans, copies = _planned(monkeypatch), _copies(monkeypatch)
    state = _state()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    target["t3.33"] = torch.zeros(33, 2, dtype=torch.float64)  # converted: a read item
    _load(saved, target, TieredLoadPlanner())
    (planned,) = plans
    assert planned == ["t3.33"]
    assert torch.equal(target.pop("t3.33"), state.pop("t3.33").double())
    empty = sum(1 for v in state.values() if not v.numel())
    assert len(copies) == len(state) - empty
    for k, v in state.items():
        assert torch.equal(target[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))


def test_another_reader_gets_a_read_item_for_every_tensor(saved, monkeypatch):
    """DCP's own reader (our steps stay vanilla-readable) with our planner: nothing is left
    to a reader that never offered to read it."""
    plans = _planned(monkeypatch)
    state = _state()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(
        target,
        storage_reader=dcp.FileSystemReader(saved / "step-1"),
        planner=TieredLoadPlanner(),
        no_dist=True,
    )
    (planned,) = plans
    assert sorted(planned) == sorted(state)
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_one_planner_and_one_reader_serve_loads_of_two_steps(saved):
    with TieredStorageWriter(saved, sync_files=False) as writer:
        doubled = {k: v * 2 if v.dtype != torch.bool else ~v for k, v in _state().items()}
        dcp.save(doubled, checkpoint_id="step-2", storage_writer=writer, no_dist=True)
    planner, reader = TieredLoadPlanner(), TieredStorageReader(saved)
    for step, expected in (("step-1", _state()), ("step-2", doubled), ("step-1", _state())):
        target = {k: torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(target, checkpoint_id=step, storage_reader=reader, planner=planner, no_dist=True)
        assert all(torch.equal(target[k], v) for k, v in expected.items()), step
