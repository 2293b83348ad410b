"""The memory tier's chunk hashes: a tensor of several chunks is copied and hashed chunk by chunk
and a flipped byte in any of its chunks fails the restore, naming that chunk; snapshots of the
previous header version (CRC32C chunks) still restore; a hash this version does not know is a
ManifestError, not a corrupt snapshot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dcp_tiered import batch_copy
from dcp_tiered.errors import IntegrityError, ManifestError
from dcp_tiered.policy import memory_chunks
from dcp_tiered.policy import memory_format as fmt
from dcp_tiered.tiers import chunk_copy, memory_copy
from dcp_tiered.tiers.memory import MemoryTier

CHUNK = memory_chunks.CHUNK_BYTES


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(100, generator=g),
        # three and a half chunks, after a small tensor: a batch of its own, copied by chunks
        "big": torch.randn(CHUNK * 7 // 8, generator=g),
        "b": torch.randint(0, 9, (33,), generator=g),
        "c": torch.randn(5, 7, generator=g).t(),  # not contiguous: copied whole
    }


def _saved(tmp_path: Path) -> tuple[dict, Path, dict]:
    state = _state()
    tier = MemoryTier(tmp_path / "shm", 0)
    try:
        tier.save("step-1", {"model": state}).result()
    finally:
        tier.close()
    (path,) = (tmp_path / "shm" / "rank-0").glob("slot-*.json")
    return state, path, json.loads(path.read_bytes())


def _load(tmp_path: Path, state: dict) -> dict:
    out = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
    tier = MemoryTier(tmp_path / "shm", 0)
    try:
        tier.load("step-1", out)
    finally:
        tier.close()
    return out["model"]


def test_a_large_tensor_gets_a_batch_of_its_own():
    buffer = torch.zeros(8 * CHUNK, dtype=torch.uint8)
    small, big = buffer[:64], buffer[1024 : 1024 + 3 * CHUNK]
    after = buffer[1024 + 3 * CHUNK : 1024 + 3 * CHUNK + 64]
    steps = memory_copy.batches([small, big, after], buffer.data_ptr())
    assert steps == [(0, 1, 0), (1, 2, 3), (2, 3, 0)]


def test_a_snapshot_equals_its_state_whatever_crosses_batches_and_chunks(tmp_path):
    """Tensors of every size around the memcpy threshold, a batch and a chunk, non-contiguous and 0-d ones among
    them, restore bit-exact, and the chunk hashes are those of the slot's bytes."""
    g = torch.Generator().manual_seed(5)
    sizes = [1, 7, 1000, 131_071, 131_072, 131_073, 300_000, 1_048_575, 1_048_577, 3]
    state = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    state["bf"] = torch.randn(999, 77, generator=g).to(torch.bfloat16)
    state["nc"] = torch.randn(700, 900, generator=g).t()
    state["zero"] = torch.tensor(4.0)
    state["i8"] = torch.randint(-9, 9, (2 * CHUNK + 5,), generator=g, dtype=torch.int8)
    _saved_and_restored_four_times(tmp_path, state)


def _saved_and_restored_four_times(tmp_path: Path, state: dict) -> None:
    """Saved to both slots twice (the copy plans reused), each restored bit-exact."""
    tier = MemoryTier(tmp_path / "shm", 0)
    try:
        for n in range(4):
            now = {k: v + n if v.is_floating_point() else v for k, v in state.items()}
            tier.save(f"step-{n}", {"model": now}).result()
            out = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
            tier.load(f"step-{n}", out)
            assert all(torch.equal(out["model"][k], v) for k, v in now.items())
    finally:
        tier.close()


@pytest.mark.parametrize("where", [0.1, 0.5, 0.99])
def test_a_flipped_byte_in_any_chunk_of_a_large_tensor_fails_the_restore(tmp_path, where):
    state, header_path, header = _saved(tmp_path)
    assert header["version"] == fmt.VERSION and header["chunk_algorithm"] == "xxh3-64"
    restored = _load(tmp_path, state)
    assert all(torch.equal(restored[k], v) for k, v in state.items())
    entry = next(t for t in header["tensors"] if t["key"] == '["model", "big"]')
    at = entry["offset"] + int(entry["nbytes"] * where)
    data = header_path.with_suffix(".data")
    raw = bytearray(data.read_bytes())
    raw[at] ^= 0x40
    data.write_bytes(bytes(raw))
    start = at // CHUNK * CHUNK
    with pytest.raises(IntegrityError, match=f"bytes {start}-[0-9]+ .*big.*fails its checksum"):
        _load(tmp_path, state)


def _rewrite(header_path: Path, edit) -> None:
    body = json.loads(header_path.read_bytes())
    body.pop("header_checksum")
    edit(body)
    body["header_checksum"] = fmt._checksum(body)
    header_path.write_bytes(json.dumps(body).encode())


def test_a_version_2_snapshot_with_crc32c_chunks_still_restores(tmp_path):
    state, header_path, header = _saved(tmp_path)
    buffer = torch.from_file(
        str(header_path.with_suffix(".data")), size=header["data_size"], dtype=torch.uint8
    )
    crcs = [
        memory_chunks.checksum(buffer, i, CHUNK, header["data_size"], memory_chunks.CRC32C)
        for i in range(len(header["chunk_checksums"]))
    ]
    assert crcs != header["chunk_checksums"]

    def as_version_2(body: dict) -> None:
        body.update(version=2, chunk_checksums=crcs)
        del body["chunk_algorithm"]

    _rewrite(header_path, as_version_2)
    restored = _load(tmp_path, state)
    assert all(torch.equal(restored[k], v) for k, v in state.items())


def test_a_chunk_hash_this_version_does_not_know_is_a_manifest_error(tmp_path):
    _, header_path, _ = _saved(tmp_path)
    _rewrite(header_path, lambda body: body.update(chunk_algorithm="blake3"))
    with pytest.raises(ManifestError, match="'blake3'.*newer dcp_tiered"):
        fmt.decode_header(header_path.read_bytes(), where=str(header_path))


def test_the_copy_by_chunks_splits_at_chunk_ends_and_groups_small_tensors():
    """Large tensors in pieces that end where chunks end; the small tensors of a chunk that
    such pieces fill mostly are copied up front in one batch, those of a chunk of mostly small
    tensors by the chunk's own batch (hashed as it is filled)."""
    buffer = torch.zeros(5 * CHUNK, dtype=torch.uint8)
    small = [buffer[k * 64 : k * 64 + 40] for k in range(3)]  # beside a piece: up front
    big = buffer[CHUNK - 1000 : 2 * CHUNK + 1000]  # over two chunk ends: three pieces
    straddling = buffer[3 * CHUNK - 8 - 50 : 3 * CHUNK - 8]  # small, inside chunk 2: up front
    alone = [buffer[3 * CHUNK + k * 128 : 3 * CHUNK + k * 128 + 100] for k in range(2)]
    across = buffer[4 * CHUNK - 30 : 4 * CHUNK + 30]  # small, but over a chunk end: pieces
    empty = buffer[5:5]
    dsts = [big, *small, straddling, empty, *alone, across]
    planned = chunk_copy.plan(dsts, buffer.data_ptr(), 5 * CHUNK)
    assert planned is not None
    chunks = planned.chunks
    assert [(c.start, c.end) for c in chunks] == [(k * CHUNK, (k + 1) * CHUNK) for k in range(5)]
    assert chunks[0].pieces == (chunk_copy.Piece(0, 0, CHUNK - 1000, 1000),)
    assert chunks[1].pieces == (chunk_copy.Piece(0, 1000, CHUNK, CHUNK),)
    assert chunks[2].pieces == (chunk_copy.Piece(0, CHUNK + 1000, 2 * CHUNK, 1000),)
    assert chunks[3].pieces == (chunk_copy.Piece(8, 0, 4 * CHUNK - 30, 30),)
    assert chunks[4].pieces == (chunk_copy.Piece(8, 30, 4 * CHUNK, 30),)
    # chunk 3: 200 bytes of small tensors beside a 30-byte piece stay with their chunk
    assert [c.small.tensors for c in chunks] == [[], [], [], [6, 7], []]
    assert planned.up_front.tensors == [1, 2, 3, 4]
    assert planned.large.tensors == [0, 8] and planned.empty.tensors == [5]
    overlapping = [buffer[:100], buffer[50:150]]
    assert chunk_copy.plan(overlapping, buffer.data_ptr(), 3 * CHUNK) is None
    assert chunk_copy.plan([buffer[-10:]], buffer.data_ptr(), 3 * CHUNK - 20) is None


def test_small_tensors_copied_up_front_are_in_their_chunks_hashes():
    """The up-front batch is copied before either thread hashes a chunk: each chunk's hash
    is its bytes' hash after the copy, small tensors beside large pieces included."""
    g = torch.Generator().manual_seed(3)
    buffer = torch.zeros(3 * CHUNK, dtype=torch.uint8)
    big = buffer[256 : 256 + CHUNK + 4096]
    smalls = [buffer[k * 64 : k * 64 + 48] for k in range(4)]
    tail = buffer[CHUNK + 8192 : CHUNK + 8192 + 500]
    dsts = [*smalls, big, tail]
    srcs = [torch.randint(0, 255, (d.numel(),), generator=g, dtype=torch.uint8) for d in dsts]
    planned = chunk_copy.plan(dsts, buffer.data_ptr(), buffer.nbytes)
    assert planned is not None and planned.up_front.tensors == [0, 1, 2, 3, 5]
    done = chunk_copy.copy_and_checksum(buffer, dsts, srcs, planned)
    assert done is not None
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert [f.result() for f in done] == [
        memory_chunks.checksum(buffer, i, CHUNK, buffer.nbytes) for i in range(3)
    ]


def _state_of_every_size(g: torch.Generator) -> dict:
    # floats: around the memcpy threshold, the small and the large hashing steps, a chunk
    sizes = [1, 7, 1000, 16_383, 16_384, 16_385, 300_000, 524_287, 524_289, 1_048_575, 1_048_577, 3]
    state = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    state.update({f"s{i}": torch.randn(1 + 97 * i, generator=g) for i in range(400)})
    state["bf"] = torch.randn(999, 77, generator=g).to(torch.bfloat16)
    state["zero"] = torch.tensor(4.0)
    state["empty"] = torch.ones(0, 5)
    state["i8"] = torch.randint(-9, 9, (2 * CHUNK + 5,), generator=g, dtype=torch.int8)
    state["small_nc"] = torch.randn(30, 20, generator=g).t()  # small: copied by torch
    return state


@pytest.mark.parametrize("large_not_contiguous", [False, True])
def test_a_snapshot_copied_by_chunks_restores_bit_exact_with_the_slots_own_hashes(
    tmp_path, monkeypatch, large_not_contiguous
):
    """Tensors of every size around the memcpy threshold, both hashing steps and a chunk, over
    both slots twice: bit-exact, and each chunk's hash is the slot's own bytes' hash. A large
    non-contiguous tensor (no memcpy) sends the whole save the tensor-by-tensor way."""
    g = torch.Generator().manual_seed(7)
    state = _state_of_every_size(g)
    if large_not_contiguous:
        state["nc"] = torch.randn(700, 900, generator=g).t()
    calls = []
    real = chunk_copy.copy_and_checksum
    monkeypatch.setattr(
        chunk_copy, "copy_and_checksum", lambda *a, **k: calls.append(r := real(*a, **k)) or r
    )
    _saved_and_restored_four_times(tmp_path, state)
    assert len(calls) == 4
    assert all((c is None) == large_not_contiguous for c in calls)
    for header_path in (tmp_path / "shm" / "rank-0").glob("slot-*.json"):
        header = json.loads(header_path.read_bytes())
        size = header["data_size"]
        data = torch.from_file(str(header_path.with_suffix(".data")), size=size, dtype=torch.uint8)
        assert header["chunk_checksums"] == [
            memory_chunks.checksum(data, i, CHUNK, size)
            for i in range(memory_chunks.count(size, CHUNK))
        ]


_CHANGES = {
    # tensors of the plan replaced by others the copy by chunks must not take for them: each
    # is caught by the thread that copies it, and the snapshot laid out again
    "small, first chunk": lambda s: dict(s, t1=torch.randn(8)),
    "small, same bytes, other dtype": lambda s: dict(s, s5=s["s5"].view(torch.int32)),
    "small, last chunk": lambda s: dict(s, small_nc=torch.randn(31, 20)),
    "large, same bytes, other shape": lambda s: dict(s, i8=s["i8"].reshape(-1, 1)),
    "large, same bytes, other dtype": lambda s: dict(s, t10=s["t10"].view(torch.int32)),
    "large, fewer bytes": lambda s: dict(s, t8=torch.randn(1000)),
    "empty, other shape": lambda s: dict(s, empty=torch.ones(0, 6)),
}


@pytest.mark.parametrize("change", list(_CHANGES))
def test_a_tensor_changed_anywhere_since_the_plan_is_caught_by_the_copy(
    tmp_path, monkeypatch, change
):
    """Once both slots have their plans, a save checks a dict of tensors' structure only; the
    copy by chunks checks each tensor's shape and dtype as it copies it. A tensor changed in
    any chunk (or one of no bytes) is caught there, and the snapshot is laid out again: it
    restores the new state bit-exact, never the new bytes under the old shape or dtype."""
    g = torch.Generator().manual_seed(11)
    state = _state_of_every_size(g)
    outcomes = []
    real = chunk_copy.copy_and_checksum

    def recorded(*a, **k):
        try:
            done = real(*a, **k)
        except Exception as e:
            outcomes.append(type(e))
            raise
        outcomes.append(type(done))
        return done

    monkeypatch.setattr(chunk_copy, "copy_and_checksum", recorded)
    changed = _CHANGES[change](state)
    tier = MemoryTier(tmp_path / "shm", 0)
    try:
        for n, now in enumerate([state, state, changed, changed]):
            tier.save(f"step-{n}", {"model": now}).result()
            out = {"model": {k: torch.zeros_like(v) for k, v in now.items()}}
            tier.load(f"step-{n}", out)
            assert all(torch.equal(out["model"][k], v) for k, v in now.items())
            assert all(out["model"][k].dtype == v.dtype for k, v in now.items())
    finally:
        tier.close()
    # planned twice, then the change caught by the copy of each slot's plan, which a new
    # layout replaced: its copy by chunks then ran
    assert outcomes == [list, list, batch_copy.Mismatch, list, batch_copy.Mismatch, list]


def test_a_parameter_among_the_small_tensors_is_copied_without_autograd(tmp_path):
    """Small tensors beside a large one are copied up front, outside the copy threads: a
    parameter among them must not make its slot view part of an autograd graph (one node
    more a save, each holding the parameter)."""
    import gc
    import weakref

    param = torch.nn.Parameter(torch.randn(8))
    empty = torch.nn.Parameter(torch.ones(0))
    state = {"p": param, "empty": empty, "big": torch.randn(CHUNK // 16)}  # p: up front
    tier = MemoryTier(tmp_path / "shm", 0)
    try:
        for n in range(3):
            tier.save(f"step-{n}", {"model": state}).result()
        out = {"model": {k: torch.zeros_like(v).detach() for k, v in state.items()}}
        tier.load("step-2", out)
        assert torch.equal(out["model"]["p"], param.detach())
        alive = weakref.ref(param)
        del state, param, empty
        gc.collect()
        assert alive() is None  # nothing of the tier's holds it
    finally:
        tier.close()
