"""The reader loads what vanilla DCP 2.13 loads: checkpoints written by torch's own
FileSystemWriter with the older sharded-tensor ``TensorProperties`` in ``.metadata``, and with
DCP's stream extensions (ZStandard, custom transforms found through an ExtensionRegistry)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import metadata as old_metadata
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import (
    ExtensionRegistry,
    StreamTransformExtension,
    ZStandard,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dcp_tiered import IntegrityError, TieredStorageReader, UnsupportedExtensionError
from tests.test_save_load import assert_state_equal, blank, failure, state


def vanilla_load(path, **kw) -> dict:
    sd = blank()
    dcp.load(sd, storage_reader=FileSystemReader(path, **kw), no_dist=True)
    return sd


def tiered_load(root, step=None, **kw) -> dict:
    sd = blank()
    dcp.load(sd, checkpoint_id=step, storage_reader=TieredStorageReader(root, **kw), no_dist=True)
    return sd


class _OldPropertiesWriter(FileSystemWriter):
    """DCP's own writer, recording each tensor's properties with the sharded-tensor class that
    older torch versions pickled into ``.metadata``."""

    def finish(self, metadata, results) -> None:
        for md in metadata.state_dict_metadata.values():
            if isinstance(md, TensorStorageMetadata):
                p = md.properties
                md.properties = old_metadata.TensorProperties(
                    dtype=p.dtype,
                    layout=p.layout,
                    requires_grad=p.requires_grad,
                    memory_format=p.memory_format,
                    pin_memory=p.pin_memory,
                )
        super().finish(metadata, results)


def test_metadata_with_old_sharded_tensor_properties_loads(tmp_path, caplog):
    path = tmp_path / "step-3"
    dcp.save(state(3), storage_writer=_OldPropertiesWriter(path), no_dist=True)
    raw = (path / ".metadata").read_bytes()
    assert b"torch.distributed._shard.sharded_tensor.metadata" in raw  # pickled for real
    assert b"MEM_FORMAT_ENCODING" in raw
    assert_state_equal(vanilla_load(path), state(3))  # vanilla DCP loads it ...
    assert_state_equal(tiered_load(path), state(3))  # ... and so do we, the root itself
    assert_state_equal(tiered_load(tmp_path, "step-3"), state(3))  # or a step under a root
    assert "cannot be verified" in caplog.text


class _Xor(StreamTransformExtension):
    """A custom transform (every byte XOR 0x5A), as a user would register it."""

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> _Xor:
        if version != "1":
            raise ValueError(f"unknown test.xor version {version!r}")
        return _Xor()

    def get_descriptor(self) -> str:
        return "test.xor/1"

    def transform_to(self, output):
        class Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b) -> int:
                data = bytes(memoryview(b))
                output.write(bytes(x ^ 0x5A for x in data))
                return len(data)

        return Writer()

    def transform_from(self, input):
        return io.BytesIO(bytes(x ^ 0x5A for x in input.read()))


def _registry() -> ExtensionRegistry:
    reg = ExtensionRegistry()
    reg.register(_Xor)
    return reg


def test_custom_stream_transform_loads_with_the_same_registry(tmp_path, caplog):
    path = tmp_path / "step-4"
    dcp.save(state(4), storage_writer=FileSystemWriter(path, _extensions=[_Xor()]), no_dist=True)
    data = b"".join(p.read_bytes() for p in path.glob("*.distcp"))
    assert b"PK" not in data  # transformed for real: no zip header left in the clear
    assert_state_equal(vanilla_load(path, _extension_registry=_registry()), state(4))
    assert_state_equal(tiered_load(path, extension_registry=_registry()), state(4))
    assert_state_equal(tiered_load(tmp_path, "step-4", extension_registry=_registry()), state(4))
    assert "cannot be verified" in caplog.text


def test_unregistered_transform_is_a_typed_error_naming_it(tmp_path):
    path = tmp_path / "step-5"
    dcp.save(state(5), storage_writer=FileSystemWriter(path, _extensions=[_Xor()]), no_dist=True)
    with pytest.raises(CheckpointException) as e:
        tiered_load(path)
    err = failure(e)
    assert isinstance(err, UnsupportedExtensionError) and isinstance(err, ValueError)
    msg = str(err)
    assert "test.xor/1" in msg and ".distcp" in msg and str(path) in msg
    assert "extension_registry" in msg  # what to do


def test_a_transform_that_fails_on_read_is_a_typed_error(tmp_path):
    class Broken(_Xor):
        @staticmethod
        def from_descriptor(version: str) -> _Xor:
            return Broken()

        def transform_from(self, input):
            raise OSError("trailer mismatch")

    path = tmp_path / "step-6"
    dcp.save(state(6), storage_writer=FileSystemWriter(path, _extensions=[_Xor()]), no_dist=True)
    reg = ExtensionRegistry()
    reg.register(Broken)
    with pytest.raises(CheckpointException) as e:
        tiered_load(path, extension_registry=reg)
    err = failure(e)
    assert isinstance(err, IntegrityError)
    assert "test.xor/1" in str(err) and "trailer mismatch" in str(err) and ".distcp" in str(err)


@pytest.mark.skipif(not ZStandard.is_available(), reason="needs the zstandard or pyzstd package")
def test_zstandard_checkpoint_loads(tmp_path):
    path = tmp_path / "step-7"
    sd = state(7)
    sd["w"] = torch.zeros(512, 512)  # compresses well: proves the files are compressed
    dcp.save(sd, storage_writer=FileSystemWriter(path, _extensions=[ZStandard()]), no_dist=True)
    assert sum(p.stat().st_size for p in path.glob("*.distcp")) < sd["w"].nbytes // 4
    out = blank()
    out["w"] = torch.ones(512, 512)
    dcp.load(out, storage_reader=TieredStorageReader(path), no_dist=True)
    assert torch.equal(out["w"], sd["w"]) and out["nested"]["s"] == "v7.0"


@pytest.mark.skipif(ZStandard.is_available(), reason="checks the message without zstandard")
def test_zstandard_checkpoint_without_the_package_says_what_to_install(tmp_path):
    class LabelledZstd(_Xor):  # writes items labelled as ZStandard's (this host cannot compress)
        def get_descriptor(self) -> str:
            return "stream.zstd/1"

    path = tmp_path / "step-8"
    dcp.save(
        state(8), storage_writer=FileSystemWriter(path, _extensions=[LabelledZstd()]), no_dist=True
    )
    with pytest.raises(CheckpointException) as e:
        tiered_load(path)
    err = failure(e)
    assert isinstance(err, UnsupportedExtensionError)
    assert "stream.zstd/1" in str(err) and "pip install zstandard" in str(err)
