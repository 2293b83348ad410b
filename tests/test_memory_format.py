"""The memory tier's header: the tensor list encoded once per layout gives the same header, which
decodes and checks as before; a header whose tensor list is not its own fails its checksum."""

from __future__ import annotations

import json

import pytest
import torch

from dcp_tiered.errors import ManifestError
from dcp_tiered.policy import memory_chunks
from dcp_tiered.policy import memory_format as fmt


def _layout(n: int) -> tuple[list[fmt.Region], int]:
    return fmt.layout([(("model", f"w{i}"), torch.zeros(i + 1, 3)) for i in range(n)])


def _header(regions, size, **extra) -> bytes:
    return fmt.encode_header(
        step="step-7",
        rank=1,
        committed_at_ns=123,
        data_size=size,
        regions=regions,
        checksums=[],
        objects=b"\x00objects",
        run_id="run-a",
        world_size=2,
        chunk_bytes=memory_chunks.CHUNK_BYTES,
        chunk_checksums=["0badf00d"] * memory_chunks.count(size, memory_chunks.CHUNK_BYTES),
        **extra,
    )


def test_a_header_from_the_cached_tensor_list_is_the_header_encoded_anew():
    regions, size = _layout(50)
    fresh = _header(regions, size)
    cached = _header(regions, size, encoded_regions=fmt.encode_regions(regions))
    assert cached == fresh
    header = fmt.decode_header(cached, where="slot-0.json")
    assert header.regions == regions
    assert (header.step, header.rank, header.run_id, header.world_size) == ("step-7", 1, "run-a", 2)
    assert header.objects == b"\x00objects"


def test_a_tensor_list_of_another_layout_fails_the_header_checksum():
    regions, size = _layout(50)
    other, _ = _layout(49)
    data = _header(regions, size, encoded_regions=fmt.encode_regions(regions))
    body = json.loads(data)
    body["tensors"] = json.loads(fmt.encode_regions(other))
    with pytest.raises(ManifestError, match="checksum"):
        fmt.decode_header(json.dumps(body).encode(), where="slot-0.json")


def test_per_tensor_checksums_cannot_come_with_a_cached_tensor_list():
    regions, size = _layout(3)
    with pytest.raises(ValueError):
        fmt.encode_header(
            step="s",
            rank=0,
            committed_at_ns=1,
            data_size=size,
            regions=regions,
            checksums=["00000000"] * 3,
            objects=b"",
            encoded_regions=fmt.encode_regions(regions),
        )
