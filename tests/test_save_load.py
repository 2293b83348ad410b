"""Single-process behaviour of the writer and reader: the common paths and every bad input."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    IntegrityError,
    ManifestError,
    MissingShardError,
    TieredStorageReader,
    TieredStorageWriter,
    _torch_compat,
)
from dcp_tiered.reader import _local
from tests._manifests import index, items, tamper, tensor_id
from tests.conftest import visible


def state(v: float = 1.0) -> dict:
    return {
        "w": torch.full((64, 32), v),
        "view": torch.arange(40, dtype=torch.float64).view(8, 5)[:, 1:3] * v,
        "nested": {"i": torch.tensor([int(v)]), "n": int(v), "s": f"v{v}", "l": [1, 2.5, None]},
    }


def blank() -> dict:
    s = state(0.0)
    s["nested"].update(n=-1, s="", l=[])
    return s


def save(root, step, sd, **kw) -> None:
    dcp.save(sd, checkpoint_id=step, storage_writer=TieredStorageWriter(root, **kw), no_dist=True)


def load(root, step="latest", **kw) -> dict:
    sd = blank()
    dcp.load(sd, checkpoint_id=step, storage_reader=TieredStorageReader(root, **kw), no_dist=True)
    return sd


def failure(exc_info) -> BaseException:
    """The rank-0 error inside DCP's CheckpointException (a BaseException)."""
    err = exc_info.value
    if isinstance(err, CheckpointException):
        err = next(iter(err.failures.values()))
        return err[0] if isinstance(err, tuple) else err  # (exception, traceback)
    return err


def assert_state_equal(a: dict, b: dict) -> None:
    for k in ("w", "view"):
        assert torch.equal(a[k], b[k]), k
    assert torch.equal(a["nested"]["i"], b["nested"]["i"])
    assert {k: v for k, v in a["nested"].items() if k != "i"} == {
        k: v for k, v in b["nested"].items() if k != "i"
    }


def test_round_trip_and_latest(tmp_path):
    save(tmp_path, "step-1", state(1))
    save(tmp_path, "step-10", state(10))
    save(tmp_path, "step-2", state(2))  # saved later, but step-10 is the newest step
    assert_state_equal(load(tmp_path), state(10))
    assert_state_equal(load(tmp_path, "step-2"), state(2))
    assert visible(tmp_path) == ["step-1", "step-10", "step-2"]


def test_async_thread_save_is_isolated_from_later_mutation(tmp_path):
    writer = TieredStorageWriter(tmp_path)
    sd = state(3)
    futs = []
    for step in range(4):  # more saves than buffers: reuse must never corrupt one in flight
        futs.append(
            dcp.async_save(sd, checkpoint_id=f"step-{step}", storage_writer=writer, no_dist=True)
        )
        sd["w"].add_(1)
        sd["nested"]["n"] += 1
    for f in futs:
        f.result()
    for step in range(4):
        expect = state(3)
        expect["w"] += step
        expect["nested"]["n"] += step
        assert_state_equal(load(tmp_path, f"step-{step}"), expect)
    writer.close()


def test_async_error_reaches_the_future(tmp_path):
    writer = TieredStorageWriter(tmp_path)
    dcp.save(state(), checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    fut = dcp.async_save(state(), checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    with pytest.raises(CheckpointException) as e:
        fut.result()
    assert isinstance(failure(e), CheckpointExistsError)


def test_writer_pickles_without_buffers(tmp_path):
    writer = TieredStorageWriter(tmp_path)
    writer.stage(state())
    clone = pickle.loads(pickle.dumps(writer))
    assert clone.root == writer.root and clone._stager is None
    dcp.save(state(5), checkpoint_id="step-5", storage_writer=clone, no_dist=True)
    assert_state_equal(load(tmp_path), state(5))


@pytest.mark.parametrize(
    "bad", ["/abs", "../up", "a/b", "..", ".hidden", "", "latest", 7, "step-1\n", "step\n1", True]
)
def test_unsafe_step_names_are_refused(tmp_path, bad):
    with pytest.raises(BaseException) as e:
        save(tmp_path / "r", bad, state())
    assert isinstance(failure(e), ConfigError)
    assert not (tmp_path / "r").exists() or os.listdir(tmp_path / "r") == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_path_that_is_not_a_step_of_ours_is_never_replaced(tmp_path, overwrite):
    """A directory (or file) at the step's path that holds no committed step is refused with
    a clear error and left exactly as it was, even with overwrite=True."""
    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-1" / "model.pt").write_bytes(b"the user's own")
    (tmp_path / "step-2").write_bytes(b"a file")
    for step in ("step-1", "step-2"):
        with pytest.raises(BaseException) as e:
            save(tmp_path, step, state(), overwrite=overwrite)
        err = failure(e)
        assert isinstance(err, CheckpointExistsError) and "left untouched" in str(err), err
    assert (tmp_path / "step-1" / "model.pt").read_bytes() == b"the user's own"
    assert os.listdir(tmp_path / "step-1") == ["model.pt"]
    assert (tmp_path / "step-2").read_bytes() == b"a file"
    save(tmp_path, "step-3", state(3), overwrite=overwrite)  # the writer is not blocked
    assert_state_equal(load(tmp_path), state(3))


def test_a_pending_directory_is_replaced_by_the_commit_and_swept_after_a_crash(tmp_path):
    """What a shim claimed for a step before its commit (mcore's common.pt) is ours: the
    commit replaces it; after a crash a sweep removes exactly the files it was claimed for."""
    from dcp_tiered.backends.local import LocalBackend
    from dcp_tiered.tiers.local import LocalTier

    tier = LocalTier(LocalBackend(tmp_path))
    assert tier.claim_pending("step-1", ["common.pt"])
    (tmp_path / "step-1" / "common.pt").write_bytes(b"x")
    save(tmp_path, "step-1", state(1))
    assert tier.has_step("step-1") and not (tmp_path / "step-1" / "common.pt").exists()
    assert tier.claim_pending("step-2", ["common.pt"])
    (tmp_path / "step-2" / "common.pt").write_bytes(b"x")
    (tmp_path / "step-3").mkdir()
    (tmp_path / "step-3" / "common.pt").write_bytes(b"not claimed")
    (tmp_path / "step-4").mkdir()
    (tmp_path / "step-4" / "notes.txt").write_bytes(b"mine")
    assert not tier.claim_pending("step-4", ["common.pt"])  # holds something else
    tier.sweep_pending()
    assert not (tmp_path / "step-2").exists()
    assert (tmp_path / "step-3" / "common.pt").read_bytes() == b"not claimed"
    assert (tmp_path / "step-4" / "notes.txt").read_bytes() == b"mine"
    assert tier.has_step("step-1")


def test_missing_step_lists_existing(tmp_path):
    save(tmp_path, "step-1", state())
    with pytest.raises(CheckpointException) as e:
        load(tmp_path, "step-9")
    err = failure(e)
    assert isinstance(err, CheckpointNotFoundError) and "step-1" in str(err)
    with pytest.raises(CheckpointException) as e:
        load(tmp_path / "empty")
    assert isinstance(failure(e), CheckpointNotFoundError)


def test_overwrite_refused_by_default_and_atomic_when_asked(tmp_path):
    save(tmp_path, "step-1", state(1))
    with pytest.raises(CheckpointException) as e:
        save(tmp_path, "step-1", state(2))
    assert isinstance(failure(e), CheckpointExistsError)
    assert_state_equal(load(tmp_path), state(1))
    save(tmp_path, "step-1", state(2), overwrite=True)
    assert_state_equal(load(tmp_path), state(2))
    assert visible(tmp_path) == ["step-1"]


def _data_file(root, step="step-1"):
    return next(p for p in (root / step).iterdir() if p.suffix == ".distcp")


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_raises_integrity_error(tmp_path, where):
    save(tmp_path, "step-1", state())
    path = _data_file(tmp_path)
    data = bytearray(path.read_bytes())
    pos = {"first": 0, "middle": len(data) // 2, "last": len(data) - 1}[where]
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as e:
        load(tmp_path)
    err = failure(e)
    assert isinstance(err, IntegrityError)
    assert "step-1" in str(err) and path.name in str(err) and "rank 0" in str(err)


def test_truncated_file_raises_integrity_error(tmp_path):
    save(tmp_path, "step-1", state())
    path = _data_file(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointException) as e:
        load(tmp_path)
    assert isinstance(failure(e), IntegrityError)


def test_missing_shard_names_the_file(tmp_path):
    save(tmp_path, "step-1", state())
    path = _data_file(tmp_path)
    path.unlink()
    with pytest.raises(CheckpointException) as e:
        load(tmp_path)
    err = failure(e)
    assert isinstance(err, MissingShardError) and path.name in str(err)


@pytest.mark.parametrize("edit", ["garbage", "checksum", "version", "path-escape"])
def test_tampered_manifest_is_refused(tmp_path, edit):
    save(tmp_path, "step-1", state())
    step = tmp_path / "step-1"
    if edit == "garbage":
        (step / "manifest.json").write_text("{not json")
    elif edit == "checksum":  # an item's checksum, the section's own left as it was
        tamper(step, edit_section=lambda s: s["files"][0].update(crcs="0" * 8), reseal=False)
    elif edit == "version":
        tamper(step, edit_index=lambda b: b.update(version=99))
    else:  # resealed, so that the check of the name itself is what refuses it
        tamper(step, edit_section=lambda s: s["files"][0].update(name="../../etc/passwd"))
    with pytest.raises(CheckpointException) as e:
        load(tmp_path)
    assert isinstance(failure(e), ManifestError)


def big_state() -> dict:
    torch.manual_seed(3)
    return {
        "f32": torch.randn(300, 70),
        "bf16": torch.randn(64, 128).to(torch.bfloat16),
        "i64": torch.arange(5000),
        "transposed": torch.randn(96, 80).t(),  # not contiguous: saved row-major
        "u8": torch.randint(0, 255, (10000,), dtype=torch.uint8),
        "small": torch.randn(3),  # under 4 KiB: located by its bytes (test_many_items.py)
    }


def assert_big_state_load_fails_on(root, fqn: str) -> None:
    with pytest.raises(CheckpointException) as e:
        dcp.load(
            {k: torch.zeros_like(v) for k, v in big_state().items()},
            checkpoint_id="step-1",
            storage_reader=TieredStorageReader(root),
            no_dist=True,
        )
    assert isinstance(failure(e), IntegrityError) and fqn in str(failure(e))


@pytest.fixture(params=["in blocks", "in place"])
def read_path(request, monkeypatch) -> tuple[str, list[int]]:
    """How big_state's tensors are read: from blocks of neighbouring items (the default at
    their size), or each straight into its target (the reader's threshold for that lowered
    under the largest); with the sizes of the tensors read straight in."""
    if request.param == "in place":
        monkeypatch.setattr(_local, "_IN_PLACE_MIN_BYTES", 64 * 2**10)
    direct: list[int] = []
    original = _local.LocalReads._direct_parts

    def counted(loc, target):
        direct.append(target.nbytes)
        return original(loc, target)

    monkeypatch.setattr(_local.LocalReads, "_direct_parts", staticmethod(counted))
    return request.param, direct


def test_large_tensors_are_read_in_place_bit_exact(tmp_path, read_path):
    src = big_state()
    save(tmp_path, "step-1", src)
    in_place = {i["fqn"] for i in items(tmp_path / "step-1") if i["raw_offset"] is not None}
    assert in_place == set(src)
    for reader in (TieredStorageReader(tmp_path), FileSystemReader(tmp_path / "step-1")):
        out = {k: torch.zeros_like(v) for k, v in src.items()}
        dcp.load(out, storage_reader=reader, no_dist=True)
        for k, v in src.items():
            assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
    how, direct = read_path
    assert direct == ([src["f32"].nbytes] if how == "in place" else [])


def test_flipped_byte_inside_a_tensor_read_in_place_is_caught(tmp_path, read_path):
    save(tmp_path, "step-1", big_state())
    entry = next(i for i in items(tmp_path / "step-1") if i["fqn"] == "f32")
    path = tmp_path / "step-1" / entry["file"]
    data = bytearray(path.read_bytes())
    data[entry["offset"] + entry["raw_offset"] + 1000] ^= 0x01  # inside the tensor's own bytes
    path.write_bytes(bytes(data))
    assert_big_state_load_fails_on(tmp_path, "f32")


def test_targets_that_cannot_take_the_bytes_directly_still_load_exactly(tmp_path, read_path):
    src = big_state()
    save(tmp_path, "step-1", src)
    out = {k: torch.zeros_like(v) for k, v in src.items()}
    out["f32"] = torch.zeros(70, 300).t()  # same shape, not contiguous
    out["i64"] = torch.zeros(5000, dtype=torch.float64)  # another dtype: converted by copy_
    dcp.load(
        out, checkpoint_id="step-1", storage_reader=TieredStorageReader(tmp_path), no_dist=True
    )
    assert torch.equal(out["f32"], src["f32"]) and torch.equal(out["bf16"], src["bf16"])
    assert torch.equal(out["i64"], src["i64"].double())


def test_raw_offset_that_does_not_fit_the_item_is_refused(tmp_path, read_path):
    save(tmp_path, "step-1", big_state())
    step = tmp_path / "step-1"
    f32 = tensor_id(index(step), "f32")

    def misplace(section: dict) -> None:  # consistent checksums, inconsistent layout
        for f in section["files"]:
            for i, tid in enumerate(f["ids"]):
                if tid == f32:
                    f["raw"][i] = f["lengths"][i] - 8

    tamper(step, edit_section=misplace)
    assert_big_state_load_fails_on(tmp_path, "f32")


class CachingPlanner(DefaultSavePlanner):
    """DCP's planner with plan caching; ``sent`` records, save by save, whether this rank sent
    its local plan (True) or DCP found it unchanged and replayed the cached one (False)."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)
        self.sent: list[bool] = []

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.sent.append(plan.usable)
        return plan


def test_plan_caching_replays_the_plan_and_each_save_is_its_own(tmp_path):
    _torch_compat.forget_save_plans()  # DCP's cache lives as long as the process
    planner = CachingPlanner()
    writer = TieredStorageWriter(tmp_path)
    for v in (1, 2, 3):
        dcp.save(
            state(v),
            checkpoint_id=f"step-{v}",
            storage_writer=writer,
            planner=planner,
            no_dist=True,
        )
    assert planner.sent == [True, False, False]  # saves 2 and 3 replayed DCP's cached plan
    ids = set()
    for v in (1, 2, 3):
        assert_state_equal(load(tmp_path, f"step-{v}"), state(v))
        body = index(tmp_path / f"step-{v}")
        assert body["step"] == f"step-{v}"
        ids.add(body["save_id"])
        vanilla = blank()
        dcp.load(vanilla, storage_reader=FileSystemReader(tmp_path / f"step-{v}"), no_dist=True)
        assert_state_equal(vanilla, state(v))
    assert len(ids) == 3


def test_plan_cached_for_another_root_is_refused_then_planned_afresh(tmp_path):
    _torch_compat.forget_save_plans()
    planner = CachingPlanner()
    dcp.save(
        state(1),
        checkpoint_id="step-1",
        storage_writer=TieredStorageWriter(tmp_path / "a"),
        planner=planner,
        no_dist=True,
    )
    other = TieredStorageWriter(tmp_path / "b")
    with pytest.raises(CheckpointException) as e:
        dcp.save(
            state(2), checkpoint_id="step-2", storage_writer=other, planner=planner, no_dist=True
        )
    assert isinstance(failure(e), ConfigError) and str(tmp_path / "a") in str(failure(e))
    assert not list((tmp_path / "b").glob("*step-2*"))  # nothing written
    dcp.save(state(2), checkpoint_id="step-2", storage_writer=other, planner=planner, no_dist=True)
    assert planner.sent == [True, False, True]
    assert_state_equal(load(tmp_path / "b", "step-2"), state(2))


class Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_tampered_metadata_pickle_executes_nothing(tmp_path):
    save(tmp_path, "step-1", state())
    marker = tmp_path / "pwned"
    (tmp_path / "step-1" / ".metadata").write_bytes(pickle.dumps(Boom(str(marker))))
    assert_state_equal(load(tmp_path), state())  # we read the manifest, never .metadata
    assert not marker.exists()


def test_malicious_byte_item_executes_nothing(tmp_path):
    marker = tmp_path / "pwned"
    sd = state()
    sd["evil"] = Boom(str(marker))
    save(tmp_path / "ck", "step-1", sd)
    assert not marker.exists()
    target = blank()
    target["evil"] = None
    with pytest.raises(CheckpointException) as e:
        dcp.load(target, storage_reader=TieredStorageReader(tmp_path / "ck"), no_dist=True)
    assert isinstance(failure(e), IntegrityError) and "allow_pickle" in str(failure(e))
    assert not marker.exists()


def test_vanilla_filesystem_reader_loads_our_step(tmp_path):
    save(tmp_path, "step-1", state(4))
    sd = blank()
    dcp.load(sd, storage_reader=FileSystemReader(tmp_path / "step-1"), no_dist=True)
    assert_state_equal(sd, state(4))


def test_reader_loads_vanilla_checkpoint_with_warning(tmp_path, caplog):
    dcp.save(state(6), storage_writer=FileSystemWriter(tmp_path / "step-6"), no_dist=True)
    assert_state_equal(load(tmp_path, "step-6"), state(6))
    assert "cannot be verified" in caplog.text
    sd = blank()  # or the vanilla directory itself as the root
    dcp.load(sd, storage_reader=TieredStorageReader(tmp_path / "step-6"), no_dist=True)
    assert_state_equal(sd, state(6))


def test_vanilla_metadata_with_payload_is_refused(tmp_path):
    dcp.save(state(), storage_writer=FileSystemWriter(tmp_path / "v"), no_dist=True)
    marker = tmp_path / "pwned"
    (tmp_path / "v" / ".metadata").write_bytes(pickle.dumps(Boom(str(marker))))
    with pytest.raises(BaseException) as e:
        dcp.load(blank(), storage_reader=TieredStorageReader(tmp_path / "v"), no_dist=True)
    # The restricted unpickler (safe_unpickle) refuses the first global it meets that is not
    # one of DCP's metadata classes, here os.system (pickled as posix.system), by name; the
    # reader reports that as a ManifestError naming the refusal.
    err = failure(e)
    assert isinstance(err, ManifestError), repr(err)
    assert "DCP .metadata is corrupt or contains disallowed objects" in str(err)
    assert f"(refusing to load {os.system.__module__}.system); it was not executed" in str(err)
    assert not marker.exists()


def test_stale_temporary_directories_are_swept_inside_root_only(tmp_path, caplog):
    root = tmp_path / "root"
    save(root, "step-1", state())
    stale = root / ".step-2.abc123.dcp-tiered-tmp"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    (stale / ".dcp-tiered.lock").touch()  # unlocked lock file: its writer is gone
    outside = tmp_path / ".step-3.def456.dcp-tiered-tmp"
    outside.mkdir()
    caplog.set_level("INFO", logger="dcp_tiered")
    TieredStorageWriter(root).recover()
    assert not stale.exists() and outside.exists()
    assert "deleting" in caplog.text and str(stale) in caplog.text
    assert_state_equal(load(root), state())


def test_interrupted_non_atomic_overwrite_is_rolled_back(tmp_path):
    """A crash between the two renames of a non-atomic overwrite: the committed step is only
    under its hidden old name. A reader finds it anyway (before any writer recovers the root),
    and a writer's recovery gives it back its name too."""
    save(tmp_path, "step-1", state(1))
    os.rename(tmp_path / "step-1", tmp_path / ".step-1.abc.dcp-tiered-old")
    assert_state_equal(load(tmp_path), state(1))  # 'latest' with no writer in sight
    save(tmp_path, "step-2", state(2))
    os.rename(tmp_path / "step-2", tmp_path / ".step-2.abc.dcp-tiered-old")
    TieredStorageWriter(tmp_path).recover()
    assert (tmp_path / "step-2" / "manifest.json").is_file()
    assert_state_equal(load(tmp_path), state(2))


def test_import_emits_no_warnings_and_has_no_side_effects(tmp_path):
    import subprocess
    import sys

    code = "import logging, dcp_tiered; assert not logging.getLogger('dcp_tiered').handlers"
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_stager_tracks_the_executor_thread_of_each_async_save(tmp_path):
    """Buffer reuse and save ordering rely on recognising the thread DCP's THREAD executor
    starts (DCP gives writers no completion hook); a torch upgrade renaming it fails here."""
    writer = TieredStorageWriter(tmp_path)
    fut = dcp.async_save(state(), checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    tracked = [t for slot in writer._stager._slots for t in slot.threads]
    fut.result()
    assert len(tracked) == 1 and tracked[0].name.startswith("AsyncCheckpointExecutor")


def test_untracked_async_save_never_has_its_buffers_reused(tmp_path):
    """If no executor thread can be recognised, buffer reuse is given up, not risked."""
    writer = TieredStorageWriter(tmp_path)
    sd = state(1)
    staged = writer.stage(sd)
    writer.synchronize_staging()  # no executor thread was started: nothing to track
    writer.stage(state(2))  # the other buffer set
    writer.synchronize_staging()
    again = writer.stage(state(3))  # back to the first slot: must not overwrite `staged`
    assert torch.equal(staged["w"], state(1)["w"]) and torch.equal(again["w"], state(3)["w"])
    assert staged["w"].data_ptr() != again["w"].data_ptr()


# ---------------------------------------------------------------- hostile entries in a root


@pytest.mark.parametrize(
    "edit", ["negative-offset", "huge-length", "negative-size", "deep-json", "huge-int", "infinity"]
)
def test_crafted_numbers_are_refused_before_any_read(tmp_path, edit):
    save(tmp_path, "step-1", state())
    step = tmp_path / "step-1"
    path = step / "manifest.json"

    def first_file(edit_file):
        tamper(step, edit_section=lambda s: edit_file(s["files"][0]))

    if edit == "negative-offset":
        first_file(
            lambda f: f.update(offsets=[-4096] * len(f["ids"]), lengths=[64] * len(f["ids"]))
        )
    elif edit == "huge-length":
        first_file(lambda f: f.update(lengths=[8 * 2**30] * len(f["ids"]), size=8 * 2**31))
    elif edit == "negative-size":
        first_file(lambda f: f.update(size=-1, lengths=[0] * len(f["ids"])))
    elif edit == "deep-json":
        path.write_text("[" * 200_000 + "]" * 200_000)
    elif edit == "huge-int":
        tamper(step, edit_index=lambda b: b.update(world_size=int("9" * 4000)))
    else:
        tamper(step, edit_index=lambda b: b.update(world_size=float("inf")))
    with pytest.raises(CheckpointException) as e:
        load(tmp_path, "step-1")
    assert isinstance(failure(e), (ManifestError, IntegrityError)), failure(e)


def test_bad_entries_in_other_steps_neither_block_nor_hang_a_good_load(tmp_path):
    """Beside a good step: steps whose manifest is a FIFO, a link to /dev/zero, or deeply
    nested JSON, and a step directory that is a link out of the root. Loading the good step
    works at once; asking for a bad one gives a typed error; nothing outside is read."""
    save(tmp_path / "root", "step-1", state(1))
    root = tmp_path / "root"
    for step, make in (
        ("step-7", lambda p: os.mkfifo(p)),
        ("step-8", lambda p: os.symlink("/dev/zero", p)),
        ("step-9", lambda p: p.write_text("[" * 200_000)),
    ):
        (root / step).mkdir()
        make(root / step / "manifest.json")
    save(tmp_path / "elsewhere", "step-20", state(20))
    os.symlink(tmp_path / "elsewhere" / "step-20", root / "step-20")
    assert_state_equal(load(root, "step-1"), state(1))
    for step in ("step-7", "step-8", "step-9"):
        with pytest.raises(CheckpointException) as e:
            load(root, step)
        assert isinstance(failure(e), ManifestError), failure(e)
    with pytest.raises(CheckpointException) as e:
        load(root, "step-20")  # a link is not a step of ours
    assert isinstance(failure(e), CheckpointNotFoundError)
    save(root, "step-21", state(21))  # the writer (sweep, planning) is not blocked either
    assert_state_equal(load(root, "step-21"), state(21))


def test_a_data_file_that_is_a_link_is_never_read(tmp_path):
    save(tmp_path / "root", "step-1", state(1))
    save(tmp_path / "other", "step-1", state(2))
    data = _data_file(tmp_path / "root")
    data.unlink()
    os.symlink(_data_file(tmp_path / "other"), data)  # same name and size, other bytes
    with pytest.raises(CheckpointException) as e:
        load(tmp_path / "root", "step-1")
    assert isinstance(failure(e), MissingShardError) and "never read" in str(failure(e))


@pytest.mark.parametrize("same_run", [True, False], ids=["one run", "two runs"])
def test_a_step_another_job_commits_meanwhile_is_never_replaced(tmp_path, same_run):
    """Two writers on one root save the same step name: the one that commits first keeps it;
    the other is refused (not told "saved") and leaves nothing behind. Of one run, at its
    commit's rename; of another run, before it writes, because the root is the first's."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    from dcp_tiered import ForeignRunError

    root = tmp_path / "shared"
    first, second = ("r1", "r1") if same_run else ("r1", "r2")

    class OtherJobCommitsMidway(DefaultSavePlanner):
        def finish_plan(self, new_plan):  # after this save checked the step is free
            save(root, "step-5", state(2.0), run_id=first)
            return super().finish_plan(new_plan)

    with pytest.raises(BaseException) as e:
        dcp.save(
            state(1.0),
            checkpoint_id="step-5",
            storage_writer=TieredStorageWriter(root, run_id=second),
            planner=OtherJobCommitsMidway(),
            no_dist=True,
        )
    err = failure(e)
    if same_run:
        assert isinstance(err, CheckpointExistsError) and "another job" in str(err)
    else:
        assert isinstance(err, ForeignRunError) and "'r1'" in str(err), err
    assert_state_equal(load(root, "step-5"), state(2.0))
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".step")) == []
