"""Many small tensors: the data path's cost follows bytes, not items (issue 21), and every item
is still a torch.save record at its byte range, verified on load."""

from __future__ import annotations

import json

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import TieredStorageReader, TieredStorageWriter
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.errors import IntegrityError
from tests import _manifests as manifests

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

COUNT = 400


def small_state() -> dict[str, torch.Tensor]:
    """Every dtype a model holds, tiny to a few KiB, with a few large ones between them."""
    torch.manual_seed(21)
    state: dict[str, torch.Tensor] = {}
    for i in range(COUNT):
        kind = i % 8
        if kind == 0:
            t = torch.randn(1 + i % 37)
        elif kind == 1:
            t = torch.randn(i % 13 + 1, 3).to(torch.bfloat16)
        elif kind == 2:
            t = torch.randint(-9, 9, (i % 5 + 1,), dtype=torch.int64)
        elif kind == 3:
            t = torch.rand(7) > 0.5  # bool
        elif kind == 4:
            t = torch.tensor(float(i))  # 0-dim, 4 bytes
        elif kind == 5:
            t = torch.zeros(16)  # as many zero bytes as torch.save's own padding
        elif kind == 6:
            t = torch.randn(i % 300 + 1, dtype=torch.float64)
        else:
            t = torch.randn(3000) if i % 80 == 7 else torch.empty(0)
        state[f"p{i}"] = t
    return state


def save(root, step: str, state: dict) -> None:
    writer = TieredStorageWriter(root, sync_files=False)
    dcp.save(state, storage_writer=writer, checkpoint_id=step, no_dist=True)


def load(root, step: str, state: dict) -> dict:
    out = {k: torch.full_like(v, 7) for k, v in state.items()}
    dcp.load(out, storage_reader=TieredStorageReader(root), checkpoint_id=step, no_dist=True)
    return out


def test_small_tensors_are_placed_in_place_and_load_bit_exact(tmp_path):
    src = small_state()
    save(tmp_path, "step-1", src)
    placed = {i["fqn"] for i in manifests.items(tmp_path / "step-1") if i["raw_offset"] is not None}
    nonempty = {k for k, v in src.items() if v.numel()}
    assert placed == nonempty  # every non-empty tensor, however small, is located
    for reader in (TieredStorageReader(tmp_path), FileSystemReader(tmp_path / "step-1")):
        out = {k: torch.full_like(v, 7) for k, v in src.items()}
        dcp.load(out, storage_reader=reader, no_dist=True)
        for k, v in src.items():
            assert out[k].dtype == v.dtype and torch.equal(out[k], v), k


def test_item_and_file_checksums_are_those_of_the_bytes_on_disk(tmp_path):
    save(tmp_path, "step-1", small_state())
    files = manifests.files(tmp_path / "step-1")
    data = {name: (tmp_path / "step-1" / name).read_bytes() for name in files}
    for name, entry in files.items():
        assert int(entry["size"]) == len(data[name])
        assert entry["checksum"] == f"{crc32c.crc32c(data[name]):08x}"
    for item in manifests.items(tmp_path / "step-1"):
        raw = data[item["file"]][item["offset"] : item["offset"] + item["length"]]
        assert item["checksum"] == f"{crc32c.crc32c(raw):08x}", item["fqn"]


def test_a_flipped_byte_in_a_small_tensor_is_caught(tmp_path):
    src = small_state()
    save(tmp_path, "step-1", src)
    entry = next(
        i for i in manifests.items(tmp_path / "step-1") if i["fqn"] == "p9"
    )  # a bf16 tensor of a few bytes
    path = tmp_path / "step-1" / entry["file"]
    data = bytearray(path.read_bytes())
    data[entry["offset"] + entry["raw_offset"]] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as e:
        load(tmp_path, "step-1", src)
    (failure,) = e.value.failures.values()
    failure = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback)
    assert isinstance(failure, IntegrityError) and "'p9'" in str(failure)


def test_a_restore_reads_many_small_items_in_few_reads(tmp_path, monkeypatch):
    """One read per run of neighbouring items, not one (or three) per item."""
    src = small_state()
    save(tmp_path, "step-1", src)
    reads = []
    original = LocalBackend.read_range_into

    def counting(f, offset, buffer):
        reads.append(len(buffer))
        return original(f, offset, buffer)

    monkeypatch.setattr(LocalBackend, "read_range_into", staticmethod(counting))
    out = load(tmp_path, "step-1", src)
    assert all(torch.equal(out[k], v) for k, v in src.items())
    assert 0 < len(reads) <= 8, len(reads)


def test_a_partial_restore_of_a_few_items_reads_only_near_them(tmp_path, monkeypatch):
    src = small_state()
    save(tmp_path, "step-1", src)
    reads = []
    original = LocalBackend.read_range_into

    def counting(f, offset, buffer):
        reads.append(len(buffer))
        return original(f, offset, buffer)

    monkeypatch.setattr(LocalBackend, "read_range_into", staticmethod(counting))
    wanted = {k: torch.zeros_like(src[k]) for k in ("p0", "p399")}
    dcp.load(wanted, storage_reader=TieredStorageReader(tmp_path), no_dist=True)
    assert torch.equal(wanted["p0"], src["p0"]) and torch.equal(wanted["p399"], src["p399"])
    total = sum(f.stat().st_size for f in (tmp_path / "step-1").glob("__*"))
    assert sum(reads) < total / 4, (sum(reads), total)


@pytest.mark.parametrize(
    "sizes",
    [
        [[10, 9 * 2**20], [300, 2**20, 5]],  # folded (>= 8 MiB), passed through, buffered
        [[7] * 3000, [0], [4096, 2**20 - 1], [3 * 2**20]],  # flushes between items
    ],
)
def test_checksumming_writer_crcs_match_the_bytes(sizes):
    """Item and file CRCs stay those of the bytes, however writes are buffered or folded."""
    import io
    import random

    from dcp_tiered.policy import integrity

    rnd = random.Random(21)
    raw = io.BytesIO()
    out = integrity.ChecksummingWriter(raw)
    out.BUFFER_BYTES = 64 * 2**10  # flush often
    items = []
    for item in sizes:
        chunks = [rnd.randbytes(n) for n in item]
        start = out.start_item()
        for c in chunks:
            out.write(c)
        items.append((start, out.position - start, out.item_crc))
    out.close()
    data = raw.getvalue()
    assert len(data) == out.position and out.file_crc == crc32c.crc32c(data)
    for start, length, crc in items:
        assert crc == crc32c.crc32c(data[start : start + length])
    for n1, n2 in [(0, 0), (0, 5), (5, 0), (100, 2**20), (7, 3 * 2**20 + 13)]:
        a, b = rnd.randbytes(n1), rnd.randbytes(n2)
        assert integrity.combine(crc32c.crc32c(a), crc32c.crc32c(b), n2) == crc32c.crc32c(a + b)


def test_memory_tier_snapshots_reuse_their_layout_and_stay_exact(tmp_path):
    """Snapshots into reused slots take each save's values; a new structure gets a new
    layout; a flipped byte in a small tensor fails its restore."""
    from dcp_tiered.tiers.memory import MemoryTier

    src = small_state()
    tier = MemoryTier(tmp_path / "shm", 0)
    try:
        for n in range(4):  # both slots twice: the second round reuses their views
            state = {k: v + n if v.dtype != torch.bool else v ^ bool(n % 2) for k, v in src.items()}
            tier.save(f"step-{n}", {"model": state, "n": n}).result()
            out = {"model": {k: torch.full_like(v, 7) for k, v in src.items()}, "n": -1}
            tier.load(f"step-{n}", out)
            assert out["n"] == n
            assert all(torch.equal(out["model"][k], v) for k, v in state.items())
        grown = {**src, "p0": torch.randn(99)}  # another shape: another layout
        tier.save("step-9", {"model": grown}).result()
        out = {"model": {k: torch.zeros_like(v) for k, v in grown.items()}}
        tier.load("step-9", out)
        assert all(torch.equal(out["model"][k], v) for k, v in grown.items())
    finally:
        tier.close()
    rank_dir = tmp_path / "shm" / "rank-0"
    for slot in (0, 1):
        header = json.loads((rank_dir / f"slot-{slot}.json").read_text())
        if header["step"] == "step-9":
            data = rank_dir / f"slot-{slot}.data"
            break
    entry = next(t for t in header["tensors"] if t["key"] == '["model", "p9"]')
    raw = bytearray(data.read_bytes())
    raw[entry["offset"]] ^= 0x01
    data.write_bytes(bytes(raw))
    # the slot is checked by chunks: the error names the chunk's byte range
    chunk = entry["offset"] // header["chunk_bytes"] * header["chunk_bytes"]
    with pytest.raises(IntegrityError, match=f"bytes {chunk}-[0-9]+ .*fails its checksum"):
        MemoryTier(tmp_path / "shm", 0).load(
            "step-9", {"model": {k: torch.zeros_like(v) for k, v in grown.items()}}
        )


def test_a_memory_tier_restore_of_many_tensors_runs_no_garbage_collection(tmp_path):
    """A restore decodes both slots' headers (an object per tensor each) and fills the state:
    with the collector on, each burst set off full collections that walk every live object
    (a 20,000-tensor restore from memory: 2.0 s, 1.1 s of it collecting). None runs during a
    restore now, and the collector is left on as it was found."""
    import gc

    from dcp_tiered.tiers.memory import MemoryTier

    state = {f"w{i}": torch.full((3,), float(i)) for i in range(5000)}
    tier = MemoryTier(tmp_path / "shm", 0)
    runs: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])

    try:
        for n in range(2):  # both slots hold a header of 5,000 tensors
            tier.save(f"step-{n}", {"model": state}).result()
        out = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
        assert gc.isenabled()
        gc.collect()  # none due from earlier tests: what follows is the load's own
        gc.callbacks.append(count)
        try:
            tier.load("step-1", out)
        finally:
            gc.callbacks.remove(count)
        assert gc.isenabled()
    finally:
        tier.close()
    assert runs in ([], [0])  # a young collection may start as the pause ends (its count
    # includes what the paused work allocated), over the few objects still alive then
    assert all(torch.equal(out["model"][k], v) for k, v in state.items())


def test_a_manager_restore_from_disk_of_many_tensors_runs_no_garbage_collection(tmp_path):
    """The manager's restore is one ``dcp.load`` with the collector paused throughout: the
    load's objects (a few per tensor) die with it instead of being moved on by the young
    collections between its phases into the old generation, where they set off full
    collections over every live object (20,000 tensors: about a second, one load in two or
    three). The collector is left on as it was found."""
    import gc

    from dcp_tiered import CheckpointManager, Every, SavePolicy

    state = {f"w{i}": torch.full((3,), float(i)) for i in range(5000)}
    policy = SavePolicy(local=Every(steps=1))
    with CheckpointManager(local=tmp_path / "ck", policy=policy) as mgr:
        mgr.save(1, {"model": state})
    out = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
    runs: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])

    with CheckpointManager(local=tmp_path / "ck", policy=policy) as mgr:
        assert gc.isenabled()
        gc.collect()  # none due from earlier tests: what follows is the restore's own
        gc.callbacks.append(count)
        try:
            assert mgr.restore(out) == 2
        finally:
            gc.callbacks.remove(count)
        assert gc.isenabled()
    assert runs in ([], [0])  # a young collection may start as the pause ends (its count
    # includes what the paused work allocated), over the few objects still alive then
    assert all(torch.equal(out["model"][k], v) for k, v in state.items())
