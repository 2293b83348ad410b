"""A restore checks each block of neighbouring small items with one CRC32C over its bytes,
against the CRC the manifest's item CRCs combine to (policy.region_crcs), before anything
from the block is copied into a target; a block that fails is checked item by item, which
names the item, reads it from the remote, or loads the items asked for when the bad bytes
are another item's. The combination is checked against crc32c of generated files."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import RemoteConfig, TieredLoadPlanner, TieredStorageReader, TieredStorageWriter
from dcp_tiered.errors import IntegrityError
from dcp_tiered.policy import integrity, region_crcs
from tests import _manifests as manifests

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# -- the combination, against crc32c of the bytes -------------------------------------------


@st.composite
def _files(draw):
    """Items back to back (1-300 bytes: an item holds an archive's framing at least), their
    bytes, and blocks of whole runs of them."""
    lengths = draw(st.lists(st.integers(1, 300), min_size=1, max_size=40))
    data = draw(st.binary(min_size=sum(lengths), max_size=sum(lengths)))
    offsets = np.cumsum([0] + lengths[:-1]).tolist()
    cuts = sorted(set(draw(st.lists(st.integers(0, len(lengths)), max_size=12))))
    blocks = [(offsets[a], offsets[b - 1] + lengths[b - 1]) for a, b in zip(cuts, cuts[1:])]
    return offsets, lengths, data, blocks


@settings(max_examples=200, deadline=None)
@given(_files(), st.randoms(use_true_random=False))
def test_each_block_gets_the_crc32c_of_its_bytes(f, rnd):
    offsets, lengths, data, blocks = f
    crcs = [crc32c.crc32c(data[o : o + n]) for o, n in zip(offsets, lengths)]
    order = list(range(len(offsets)))
    rnd.shuffle(order)  # the rows in any order
    got = region_crcs.block_crcs(
        np.asarray(offsets)[order],
        np.asarray(lengths)[order],
        np.asarray(crcs)[order],
        [s for s, _ in blocks],
        [e for _, e in blocks],
    )
    assert got.tolist() == [crc32c.crc32c(data[s:e]) for s, e in blocks]


def test_a_block_its_items_do_not_tile_gets_no_crc():
    offsets, lengths = np.array([0, 10, 20, 35]), np.array([10, 10, 10, 5])  # a gap at 30-35
    crcs = np.array([1, 2, 3, 4])
    got = region_crcs.block_crcs(offsets, lengths, crcs, [0, 5, 20, 0], [20, 20, 40, 10])
    assert got[0] >= 0 and got[3] == 1  # whole items; one item's CRC is its own
    assert got[1] == -1  # starts inside an item
    assert got[2] == -1  # across the gap
    overlap = region_crcs.block_crcs(np.array([0, 5]), np.array([10, 10]), crcs[:2], [0], [15])
    no_crc = region_crcs.block_crcs(offsets, lengths, np.array([1, -1, 3, 4]), [0], [30])
    assert overlap.tolist() == [-1] and no_crc.tolist() == [-1]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**40))
def test_shifting_a_crc_is_combining_it_with_that_many_bytes(a, b, n):
    (got,) = region_crcs.shifted(np.asarray([a], dtype=np.uint32), np.asarray([n]))
    assert int(got) ^ b == integrity.combine(a, b, n)


# -- restores ---------------------------------------------------------------------------------


def small_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = {}
    for i in range(300):
        dtype = (torch.float32, torch.bfloat16, torch.int64)[i % 3]
        out[f"p{i:03d}"] = (torch.randn(1 + i % 50, generator=g) * 9).to(dtype)
    return out


def _save(root, state, **kw) -> TieredStorageWriter:
    writer = TieredStorageWriter(root, sync_files=False, **kw)
    dcp.save(state, checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    return writer


def _load(root, target, **kw) -> TieredStorageReader:
    """A load as CheckpointManager runs it: whole tensors read by columns."""
    reader = TieredStorageReader(root, **kw)
    dcp.load(
        target,
        checkpoint_id="step-1",
        storage_reader=reader,
        planner=TieredLoadPlanner(reader=reader),
        no_dist=True,
    )
    return reader


def _flip(root, fqn: str) -> None:
    """One bit of ``fqn``'s stored tensor bytes flipped in its data file."""
    entry = next(i for i in manifests.items(root / "step-1") if i["fqn"] == fqn)
    path = root / "step-1" / entry["file"]
    data = bytearray(path.read_bytes())
    data[entry["offset"] + entry["raw_offset"]] ^= 0x04
    path.write_bytes(bytes(data))


def _counted_checksums(monkeypatch) -> list[int]:
    sizes: list[int] = []
    original = integrity.checksum

    def counted(data, value=0):
        sizes.append(len(data))
        return original(data, value)

    monkeypatch.setattr(integrity, "checksum", counted)
    return sizes


def test_a_block_of_small_tensors_costs_one_crc_not_one_per_tensor(tmp_path, monkeypatch):
    state = small_state()
    _save(tmp_path, state)
    sizes = _counted_checksums(monkeypatch)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    _load(tmp_path, target)
    assert all(torch.equal(target[k], v) for k, v in state.items())
    # one CRC per block (a file per writer thread here) and the manifest's own: not 300
    assert 2 <= len(sizes) <= 8, sizes


def test_a_flipped_byte_fails_its_block_and_is_named_before_it_reaches_its_target(
    tmp_path, monkeypatch
):
    state = small_state()
    _save(tmp_path, state)
    _flip(tmp_path, "p150")
    sizes = _counted_checksums(monkeypatch)
    target = {k: torch.full_like(v, 7) for k, v in state.items()}
    with pytest.raises(CheckpointException) as e:
        _load(tmp_path, target)
    (failure,) = e.value.failures.values()
    failure = failure[0] if isinstance(failure, tuple) else failure
    assert isinstance(failure, IntegrityError) and "'p150'" in str(failure)
    assert torch.equal(target["p150"], torch.full_like(state["p150"], 7))  # never copied in
    # its block failed, then each of that block's items was checked on its own
    assert sum(n < 2048 for n in sizes) >= 100, sizes


def test_a_flipped_byte_in_an_item_not_asked_for_does_not_fail_the_others(tmp_path):
    """The bad item lies inside a block read for its neighbours: the block fails its CRC,
    its items are checked one by one, and every item asked for loads."""
    state = small_state()
    _save(tmp_path, state)
    _flip(tmp_path, "p150")
    target = {k: torch.zeros_like(v) for k, v in state.items() if k != "p150"}
    _load(tmp_path, target)
    assert all(torch.equal(target[k], state[k]) for k in target)


def test_a_flipped_byte_is_read_from_the_remote_and_the_rest_from_disk(tmp_path, caplog):
    state = small_state()
    remote = RemoteConfig(url=f"file://{tmp_path}/remote")
    _save(tmp_path / "local", state, remote=remote).wait_durable(timeout_secs=60)
    _flip(tmp_path / "local", "p150")
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = _load(tmp_path / "local", target, remote=remote)
    assert all(torch.equal(target[k], v) for k, v in state.items())
    assert "corrupt" in caplog.text and "p150" in caplog.text
    assert reader.files_read_remotely  # that item's bytes, by a ranged read
