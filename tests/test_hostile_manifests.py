"""Hostile manifests and memory-tier headers: deep JSON in a section, counts of 2**40 in a few
bytes, an item length of 8 GiB over a sparse file, a dtype or shape that disagrees with the
stored bytes (checksums resealed, as anyone can: a CRC is no signature), a memory header whose
regions disagree with themselves, a memory snapshot holding a pickle loading refuses. Each is
a typed error for that step only. Whatever could allocate runs in a process of its own under
a memory limit, so the code before the fix fails there (MemoryError) instead of exhausting the
machine."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import (
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    Every,
    IntegrityError,
    ManifestError,
    SavePolicy,
    TieredLoadPlanner,
    TieredStorageReader,
    TieredStorageWriter,
)
from dcp_tiered.policy import integrity, layout, manifest_codec
from dcp_tiered.policy import memory_format as fmt
from dcp_tiered.tiers import memory as memory_tier
from tests import _manifests

REPO = Path(__file__).resolve().parents[1]
SMALL = torch.arange(6, dtype=torch.float32) + 1  # its raw bytes found by comparison
BIG = torch.arange(20_000, dtype=torch.float32)  # large: read straight into its target
DEEP = b"[" * 200_000 + b"]" * 200_000


def _state(scale: float = 1.0) -> dict:
    return {"small": SMALL * scale, "big": BIG * scale, "n": torch.tensor([3], dtype=torch.int64)}


def _blank(**shapes) -> dict:
    state = {k: torch.zeros_like(v) for k, v in _state().items()}
    state.update(shapes)
    return state


def _save(root: Path, *steps: str) -> None:
    with TieredStorageWriter(root, sync_files=False) as writer:
        for i, step in enumerate(steps):
            dcp.save(_state(i + 1.0), checkpoint_id=step, storage_writer=writer, no_dist=True)


def _load(root: Path, step: str, state: dict | None = None) -> dict:
    state = state if state is not None else _blank()
    dcp.load(state, checkpoint_id=step, storage_reader=TieredStorageReader(root), no_dist=True)
    return state


def _cause(e: CheckpointException) -> BaseException:
    (failure,) = e.failures.values()
    return failure[0] if isinstance(failure, tuple) else failure


def _replace_section(step_dir: Path, data: bytes, node: int = -1) -> None:
    """Put ``data`` as the section of ``node`` and reseal the index to name it."""
    (step_dir / layout.manifest_section_name(node)).write_bytes(data)
    body = _manifests.index(step_dir)
    for ref in body["sections"]:
        if ref[0] == node:
            ref[2:] = [len(data), integrity.format_checksum(integrity.checksum(data))]
    body.pop("manifest_checksum")
    (step_dir / "manifest.json").write_bytes(manifest_codec.seal(body))


def _tensor_entry(body: dict, fqn: str) -> list:
    """``[entry, writers]`` of ``fqn`` (see _manifests.entry_of)."""
    return _manifests.entry_of(body, fqn)


# ---------------------------------------------------------------- sections and counts


def test_a_deep_section_makes_its_step_unreadable_and_nothing_else(tmp_path, capsys):
    """200k-deep JSON in one step's section (resealed): every other step loads, `ls` lists
    them all, `verify` names the bad one (a typed error, no traceback) and passes the rest."""
    _save(tmp_path, "run-40", "run-41", "run-42")
    _replace_section(tmp_path / "run-40", DEEP)
    assert torch.equal(_load(tmp_path, "run-41")["big"], BIG * 2)
    assert torch.equal(_load(tmp_path, "latest")["big"], BIG * 3)
    with pytest.raises(CheckpointException) as e:
        _load(tmp_path, "run-40")
    assert isinstance(_cause(e.value), ManifestError) and "nested" in str(_cause(e.value))
    proc = _cli("verify", str(tmp_path), "--json")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    results = {r["step"]: r for r in json.loads(proc.stdout)["steps"]}
    assert results["run-41"]["ok"] and results["run-42"]["ok"]
    assert not results["run-40"]["ok"] and "ManifestError" in results["run-40"]["problems"][0]
    listing = _cli("ls", str(tmp_path), "--json")
    assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing.stderr
    states = {r["step"]: r["state"] for r in json.loads(listing.stdout)["steps"]}
    assert states == {"run-40": "unreadable", "run-41": "committed", "run-42": "committed"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dcp_tiered.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def _parse_in_a_small_process(root: Path, step: str, load: bool = False) -> dict:
    """Parse (or load) ``step`` in a process allowed 3 GiB of address space beyond what its
    imports mapped (a CUDA build of torch maps several GiB at import): what it raised, by type
    name."""
    code = textwrap.dedent(
        f"""
        import json, resource, sys
        import torch, torch.distributed.checkpoint as dcp
        from dcp_tiered import TieredStorageReader
        from dcp_tiered.backends.local import LocalBackend
        from dcp_tiered.tiers.local import LocalTier
        from dcp_tiered.errors import causes
        mapped = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                      if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (mapped + 3 * 2**30, mapped + 3 * 2**30))
        out = {{"raised": None}}
        try:
            if {load!r}:
                state = {{"small": torch.zeros(6), "big": torch.zeros(20000),
                          "n": torch.zeros(1, dtype=torch.int64)}}
                dcp.load(state, checkpoint_id={step!r},
                         storage_reader=TieredStorageReader({str(root)!r}), no_dist=True)
            else:
                LocalTier(LocalBackend({str(root)!r})).read_manifest({step!r})
        except BaseException as e:
            cause = causes(e)[0]
            out = {{"raised": type(cause).__name__, "message": str(cause)[:2000]}}
        print(json.dumps(out))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


COUNTS = {
    # a tensor of one chunk whose writers claim 2**40 of them
    "writers": lambda body: _tensor_entry(body, "small").__setitem__(1, [[0, 0, 2**40]]),
    # a grid of 2**40 one-element splits, on a tensor the index says is that long
    "grid": lambda body: _tensor_entry(body, "big")[0].update(size=[2**40], grid=[[[1, 2**40]]]),
    # a writer rank past the world size (1): later lookups by rank would fail untyped
    "writer ranks": lambda body: _tensor_entry(body, "small").__setitem__(1, [[3, 0, 1]]),
}


@pytest.mark.parametrize("case", sorted(COUNTS))
def test_counts_in_a_few_bytes_are_refused_before_they_are_expanded(tmp_path, case):
    _save(tmp_path, "run-7")
    _manifests.tamper(tmp_path / "run-7", edit_index=COUNTS[case])
    got = _parse_in_a_small_process(tmp_path, "run-7")
    assert got["raised"] == "ManifestError", got


def test_an_item_length_of_8_gib_over_a_sparse_file_is_refused_before_allocating(tmp_path):
    _save(tmp_path, "run-8")
    step_dir = tmp_path / "run-8"
    huge = 8 * 2**30
    name = next(f["name"] for f in _manifests.files(step_dir).values() if len(f["ids"]) == 1)

    def lengthen(section: dict) -> None:
        entry = next(f for f in section["files"] if f["name"] == name)
        entry["lengths"] = [huge]
        entry["size"] = huge
        entry.pop("offsets", None)
        entry.pop("start", None)

    _manifests.tamper(step_dir, edit_section=lengthen)
    os.truncate(step_dir / name, huge)  # sparse: no disk used
    got = _parse_in_a_small_process(tmp_path, "run-8", load=True)
    assert got["raised"] == "ManifestError" and "bytes long" in got["message"], got


def _first_file(edit):
    """An edit of the item columns of the shared section's file with the most items."""

    def run(section: dict) -> None:
        edit(max(section["files"], key=lambda f: len(f["ids"])))

    return run


def _set(column: str, at: int, value):
    def edit(entry: dict) -> None:
        if column == "offsets" and "offsets" not in entry:
            start, offsets = entry.pop("start", 0), []
            for length in entry["lengths"]:
                offsets.append(start)
                start += length
            entry["offsets"] = offsets
        entry[column][at] = value

    return edit


def _overflowing(entry: dict) -> None:  # each under 2**63, their sum past it
    entry["offsets"] = [2**62 + 2**61] * len(entry["ids"])
    entry["lengths"] = [2**62] * len(entry["ids"])
    entry.pop("start", None)


def _wrapping(entry: dict) -> None:  # back to back: the running offset passes 64 bits
    entry["size"] = 2**62 - 1
    entry["lengths"] = [2**61] * len(entry["ids"])
    entry.pop("offsets", None)
    entry.pop("start", None)


# each item column of a section, edited (and resealed) the way a bad disk or an attacker would
COLUMNS = {
    "tensor id past the index": (_set("ids", -1, 10**6), "names no chunk"),
    "negative tensor id": (_set("ids", 0, -1), "names no chunk"),
    "chunk past the tensor's": (_set("chunks", 0, 1), "names no chunk"),
    "negative chunk": (_set("chunks", 0, -1), "names no chunk"),
    "fractional id": (_set("ids", 0, 0.5), "other than integers"),
    "length as a string": (_set("lengths", 0, "12"), "other than integers"),
    "id past 64 bits": (_set("ids", 0, 2**70), "other than integers"),
    "negative length": (_set("lengths", 0, -5), "lies outside"),
    "offset past the file": (_set("offsets", 0, 10**9), "lies outside"),
    "offsets and lengths past 64 bits together": (_overflowing, "lies outside"),
    "back-to-back offsets past 64 bits": (_wrapping, "run-2"),
    "a file past any file's size": (lambda e: e.update(size=2**62), "past any file"),
    "raw offset past its item": (_set("raw", 0, 10**6), "raw offset is bad"),
    "raw offset below -1": (_set("raw", 0, -2), "raw offset is bad"),
    "a column longer than the others": (lambda e: e["chunks"].append(0), "different lengths"),
    "checksums too short": (lambda e: e.update(crcs=e["crcs"][:-1]), "different lengths"),
    "ids not a list": (lambda e: e.update(ids=7), "not a list"),
}


def _refused_alone(tmp_path: Path, says: str, **edit) -> None:
    """Step run-2, tampered with (``edit``: as _manifests.tamper takes it), fails to load
    with a ManifestError that says ``says``, where and what to do; run-1 still loads."""
    _save(tmp_path, "run-1", "run-2")
    _manifests.tamper(tmp_path / "run-2", **edit)
    with pytest.raises(CheckpointException) as caught:
        _load(tmp_path, "run-2")
    cause = _cause(caught.value)
    assert isinstance(cause, ManifestError) and says in str(cause), cause
    assert "run-2" in str(cause) and "another tier" in str(cause)
    assert torch.equal(_load(tmp_path, "run-1")["big"], BIG)


@pytest.mark.parametrize("case", sorted(COLUMNS))
def test_a_section_whose_item_columns_lie_is_refused_and_harms_no_other_step(tmp_path, case):
    edit, says = COLUMNS[case]
    _refused_alone(tmp_path, says, edit_section=_first_file(edit))


def _index_column(column: str, key: str, value):
    """An edit of one key's value in a column of the index's tensors."""

    def edit(body: dict) -> None:
        t = body["tensors"]
        t[column][t["fqns"].index(key)] = value

    return edit


def _not_whole(key: str):
    """Key ``key`` marked as an entry of ``others`` in every column, with no entry added."""

    def edit(body: dict) -> None:
        t = body["tensors"]
        i = t["fqns"].index(key)
        t["shape"][i] = t["props"][i] = t["rank"][i] = -1

    return edit


def _shape_of(key: str, dims: list):
    """Key ``key`` pointed at a new row of the shapes table, ``dims``."""

    def edit(body: dict) -> None:
        t = body["tensors"]
        t["shapes"].append(dims)
        t["shape"][t["fqns"].index(key)] = len(t["shapes"]) - 1

    return edit


# each column of a version-3 index's tensors, edited (and resealed) as an attacker would
INDEX_COLUMNS = {
    "shape past the table": (_index_column("shape", "small", 99), "out of range"),
    "rank past the world": (_index_column("rank", "small", 1), "out of range"),
    "rank below -1": (_index_column("rank", "small", -2), "out of range"),
    "properties past the table": (_index_column("props", "small", 7), "out of range"),
    "a boolean rank": (_index_column("rank", "small", True), "not 3 integers"),
    "a rank past 64 bits": (_index_column("rank", "small", 2**70), "malformed"),
    "a whole tensor with no writer": (_index_column("rank", "small", -1), "disagree"),
    "an entry too few": (_not_whole("small"), "do not match"),
    "a column too short": (lambda b: b["tensors"]["props"].pop(), "not 3 integers"),
    "a key twice": (lambda b: b["tensors"]["fqns"].__setitem__(1, "small"), "twice"),
    "a key that is not a string": (lambda b: b["tensors"]["fqns"].__setitem__(0, 7), "strings"),
    "a negative size": (_shape_of("small", [-6]), "positive sizes"),
    "a size of zero": (_shape_of("small", [0]), "positive sizes"),
    "a fractional size": (_shape_of("small", [6.0]), "positive sizes"),
    "a boolean size": (_shape_of("small", [True]), "positive sizes"),
    "planner data too short": (
        lambda b: b["planner_data"]["paths"].pop(),
        "planner data does not match",
    ),
    "a key given two paths": (
        lambda b: b["planner_data"]["more"].update(small=["small"]),
        "two paths",
    ),
    "columns not an object": (lambda b: b.update(tensors=[]), "not columns"),
}


@pytest.mark.parametrize("case", sorted(INDEX_COLUMNS))
def test_an_index_whose_tensor_columns_lie_is_refused_and_harms_no_other_step(tmp_path, case):
    edit, says = INDEX_COLUMNS[case]
    _refused_alone(tmp_path, says, edit_index=edit)


def test_a_whole_tensor_shape_the_columns_misstate_is_caught(tmp_path):
    """The shapes table says twice the elements for one tensor (resealed): its stored
    bytes are checked against the manifest and the load fails typed, naming it."""
    _save(tmp_path, "run-1", "run-2")
    n = SMALL.numel() * 2
    _manifests.tamper(tmp_path / "run-2", edit_index=_shape_of("small", [n]))
    with pytest.raises(CheckpointException) as caught:
        _load(tmp_path, "run-2", _blank(small=torch.zeros(n)))
    cause = _cause(caught.value)
    assert isinstance(cause, IntegrityError) and "small" in str(cause), repr(cause)
    assert torch.equal(_load(tmp_path, "run-1")["big"], BIG)


def test_a_tensor_the_index_lists_but_no_section_locates_is_a_manifest_error(tmp_path):
    _save(tmp_path, "run-1", "run-2")

    def drop_last_item(entry: dict) -> None:  # the rest keep their offsets
        for column in ("ids", "chunks", "lengths", "raw") + (("offsets",) * ("offsets" in entry)):
            entry[column].pop()
        entry["crcs"] = entry["crcs"][:-8]

    _manifests.tamper(tmp_path / "run-2", edit_section=_first_file(drop_last_item))
    with pytest.raises(CheckpointException) as caught:
        _load(tmp_path, "run-2")
    cause = _cause(caught.value)
    assert isinstance(cause, ManifestError) and "located by no section" in str(cause), cause
    assert torch.equal(_load(tmp_path, "run-1")["big"], BIG)


# ---------------------------------------------------------------- dtype and shape lies


def _retype(fqn: str, dtype: str):
    def edit(body: dict) -> None:
        entry = _tensor_entry(body, fqn)[0]
        props = dict(body["properties"][entry["props"]], dtype=dtype)
        body["properties"].append(props)
        entry["props"] = len(body["properties"]) - 1

    return edit


def _not_raw(section: dict) -> None:
    for f in section["files"]:
        f["raw"] = [-1] * len(f["raw"])


@pytest.mark.parametrize("fqn", ["small", "big"])
@pytest.mark.parametrize("raw", [True, False], ids=["raw view", "torch.load"])
def test_a_dtype_that_disagrees_with_the_stored_bytes_is_an_integrity_error(tmp_path, fqn, raw):
    """float16 over float32 storage would load as wrong values, silently: refused, whether
    the reader views the raw bytes (in place, or from a block) or torch.loads the item."""
    _save(tmp_path, "run-9")
    _manifests.tamper(
        tmp_path / "run-9",
        edit_index=_retype(fqn, "torch.float16"),
        edit_section=None if raw else _not_raw,
    )
    state = _blank(**{fqn: torch.zeros_like(_state()[fqn], dtype=torch.float16)})
    with pytest.raises(CheckpointException) as e:
        _load(tmp_path, "run-9", state)
    cause = _cause(e.value)
    assert isinstance(cause, IntegrityError) and fqn in str(cause), repr(cause)


@pytest.mark.parametrize("fqn", ["small", "big"])
def test_a_shape_that_disagrees_with_the_stored_bytes_is_an_integrity_error(tmp_path, fqn):
    """The index says twice as many elements (resealed), and the state asks for them: the
    bytes past the storage are the archive's framing, never handed over as values."""
    _save(tmp_path, "run-10")
    n = _state()[fqn].numel() * 2

    def double(body: dict) -> None:
        _tensor_entry(body, fqn)[0].update(size=[n], grid=[[[n, 1]]])

    _manifests.tamper(tmp_path / "run-10", edit_index=double)
    with pytest.raises(CheckpointException) as e:
        _load(tmp_path, "run-10", _blank(**{fqn: torch.zeros(n)}))
    cause = _cause(e.value)
    assert isinstance(cause, IntegrityError) and fqn in str(cause), repr(cause)


def test_a_shape_the_manifest_misstates_is_a_manifest_error_not_the_planners_valueerror(
    tmp_path,
):
    """The index says twice the elements, consistently (resealed); the state holds what was
    saved. DCP's planner compares the two before any byte is read and raises a bare
    ValueError; the load planner reads the stored chunk and says which side is wrong."""
    _save(tmp_path, "run-12")
    n = SMALL.numel() * 2
    _manifests.tamper(
        tmp_path / "run-12",
        edit_index=lambda b: _tensor_entry(b, "small")[0].update(size=[n], grid=[[[n, 1]]]),
    )
    reader = TieredStorageReader(tmp_path)
    with pytest.raises(CheckpointException) as e:
        dcp.load(
            _blank(),
            checkpoint_id="run-12",
            storage_reader=reader,
            no_dist=True,
            planner=TieredLoadPlanner(reader=reader),
        )
    cause = _cause(e.value)
    assert isinstance(cause, ManifestError) and "stored bytes hold [6]" in str(cause), cause
    # Through the manager, which plans with it: the reason the step failed is typed.
    _save(tmp_path / "mgr", "step-3")
    _manifests.tamper(
        tmp_path / "mgr" / "step-3",
        edit_index=lambda b: _tensor_entry(b, "small")[0].update(size=[n], grid=[[[n, 1]]]),
    )
    with CheckpointManager(local=tmp_path / "mgr", events=None) as mgr:
        with pytest.raises(CheckpointNotFoundError, match="ManifestError.*stored bytes hold"):
            mgr.restore(_blank())
    # A state that is not the saved model (an untouched step): typed, naming both shapes.
    _save(tmp_path / "clean", "run-13")
    reader = TieredStorageReader(tmp_path / "clean")
    with pytest.raises(CheckpointException) as e:
        dcp.load(
            _blank(big=torch.zeros(7)),
            checkpoint_id="run-13",
            storage_reader=reader,
            no_dist=True,
            planner=TieredLoadPlanner(reader=reader),
        )
    cause = _cause(e.value)
    assert isinstance(cause, ConfigError) and "[20000]" in str(cause) and "[7]" in str(cause)


def test_a_shape_whose_chunks_do_not_add_up_is_refused_before_planning(tmp_path):
    """An index whose tensor size disagrees with its own chunk grid: ManifestError when the
    manifest is read, not DCP's planner's ValueError."""
    _save(tmp_path, "run-11")
    _manifests.tamper(
        tmp_path / "run-11", edit_index=lambda b: _tensor_entry(b, "big")[0].update(size=[40_000])
    )
    with pytest.raises(CheckpointException) as e:
        _load(tmp_path, "run-11", _blank(big=torch.zeros(40_000)))
    assert isinstance(_cause(e.value), ManifestError), repr(_cause(e.value))


# ---------------------------------------------------------------- memory-tier headers


def _memory_step(tmp_path: Path, state: dict) -> tuple[memory_tier.MemoryTier, Path]:
    tier = memory_tier.MemoryTier(tmp_path / "shm", 0)
    tier.save("step-4", state).result()
    tier.close()
    (header,) = (tmp_path / "shm" / "rank-0").glob("slot-*.json")
    return memory_tier.MemoryTier(tmp_path / "shm", 0), header


def _rewrite_header(path: Path, edit) -> None:
    body = json.loads(path.read_bytes())
    body.pop("header_checksum")
    edit(body)
    body["header_checksum"] = fmt._checksum(body)  # a CRC: anyone can recompute it
    path.write_bytes(json.dumps(body).encode())


class Position:
    """A class of the test's own: weights_only loading refuses it."""

    def __init__(self) -> None:
        self.at = 5


def test_a_refused_pickle_in_a_memory_snapshot_is_an_integrity_error(tmp_path):
    tier, header = _memory_step(tmp_path, {"w": torch.ones(8), "pos": 3})
    blob = io.BytesIO()
    torch.save({fmt.key(("pos",)): Position()}, blob)
    _rewrite_header(
        header, lambda body: body.update(objects=base64.b64encode(blob.getvalue()).decode())
    )
    with pytest.raises(IntegrityError, match="weights_only"):
        tier.load("step-4", {"w": torch.zeros(8), "pos": 0})


def test_a_restore_falls_back_past_a_snapshot_with_a_refused_pickle(tmp_path):
    policy = SavePolicy(memory=Every(steps=1), local=Every(steps=2), remote=None)
    with CheckpointManager(memory=tmp_path / "shm", local=tmp_path / "disk", policy=policy) as mgr:
        for step in range(4):
            mgr.save(step, {"w": torch.full((8,), float(step)), "pos": step})
    (header,) = [
        p
        for p in (tmp_path / "shm" / "rank-0").glob("slot-*.json")
        if b'"step-3"' in p.read_bytes()
    ]
    blob = io.BytesIO()
    torch.save({fmt.key(("pos",)): Position()}, blob)
    _rewrite_header(
        header, lambda body: body.update(objects=base64.b64encode(blob.getvalue()).decode())
    )
    state = {"w": torch.zeros(8), "pos": -1}
    with CheckpointManager(memory=tmp_path / "shm", local=tmp_path / "disk", policy=policy) as mgr:
        assert mgr.restore(state) == 3  # step-2 from disk
    assert torch.equal(state["w"], torch.full((8,), 2.0)) and state["pos"] == 2


def _first_region(**changes):
    return lambda path: _rewrite_header(path, lambda b: b["tensors"][0].update(changes))


HEADERS = {
    "nbytes": lambda path: _rewrite_header(
        path, lambda b: b["tensors"][0].update(nbytes=b["tensors"][0]["nbytes"] + 4)
    ),
    "dtype": _first_region(dtype="torch.nothing"),
    "negative shape": _first_region(shape=[-2, -4]),
    "negative offset": _first_region(offset=-64),
    "1e999": lambda path: path.write_bytes(
        re.sub(rb'"data_size": ?', b'"data_size": 1e999, "x": ', path.read_bytes(), count=1)
    ),
    "200k-deep JSON": lambda path: path.write_bytes(DEEP),
}


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_a_memory_header_that_disagrees_with_itself_is_a_manifest_error(tmp_path, case):
    tier, header = _memory_step(tmp_path, {"w": torch.ones(8)})
    HEADERS[case](header)
    with pytest.raises(ManifestError):
        fmt.decode_header(header.read_bytes(), where=str(header))
    assert tier.steps() == {}  # the slot is ignored, with a warning
