"""`dcp-tiered diff`, `export` and `verify --remote` against real roots: a local directory, a
file:// remote and the moto S3 server; a 2-rank FSDP2 step for tensors split into chunks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import TieredStorageWriter
from dcp_tiered.backends.remote import remote_backend
from dcp_tiered.cli import main
from dcp_tiered.tiers.remote import RemoteTier
from tests.conftest import torchrun
from tests.test_cli_ops import _json, remote  # noqa: F401  (the fixture: file:// and S3)

try:
    import safetensors.torch as safetensors_torch
except ImportError:  # an optional extra: diff and verify --remote are tested without it
    safetensors_torch = None
needs_safetensors = pytest.mark.skipif(
    safetensors_torch is None,
    reason="export --format safetensors needs the safetensors package "
    "(pip install 'dcp-tiered[export]')",
)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(300, 200, generator=g),  # 240 KB: a byte flipped in its middle hits it
        "h": torch.randn(4, 8, generator=g).to(torch.bfloat16),
        "n": torch.tensor([7, -3], dtype=torch.int64),
        "s": torch.tensor(2.5),
        "mask": torch.tensor([True, False, True]),
        "extra": {"step": 3, "note": "saved"},  # non-tensor values
    }


TENSORS = ["h", "mask", "n", "s", "w"]


def _save(root, step, state, where=None):
    """Save ``state`` as ``step`` of ``root``, durable on ``where`` (url, options) if given."""
    with TieredStorageWriter(
        root, remote=where[0] if where else None, storage_options=where[1] if where else None
    ) as writer:
        dcp.save(state, checkpoint_id=step, storage_writer=writer, no_dist=True)


def _loaded(out) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        got.update(safetensors_torch.load_file(str(out / file)))
    assert {k: index["weight_map"][k] for k in got} == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in got.values())
    return got


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _largest_data_file(step_dir):
    return max(step_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _flip(path, at=None) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 if at is None else at] ^= 0xFF
    path.write_bytes(bytes(raw))


@needs_safetensors
def test_export_safetensors_from_the_local_tier_and_from_the_remote_alone(
    tmp_path,
    remote,  # noqa: F811
    capsys,
):
    state = _state()
    root = tmp_path / "root"
    _save(root, "step-1", state, remote)
    out = tmp_path / "out"
    code, data = _json(capsys, "export", str(root), "latest", str(out), "--max-shard-size", "1KB")
    assert code == 0, data["errors"]
    assert data["source"] == "local" and data["tensors"] == len(TENSORS)
    assert [s["fqn"] for s in data["skipped"]] == ["extra.note", "extra.step"]
    assert len(data["files"]) == 2  # w (240 KB) is alone in its shard
    assert sorted(p.name for p in out.iterdir()) == [
        ".dcp-tiered-export.json",  # what --force may replace: this export's own files
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    got = _loaded(out)
    assert sorted(got) == TENSORS and all(_bitwise_equal(got[k], state[k]) for k in TENSORS)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dir

    fresh = tmp_path / "fresh"  # a node that holds nothing: the step is read from the remote
    fresh.mkdir()
    out2 = tmp_path / "out2"
    code, data = _json(capsys, "export", str(fresh), "step-1", str(out2), "--remote", remote[0])
    assert code == 0, data["errors"]
    assert data["source"] == "remote"
    assert len(data["files"]) == 1  # default --max-shard-size: one shard
    got = _loaded(out2)
    assert all(_bitwise_equal(got[k], state[k]) for k in TENSORS)
    assert list(fresh.iterdir()) == []  # nothing downloaded into the local tier


@needs_safetensors
def test_export_refuses_an_existing_out_without_force_and_writes_torch_shards(tmp_path, capsys):
    state = _state()
    root = tmp_path / "root"
    _save(root, "step-1", state)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, data = _json(capsys, "export", str(root), "step-1", str(out))
    assert code == 2 and data["errors"][0]["type"] == "CheckpointExistsError"
    assert [p.name for p in out.iterdir()] == ["keep.txt"]  # untouched
    # --force replaces an earlier export only, never a directory export did not make
    code, data = _json(capsys, "export", str(root), "step-1", str(out), "--force")
    assert code == 2 and data["errors"][0]["type"] == "ForeignPathError"
    assert [p.name for p in out.iterdir()] == ["keep.txt"]  # untouched
    out = tmp_path / "earlier"
    assert main(["export", str(root), "step-1", str(out)]) == 0
    code, data = _json(
        capsys, "export", str(root), "step-1", str(out), "--format", "torch", "--force"
    )
    assert code == 0, data["errors"]
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    assert sorted(index["weight_map"]) == TENSORS
    assert not list(out.glob("*.safetensors"))  # the earlier export's files were replaced
    got = {}
    for file in set(index["weight_map"].values()):
        got.update(torch.load(out / file, weights_only=True))
    assert all(_bitwise_equal(got[k], state[k]) for k in TENSORS)
    assert main(["export", str(root), "step-1", str(tmp_path / "x"), "--max-shard-size", "5XB"])
    code, data = _json(capsys, "export", str(root), "step-1", str(root / "step-1"), "--force")
    assert code == 2 and "inside the tier root" in data["errors"][0]["message"]
    assert main(["verify", str(root), "step-1"]) == 0  # the step was not replaced
    assert not (tmp_path / "x").exists()


@needs_safetensors
def test_a_flipped_byte_fails_export_and_diff_with_an_integrity_error(tmp_path, capsys):
    root = tmp_path / "root"
    _save(root, "step-1", _state())
    _save(root, "step-2", _state())
    assert main(["diff", str(root), "step-1", "step-2"]) == 0
    _flip(_largest_data_file(root / "step-1"))  # the one holding w
    out = tmp_path / "out"
    code, data = _json(capsys, "export", str(root), "step-1", str(out))
    assert code == 1 and data["errors"][0]["type"] == "IntegrityError"
    assert "step-1" in data["errors"][0]["message"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]  # no OUT, no temp dir
    code, data = _json(capsys, "diff", str(root), "step-1", "step-2")
    assert code == 1 and data["errors"][0]["type"] == "IntegrityError"


def test_diff_says_which_items_differ_and_by_how_much(tmp_path, capsys):
    root = tmp_path / "root"
    a = _state()
    _save(root, "step-1", a)
    b = _state()
    b["w"][3, 4] += 0.5
    b["w"][7, 7] = float("nan")
    b["extra"]["step"] = 4
    b["h"] = torch.zeros(5, dtype=torch.bfloat16)
    b["n"] = b["n"].to(torch.int32)
    del b["s"]
    b["new"] = torch.zeros(2)
    _save(root, "step-2", b)
    code, data = _json(capsys, "diff", str(root), "step-1", "step-1")
    assert code == 0 and data["identical"] and data["summary"]["same"] == len(data["items"])
    code, data = _json(capsys, "diff", str(root), "step-1", "step-2")
    assert code == 1 and not data["identical"] and data["errors"] == []
    items = {e["fqn"]: e for e in data["items"]}
    w = items["w"]
    assert (w["status"], w["reason"], w["numel"], w["differing"]) == (
        "different",
        "values",
        60000,
        2,
    )
    assert w["max_abs_diff"] == pytest.approx(0.5, abs=1e-6) and w["nonfinite_diffs"] == 1
    assert items["extra.step"]["status"] == "different" and items["extra.step"]["reason"] == "bytes"
    assert items["extra.note"]["status"] == "same" and items["mask"]["status"] == "same"
    assert (items["h"]["reason"], items["h"]["shape"], items["h"]["shape_b"]) == (
        "shape",
        [4, 8],
        [5],
    )
    assert (items["n"]["reason"], items["n"]["dtype"], items["n"]["dtype_b"]) == (
        "dtype",
        "int64",
        "int32",
    )
    assert items["s"]["status"] == "only-in-a" and items["new"]["status"] == "only-in-b"
    assert data["summary"] == {"same": 2, "different": 4, "only_in_a": 1, "only_in_b": 1}
    assert main(["diff", str(root), "step-1"]) == 2  # usage error


def test_diff_of_steps_only_on_the_remote(tmp_path, remote, capsys):  # noqa: F811
    """A node that holds neither step diffs them from the remote, every item verified."""
    a = _state()
    b = _state()
    b["w"][0, 0] += 2.0
    _save(tmp_path / "root", "step-1", a, remote)
    _save(tmp_path / "root", "step-2", b, remote)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    code, data = _json(capsys, "diff", str(fresh), "step-1", "step-2", "--remote", remote[0])
    assert code == 1 and data["errors"] == [], data
    items = {e["fqn"]: e for e in data["items"]}
    assert items["w"]["differing"] == 1 and items["w"]["max_abs_diff"] == pytest.approx(2.0)
    assert data["summary"]["different"] == 1
    assert list(fresh.iterdir()) == []  # read from the remote, nothing written locally


def test_verify_remote_checks_sizes_and_checksums(tmp_path, remote, capsys):  # noqa: F811
    root = tmp_path / "root"
    _save(root, "step-1", _state(), remote)
    _save(root, "step-2", _state(), remote)
    code, data = _json(capsys, "verify", str(root), "--remote")
    assert code == 0, data["errors"]
    assert [s["step"] for s in data["steps"]] == ["step-1", "step-2"]
    s1 = data["steps"][0]
    assert s1["tier"] == "remote" and s1["ok"] and s1["files"] >= 1
    if remote[0].startswith("s3://"):  # the CRC32C recorded at upload answers: no download
        assert s1["checked"] == {"recorded": s1["files"], "read": 0} and s1["bytes_read"] == 0
    else:  # a directory keeps no checksum: every object is read back
        assert s1["checked"] == {"recorded": 0, "read": s1["files"]}
        assert s1["bytes_read"] == s1["bytes"]
    code, data = _json(capsys, "verify", str(root), "step-1", "--remote", "--read-back")
    assert code == 0 and data["steps"][0]["checked"]["read"] == data["steps"][0]["files"]

    backend = remote_backend(remote[0], remote[1])
    keys = RemoteTier(backend).keys_of("step-1")
    data_file = _largest_data_file(root / "step-1")
    raw = bytearray(backend.get_bytes(keys.file(data_file.name)))
    raw[len(raw) // 2] ^= 0xFF
    backend.put_bytes(keys.file(data_file.name), bytes(raw))  # the store keeps no checksum now
    code, data = _json(capsys, "verify", str(root), "--remote", "step-1")  # a bare name: STEP
    assert code == 1 and [s["step"] for s in data["steps"]] == ["step-1"]
    on_s3 = remote[0].startswith("s3://")  # only the re-put object lost its checksum
    assert data["steps"][0]["checked"]["read"] == (1 if on_s3 else data["steps"][0]["files"])
    assert "crc32c of the stored bytes" in data["steps"][0]["problems"][0]
    backend.remove(keys.file(data_file.name), reason="test: an object lost by the store")
    code, data = _json(capsys, "verify", str(root), "step-1", "--remote", remote[0])
    assert code == 1 and "missing" in data["steps"][0]["problems"][0]
    assert main(["verify", str(root), "step-2", "--remote"]) == 0  # the other step is whole
    assert main(["verify", str(root), "step-1"]) == 0  # the local copy is untouched


def test_verify_remote_of_a_step_that_is_not_there_is_not_called_corrupt(tmp_path, remote, capsys):  # noqa: F811
    """A wrong step name or URL (nothing committed there) is a usage error naming where it
    looked (exit 2), not a corrupt copy (exit 1: the operator would hunt for a lost one)."""
    root = tmp_path / "root"
    _save(root, "step-1", _state(), remote)
    code, data = _json(capsys, "verify", str(root), "step-9", "--remote")
    assert code == 2, data
    message = data["errors"][0]["message"]
    assert "'step-9' is not committed on" in message and "status" in message, message
    nowhere = f"file://{tmp_path / 'nowhere'}"
    code, data = _json(capsys, "verify", str(root), "step-1", "--remote", nowhere)
    assert code == 2 and "'step-1' is not committed on" in data["errors"][0]["message"], data
    assert not (tmp_path / "nowhere").exists()  # a look, nothing made there
    assert main(["verify", str(root), "step-1", "--remote"]) == 0


@needs_safetensors
@pytest.mark.multirank
def test_export_assembles_tensors_sharded_across_ranks(tmp_path, capsys):
    """FSDP2 at 2 ranks: every parameter and optimizer state is split into 2 chunks, one per
    rank's file; the export holds the whole tensors, equal to the full state dict."""
    root, ref = tmp_path / "ckpt", tmp_path / "ref.pt"
    torchrun("roundtrip.py", 2, "save", "--root", str(root), "--kind", "fsdp2", "--ref", str(ref))
    code, data = _json(capsys, "inspect", str(root), "step-2")
    split = [t["fqn"] for t in data["tensors"] if len({c["rank"] for c in t["chunks"]}) == 2]
    assert "app.model.layers.0.fc1.weight" in split
    out = tmp_path / "out"
    code, data = _json(
        capsys, "export", str(root), "step-2", str(out), "--prefix", "app.model.",
        "--max-shard-size", "64KiB",
    )  # fmt: skip
    assert code == 0, data["errors"]
    assert len(data["files"]) > 1
    got = _loaded(out)
    full = torch.load(ref, weights_only=True)["model"]
    assert sorted(got) == sorted(full)
    assert all(_bitwise_equal(got[k], full[k]) for k in full)
    assert main(["diff", str(root), "step-2", "step-2"]) == 0


_PEAK = """
import sys
import dcp_tiered.cli.data, dcp_tiered.cli.export, safetensors.torch  # all imports done
from dcp_tiered.cli import main


def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current resident size
before = status("VmRSS:")
code = main(sys.argv[1:])
print(status("VmHWM:") - before, code)
"""


@needs_safetensors
def test_export_streams_a_step_tensor_by_tensor(tmp_path):
    """A 128 MiB state in one shard: the export's memory grows by a batch of tensors (16 MiB),
    not by the state, nor by the shard."""
    state = {f"layer{i}.w": torch.full((512, 1024), float(i)) for i in range(64)}  # 2 MiB each
    root = tmp_path / "root"
    _save(root, "step-1", state)
    del state
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK, "export", str(root), "step-1", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    grew, code = proc.stdout.strip().splitlines()[-1].split()
    assert int(code) == 0, proc.stderr[-2000:]
    assert len(json.loads("\n".join(proc.stdout.splitlines()[:-1]))["files"]) == 1
    assert int(grew) < 64 * 2**20, f"export grew by {int(grew) / 2**20:.0f} MiB"
    got = safetensors_torch.load_file(str(out / "model-00001-of-00001.safetensors"))
    assert all(bool((got[f"layer{i}.w"] == i).all()) for i in range(64))
