"""CRC32C combining (policy.integrity.combine), which the writer uses for every tensor of 1 MiB
or more and the restore for its blocks: against crc32c of the real stream at every length
class, 512 MiB and more included (a table copied from zlib's CRC-32 combined those wrongly for
CRC32C, so a tensor that large was saved with a CRC its own bytes failed), and a tensor past
512 MiB saved and restored through the whole path."""

from __future__ import annotations

import os

import crc32c
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import TieredStorageWriter
from dcp_tiered.policy import integrity, region_crcs
from tests import _manifests as manifests
from tests.test_region_crcs import _load as load_by_columns

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

_MIB = 2**20


def test_combining_agrees_with_the_stream_up_to_past_a_gibibyte():
    """A random MiB appended 1,100 times after a head: at each length class (bits 20 to 30
    of the length set) the combined CRC is the stream's."""
    block = os.urandom(_MIB)
    head = crc32c.crc32c(b"dcp-tiered")
    tail = stream = head
    checked = 0
    for n in range(1, 1101):
        tail = crc32c.crc32c(block, value=tail if n > 1 else 0)
        stream = crc32c.crc32c(block, value=stream)
        if n & (n - 1) == 0 or n in (511, 513, 1100):  # powers of two, and either side of 512
            assert integrity.combine(head, tail, n * _MIB) == stream, n
            checked += 1
    assert checked == 14


def test_a_region_shifted_past_512_mib_is_shifted_right():
    """policy.region_crcs' tables come from the same factors."""
    data = os.urandom(4096)
    crc = crc32c.crc32c(data)
    zeros = bytes(_MIB)
    for n in (2**29, 2**30 + 3 * _MIB):
        padded = crc
        for _ in range(n // _MIB):
            padded = crc32c.crc32c(zeros, value=padded)
        zero_crc = 0
        for _ in range(n // _MIB):
            zero_crc = crc32c.crc32c(zeros, value=zero_crc)
        (got,) = region_crcs.shifted(np.asarray([crc], dtype=np.uint32), np.asarray([n]))
        assert int(got) ^ zero_crc == padded, n


def test_a_tensor_past_512_mib_is_saved_with_its_own_crc_and_restored(tmp_path):
    n = (513 * _MIB) // 4
    value = torch.arange(n, dtype=torch.int32)
    state = {"big": value, "small": torch.arange(10.0)}
    with TieredStorageWriter(tmp_path, sync_files=False) as writer:
        dcp.save(state, checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    step = tmp_path / "step-1"
    for entry in manifests.items(step):
        with open(step / entry["file"], "rb") as f:
            f.seek(entry["offset"])
            data = f.read(entry["length"])
        assert entry["checksum"] == f"{crc32c.crc32c(data):08x}", entry["fqn"]
    for name, entry in manifests.files(step).items():
        whole = 0
        with open(step / name, "rb") as f:
            while piece := f.read(64 * _MIB):
                whole = crc32c.crc32c(piece, value=whole)
        assert entry["checksum"] == f"{whole:08x}", name
    target = {"big": torch.zeros_like(value), "small": torch.zeros(10)}
    load_by_columns(tmp_path, target)
    assert torch.equal(target["big"], value) and torch.equal(target["small"], state["small"])
