"""The remote tier against a real S3 server on 127.0.0.1 (moto, or DCP_TIERED_TEST_S3_ENDPOINT)
and against file:// remotes. No mocks: faults are injected by a real HTTP proxy."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading

import pytest
import s3fs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import (
    CheckpointNotFoundError,
    ConfigError,
    IntegrityError,
    MissingShardError,
    PermanentTierError,
    RemoteConfig,
    RetryConfig,
    TieredStorageReader,
    TieredStorageWriter,
    UploadFailedError,
)
from dcp_tiered.backends.remote import RemoteBackend
from dcp_tiered.tiers.remote import Durability, RemoteTier
from dcp_tiered.tiers.root import Tiers
from tests.conftest import REPO, Gate, injected_faults

FAST_RETRY = RetryConfig(max_attempts=12, initial_backoff_secs=0.05, max_backoff_secs=0.5)


def state(v: float, mib: float = 1) -> dict:
    n = int(mib * 2**18)
    return {
        "a": torch.arange(n, dtype=torch.float32) + v,
        "b": torch.full((64, 64), v),
        "meta": {"v": v, "tag": f"s{v}"},
    }


def blank(mib: float = 1) -> dict:
    return {
        "a": torch.zeros(int(mib * 2**18)),
        "b": torch.zeros(64, 64),
        "meta": {"v": -1.0, "tag": ""},
    }


def equal(x: dict, y: dict) -> bool:
    return torch.equal(x["a"], y["a"]) and torch.equal(x["b"], y["b"]) and x["meta"] == y["meta"]


@pytest.fixture(params=["s3", "file"])
def remote(request, s3, tmp_path):
    if request.param == "s3":
        return RemoteConfig(url=s3.url(), storage_options=s3.options(), retry=FAST_RETRY)
    return RemoteConfig(url=f"file://{tmp_path}/remote", retry=FAST_RETRY)


def save(root, remote, step, sd, **kw) -> TieredStorageWriter:
    writer = TieredStorageWriter(root, remote=remote, **kw)
    dcp.save(sd, checkpoint_id=step, storage_writer=writer, no_dist=True)
    return writer


def load(
    root, remote=None, step="latest", mib: float = 1, **kw
) -> tuple[dict, TieredStorageReader]:
    sd = blank(mib)
    reader = TieredStorageReader(root, remote=remote, **kw)
    dcp.load(sd, checkpoint_id=step, storage_reader=reader, no_dist=True)
    return sd, reader


def test_step_becomes_durable_and_restores_from_remote_alone(tmp_path, remote):
    root = tmp_path / "local"
    writer = save(root, remote, "step-1", state(1))
    assert writer.durability("step-1") in (Durability.COMMITTED_LOCAL, Durability.DURABLE_REMOTE)
    writer.wait_durable("step-1", timeout_secs=60)
    assert writer.durability("step-1") == Durability.DURABLE_REMOTE
    save(root, remote, "step-2", state(2)).wait_durable(timeout_secs=60)
    shutil.rmtree(root)  # a replacement node: nothing local
    got, reader = load(root, remote)
    assert reader.checkpoint_id == "step-2" and equal(got, state(2))
    assert reader.files_read_remotely
    got, _ = load(root, remote, "step-1")
    assert equal(got, state(1))


def test_wait_durable_of_a_step_async_save_still_writes(tmp_path, remote, monkeypatch):
    """``wait_durable(step)`` right after ``dcp.async_save`` returned: the step is neither
    committed nor uploading yet; the wait covers its write too, not CheckpointNotFoundError."""
    writer = TieredStorageWriter(tmp_path / "local", remote=remote)
    gate = Gate(monkeypatch, TieredStorageWriter, "set_up_storage_writer")  # before any write
    future = dcp.async_save(state(3), checkpoint_id="step-3", storage_writer=writer)
    assert gate.entered.wait(30)
    threading.Timer(0.5, gate.open.set).start()
    writer.wait_durable("step-3", timeout_secs=60)
    assert writer.durability("step-3") == Durability.DURABLE_REMOTE
    future.result()
    with pytest.raises(CheckpointNotFoundError, match="step-9"):
        writer.wait_durable("step-9", timeout_secs=5)  # no such save: as before
    got, _ = load(tmp_path / "other", remote, "step-3")
    assert equal(got, state(3))


def test_a_long_lived_reader_sees_steps_made_durable_after_it_was_built(tmp_path, remote):
    """One reader on a fresh node, 'latest' asked twice: the second time it names the step
    another node made durable meanwhile (no stale fsspec/s3fs listing)."""
    save(tmp_path / "a", remote, "step-1", state(1)).wait_durable(timeout_secs=60)
    reader = TieredStorageReader(tmp_path / "fresh", remote=remote)
    got = blank()
    dcp.load(got, checkpoint_id="latest", storage_reader=reader, no_dist=True)
    assert reader.checkpoint_id == "step-1"
    save(tmp_path / "b", remote, "step-2", state(2)).wait_durable(timeout_secs=60)
    dcp.load(got, checkpoint_id="latest", storage_reader=reader, no_dist=True)
    assert reader.checkpoint_id == "step-2" and equal(got, state(2))


def test_corrupt_local_file_is_fetched_from_remote_with_warning(tmp_path, remote, caplog):
    root = tmp_path / "local"
    save(root, remote, "step-1", state(1)).wait_durable(timeout_secs=60)
    data_file = next((root / "step-1").glob("*.distcp"))
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data_file.write_bytes(bytes(raw))
    got, reader = load(root, remote)
    assert equal(got, state(1))
    assert "corrupt" in caplog.text and data_file.name in reader.files_read_remotely


@pytest.mark.parametrize("fault", ["flipped", "truncated", "removed"])
def test_a_bad_local_copy_the_remote_lacks_fails_as_what_it_is(tmp_path, remote, fault):
    """A step committed locally only (not promoted), its data file damaged, loaded by a
    reader with a remote tier: the local failure is the error (IntegrityError as proof, or
    MissingShardError), not the remote's "not committed", so a restore quarantines the copy
    instead of keeping it as "not proven bad"."""
    root = tmp_path / "local"
    save(root, None, "step-1", state(1))
    data_file = next((root / "step-1").glob("*.distcp"))
    raw = bytearray(data_file.read_bytes())
    if fault == "flipped":
        raw[len(raw) // 2] ^= 0x10
        data_file.write_bytes(bytes(raw))
    elif fault == "truncated":
        data_file.write_bytes(bytes(raw[:-100]))
    else:
        data_file.unlink()
    with pytest.raises(CheckpointException) as e:
        load(root, remote, "step-1")
    error, _ = e.value.failures[0]  # (the rank's exception, its traceback)
    if fault == "removed":
        assert isinstance(error, MissingShardError) and "no remote tier holds" in str(error)
    else:
        assert isinstance(error, IntegrityError) and error.proves_bad, error
        assert "no committed copy of this step" in str(error) and data_file.name in str(error)


def test_hydrate_copies_fetched_files_into_the_local_tier(tmp_path, remote):
    root = tmp_path / "local"
    save(root, remote, "step-1", state(1)).wait_durable(timeout_secs=60)
    shutil.rmtree(root)
    load(root, remote, hydrate=True)
    got, reader = load(root)  # no remote at all now
    assert equal(got, state(1)) and not reader.files_read_remotely


def test_hash_prefix_strategy_spreads_data_and_restores(tmp_path, s3):
    cfg = RemoteConfig(
        url=s3.url(), storage_options=s3.options(), prefix_strategy="hash", retry=FAST_RETRY
    )
    root = tmp_path / "local"
    save(root, cfg, "step-1", state(1), thread_count=4).wait_durable(timeout_secs=60)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.options())
    keys = fs.find(cfg.url.removeprefix("s3://"))
    assert any("/data/" in k for k in keys)
    # A step named like the hashed data prefix would shadow, and its clean-up delete, every
    # other step's data: refused before anything is written, wherever the name is used.
    with pytest.raises(ConfigError, match="reserved"):
        save(root, cfg, "data", state(2))
    assert sorted(fs.find(cfg.url.removeprefix("s3://"))) == sorted(keys)
    shutil.rmtree(root)
    got, _ = load(root, cfg)
    assert equal(got, state(1))


def test_permanent_error_fails_fast_with_what_to_fix(tmp_path, s3):
    cfg = RemoteConfig(
        url="s3://no-such-bucket-dcp-tiered/run", storage_options=s3.options(), retry=FAST_RETRY
    )
    writer = save(tmp_path / "local", cfg, "step-1", state(1))
    with pytest.raises(UploadFailedError) as e:
        writer.wait_durable("step-1", timeout_secs=60)
    assert "NoSuchBucket" in str(e.value) and "create the bucket" in str(e.value)
    assert writer.durability("step-1") == Durability.COMMITTED_LOCAL  # still safe locally


def test_twenty_percent_faults_every_step_durable_and_never_partial(tmp_path, s3, fault_proxy):
    proxy = fault_proxy(rate=0.2, seed=7, stall_secs=4.0)
    cfg = RemoteConfig(
        url=s3.url(),
        storage_options=s3.options(proxy, read_timeout=2),
        part_size_bytes=5 * 2**20,
        max_concurrency=4,
        retry=RetryConfig(max_attempts=30, initial_backoff_secs=0.05, max_backoff_secs=0.5),
    )
    direct = RemoteConfig(url=cfg.url, storage_options=s3.options(), retry=FAST_RETRY)
    seen_bad: list[str] = []
    observed: set[str] = set()
    stop = threading.Event()

    def observer() -> None:  # every step that looks committed must be whole, at every moment
        listing = RemoteBackend(direct)
        while not stop.is_set():
            for step in RemoteTier(listing).steps():
                try:
                    got, _ = load(tmp_path / "obs-empty", direct, step, mib=12)
                    observed.add(step)
                    if not equal(got, state(int(step.split("-")[1]), mib=12)):
                        seen_bad.append(f"{step}: loaded, but not what was saved")
                except BaseException as e:  # noqa: BLE001
                    seen_bad.append(f"{step}: {e!r}")

    root = tmp_path / "local"
    writer = TieredStorageWriter(root, remote=cfg)
    watcher = threading.Thread(target=observer, daemon=True)
    watcher.start()
    try:
        for i in range(3):
            dcp.save(
                state(i, mib=12), checkpoint_id=f"step-{i}", storage_writer=writer, no_dist=True
            )
        writer.wait_durable(timeout_secs=300)
    finally:
        stop.set()
        watcher.join(timeout=120)
    assert seen_bad == []
    assert observed, "the observer never saw a committed step (a stale listing?)"
    shutil.rmtree(root)
    for i in range(3):
        sd = {"a": torch.zeros(12 * 2**18), "b": torch.zeros(64, 64), "meta": {"v": -1, "tag": ""}}
        dcp.load(
            sd,
            checkpoint_id=f"step-{i}",
            no_dist=True,
            storage_reader=TieredStorageReader(root, remote=cfg),
        )  # reads through faults too
        assert equal(sd, state(i, mib=12))
    faults = injected_faults(proxy)
    assert sum(v for k, v in faults.items() if k != "ok") >= 0.1 * sum(faults.values()), faults


def test_sigkill_during_upload_resumes_on_restart(tmp_path, s3):
    """The trainer dies mid-upload; the remote never shows the step committed before it is
    whole; a restarted writer resumes, skips what is there, and completes."""
    url = s3.url()
    script = tmp_path / "kill_mid_upload.py"
    script.write_text(f"""
import os, signal, sys, threading, time, torch, torch.distributed.checkpoint as dcp
sys.path.insert(0, {str(REPO)!r})
from dcp_tiered import RemoteConfig, TieredStorageWriter
import s3fs
cfg = RemoteConfig(url={url!r}, storage_options={s3.options()!r}, part_size_bytes=5 * 2**20,
                   max_concurrency=1)
original = s3fs.S3FileSystem._call_s3
parts = {{"n": 0}}
committed = os.path.join({str(tmp_path / "local")!r}, "step-1")
async def call_s3(self, method, *args, **kwargs):  # SIGKILL mid-multipart, after the commit
    if method == "upload_part" and os.path.isdir(committed):
        parts["n"] += 1
        if parts["n"] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
    return await original(self, method, *args, **kwargs)
s3fs.S3FileSystem._call_s3 = call_s3
sd = {{"a": torch.arange(24 * 2**18, dtype=torch.float32), "b": torch.ones(24 * 2**18)}}
w = TieredStorageWriter({str(tmp_path / "local")!r}, remote=cfg)
dcp.save(sd, checkpoint_id="step-1", storage_writer=w, no_dist=True)
w.wait_durable(timeout_secs=120)
print("NOT KILLED")
""")
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr
    cfg = RemoteConfig(url=url, storage_options=s3.options(), retry=FAST_RETRY)
    assert RemoteTier(RemoteBackend(cfg)).steps() == []  # not visible before it is whole
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.options())
    bucket, prefix = url.removeprefix("s3://").split("/", 1)

    def incomplete_uploads() -> list:
        return fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])

    assert len(incomplete_uploads()) == 1  # killed in the middle of a multipart upload
    writer = TieredStorageWriter(tmp_path / "local", remote=cfg)  # restart: resumes the upload
    writer.wait_durable("step-1", timeout_secs=120)
    assert incomplete_uploads() == []
    sd = {"a": torch.zeros(24 * 2**18), "b": torch.zeros(24 * 2**18)}
    dcp.load(sd, no_dist=True, storage_reader=TieredStorageReader(tmp_path / "empty", remote=cfg))
    assert torch.equal(sd["a"], torch.arange(24 * 2**18, dtype=torch.float32))
    assert torch.equal(sd["b"], torch.ones(24 * 2**18))


def test_remote_writer_and_reader_pickle(tmp_path, s3):
    import pickle

    cfg = RemoteConfig(url=s3.url(), storage_options=s3.options())
    tiers = Tiers.open(tmp_path, cfg)
    w = TieredStorageWriter(tiers)
    assert tiers.remote is not None
    RemoteTier(tiers.remote).steps()  # creates a client, which must not travel
    clone = pickle.loads(pickle.dumps(w))
    assert clone._tiers.remote._fs is None and clone._tiers.remote.config == cfg
    assert isinstance(
        pickle.loads(pickle.dumps(TieredStorageReader(tmp_path, remote=cfg))), TieredStorageReader
    )


def test_local_overwrite_never_touches_a_committed_remote_step(tmp_path, remote):
    root = tmp_path / "local"
    save(root, remote, "step-1", state(1)).wait_durable(timeout_secs=60)
    writer = save(root, remote, "step-1", state(2), overwrite=True)
    with pytest.raises(UploadFailedError, match="never overwritten"):
        writer.wait_durable("step-1", timeout_secs=60)
    got, _ = load(tmp_path / "empty", remote)  # the durable copy is still the first save
    assert equal(got, state(1))


def test_unreachable_remote_still_restores_the_local_copy(tmp_path, s3, caplog):
    root = tmp_path / "local"
    save(root, None, "step-1", state(1))
    dead = RemoteConfig(
        url=f"s3://{s3.bucket}/run",
        retry=RetryConfig(max_attempts=2),
        storage_options=s3.options("http://127.0.0.1:9", retries=0),
    )  # nothing listens
    got, reader = load(root, dead)
    assert equal(got, state(1)) and "unavailable" in caplog.text


def test_unreachable_remote_and_nothing_local_is_not_called_an_empty_run(tmp_path, s3):
    """Nothing local and a remote that cannot be read: the error says the tier cannot be read
    (typed, naming it), not that no checkpoint exists."""
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_tiered import TierUnavailableError

    dead = RemoteConfig(
        url=f"s3://{s3.bucket}/run",
        retry=RetryConfig(max_attempts=2),
        storage_options=s3.options("http://127.0.0.1:9", retries=0),
    )  # nothing listens
    with pytest.raises(CheckpointException) as e:
        load(tmp_path / "fresh", dead)
    ((err, *_),) = [f if isinstance(f, tuple) else (f,) for f in e.value.failures.values()]
    assert isinstance(err, TierUnavailableError) and f"s3://{s3.bucket}/run" in str(err)


def test_missing_bucket_is_reported_not_mistaken_for_an_empty_run(tmp_path, s3):
    """A reader whose remote names no bucket refuses, saying what to fix, before it guesses
    which step is the latest; without the remote, the local copy loads."""
    from torch.distributed.checkpoint.api import CheckpointException

    root = tmp_path / "local"
    save(root, None, "step-1", state(1))
    typo = RemoteConfig(
        url="s3://no-such-bucket-dcp-tiered/run", storage_options=s3.options(), retry=FAST_RETRY
    )
    with pytest.raises(CheckpointException) as e:
        load(root, typo)
    ((err, *_),) = [f if isinstance(f, tuple) else (f,) for f in e.value.failures.values()]
    assert isinstance(err, PermanentTierError) and "NoSuchBucket" in str(err), err
    assert "create the bucket" in str(err)
    got, _ = load(root, None)
    assert equal(got, state(1))
