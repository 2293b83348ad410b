"""Checkpoints cross torch versions both ways, and the compatibility layer's per-version paths.

The cross-version test needs a second venv with another torch beside this one: `scripts/test
--torch 2.14.1` makes `.venv-torch-2.14.1`, and `.ci/run` runs the core suite there after the
default suite, so there it finds `.venv` (the pinned torch) and checks both directions.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import TieredStorageReader, TieredStorageWriter, _torch_compat
from tests.conftest import REPO, read_json, torchrun


def _torch_of(python: Path) -> str | None:
    proc = subprocess.run(
        [str(python), "-c", "import torch, dcp_tiered; print(torch.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


@functools.cache
def _other_torches() -> list[tuple[str, Path]]:
    """(version, python) of every project venv whose torch differs from the running one."""
    found = []
    for venv in sorted([REPO / ".venv", *REPO.glob(".venv-torch-*")]):
        python = venv / "bin" / "python"  # a link to the same base interpreter in every venv
        if not python.exists() or venv.resolve() == Path(sys.prefix).resolve():
            continue
        version = _torch_of(python)
        if version and version != torch.__version__:
            found.append((version, python))
    return found


@pytest.mark.multirank
@pytest.mark.parametrize("direction", ["saved-here", "saved-there"])
def test_checkpoint_loads_under_another_torch(tmp_path, direction):
    """FSDP2 + Adam + extras saved at 2 ranks under one torch load bit-exact, resharded to 1
    and 2 ranks, under every other torch found; then the other way round."""
    if not _other_torches():
        pytest.skip(
            "no venv with another torch beside this one: run `scripts/test --torch "
            "2.14.1` (it finds .venv) to check both directions"
        )
    here = sys.executable
    for version, there in _other_torches():
        save_py, load_py = (here, str(there)) if direction == "saved-here" else (str(there), here)
        root, ref = tmp_path / version / "ckpt", tmp_path / version / "ref.pt"
        torchrun(
            "roundtrip.py",
            2,
            "save",
            "--root",
            str(root),
            "--mode",
            "thread",
            "--ref",
            str(ref),
            python=save_py,
        )
        for world in (1, 2):
            out = tmp_path / version / f"load{world}.json"
            torchrun(
                "roundtrip.py",
                world,
                "load",
                "--root",
                str(root),
                "--ref",
                str(ref),
                "--out",
                str(out),
                python=load_py,
            )
            result = read_json(out)
            assert result["world"] == world
            assert result["mismatches"] == [], (
                f"saved under {_torch_of(Path(save_py))}, loaded under {_torch_of(Path(load_py))} "
                f"at {world} ranks: {result}"
            )


def test_compat_layer_finds_every_private_symbol_on_this_torch():
    """Each private torch API we use resolves here (an upgrade that moves one fails this test,
    not a user's save)."""
    assert _torch_compat.StorageInfo("f", 0, 1).relative_path == "f"
    assert callable(_torch_compat.copy_state_dict)
    assert callable(_torch_compat.create_cpu_state_dict)
    assert issubclass(_torch_compat.ShardedTensor, torch.Tensor)
    transforms = _torch_compat.StorageReaderTransforms(_torch_compat.ExtensionRegistry())
    assert callable(transforms.transform_load_stream)
    assert _torch_compat.ZStandard.registry_name() == "stream.zstd"


def test_load_keys_reads_one_key_without_a_template(tmp_path):
    state = {"a": torch.arange(6.0).view(2, 3), "b": {"x": torch.ones(2), "n": 3}}
    dcp.save(
        state, checkpoint_id="step-1", storage_writer=TieredStorageWriter(tmp_path), no_dist=True
    )
    reader = TieredStorageReader(tmp_path)
    reader.reset("step-1")
    out: dict = {}
    _torch_compat.load_keys(out, {"b"}, reader)
    assert set(out) == {"b"}
    assert torch.equal(out["b"]["x"], torch.ones(2)) and out["b"]["n"] == 3
