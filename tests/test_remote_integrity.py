"""What the remote tier holds is what was written, and only one save owns a step name there.

Against a real S3 server (moto on 127.0.0.1), with a real proxy that corrupts upload bodies."""

from __future__ import annotations

import json
import threading

import pytest
import s3fs
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import RemoteConfig, TieredStorageWriter, UploadFailedError
from dcp_tiered.tiers.remote import Durability
from tests.conftest import injected_faults
from tests.test_remote_tier import FAST_RETRY, equal, load, save, state


def config(s3, endpoint=None, **kw) -> RemoteConfig:
    return RemoteConfig(url=s3.url(), storage_options=s3.options(endpoint), retry=FAST_RETRY, **kw)


def keys_under(s3, url: str) -> list[str]:
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.options())
    base = url.removeprefix("s3://")
    return sorted(k[len(base) + 1 :] for k in fs.find(base))


def test_an_upload_the_store_keeps_corrupt_is_caught_and_sent_again(tmp_path, s3, fault_proxy):
    proxy = fault_proxy(0.0, corrupt=".distcp", corrupt_count=1)
    cfg = config(s3, proxy)
    writer = save(tmp_path / "local", cfg, "step-1", state(1))
    writer.wait_durable("step-1", timeout_secs=120)
    assert injected_faults(proxy)["corrupted"] == 1
    direct = RemoteConfig(url=cfg.url, storage_options=s3.options(), retry=FAST_RETRY)
    got, reader = load(tmp_path / "fresh", direct)
    assert equal(got, state(1)) and reader.files_read_remotely


def test_a_store_that_always_corrupts_never_gets_a_durable_step(tmp_path, s3, fault_proxy):
    proxy = fault_proxy(0.0, corrupt=".distcp", corrupt_count=100)
    cfg = config(s3, proxy)
    writer = save(tmp_path / "local", cfg, "step-1", state(1))
    with pytest.raises(UploadFailedError, match="other bytes than were uploaded"):
        writer.wait_durable("step-1", timeout_secs=120)
    assert writer.durability("step-1") == Durability.COMMITTED_LOCAL
    assert "step-1/_COMMITTED.json" not in keys_under(s3, cfg.url)
    writer.close(wait_durable=False)


def test_an_item_larger_than_one_get_is_restored_whole_and_checked_whole(tmp_path, s3):
    """A 40 MiB tensor is read in three ranged GETs and joined: restored equal, and a byte
    flipped on the store in its last piece fails the load with the item named."""
    cfg = config(s3)
    writer = save(tmp_path / "local", cfg, "step-1", state(3, mib=40))
    writer.wait_durable("step-1", timeout_secs=120)
    writer.close()
    got, reader = load(tmp_path / "fresh", cfg, "step-1", mib=40)
    assert equal(got, state(3, mib=40)) and reader.files_read_remotely
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.options())
    found = fs.find(cfg.url.removeprefix("s3://"), detail=True)
    key = max((k for k in found if k.endswith(".distcp")), key=lambda k: found[k]["size"])
    data = bytearray(fs.cat(key))
    data[len(data) * 7 // 8] ^= 0xFF
    fs.pipe(key, bytes(data))
    with pytest.raises(CheckpointException, match=r"IntegrityError: corrupt data .* item 'a'"):
        load(tmp_path / "fresh-2", cfg, "step-1", mib=40)


@pytest.mark.parametrize("same_run", [True, False], ids=["one run", "two runs"])
def test_two_jobs_saving_one_step_name_into_one_prefix_never_both_succeed(tmp_path, s3, same_run):
    """Of one run (``run_id=`` the same), the exclusive marker decides and the loser removes
    its own objects; of two runs, the prefix is the first run's and the other writes nothing
    there (refused, naming the first)."""
    cfg = config(s3)
    results: dict[int, BaseException | None] = {}

    def job(i: int) -> None:
        run_id = "shared-run" if same_run else f"run-{i}"
        writer = save(tmp_path / f"job{i}", cfg, "step-1", state(i, mib=4), run_id=run_id)
        try:
            writer.wait_durable("step-1", timeout_secs=120)
            results[i] = None
        except UploadFailedError as e:
            results[i] = e
        writer.close(wait_durable=False)

    threads = [threading.Thread(target=job, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, e in results.items() if e is None]
    assert len(winners) == 1, results
    loser = 3 - winners[0]
    expected = "another save" if same_run else f"belongs to run 'run-{winners[0]}'"
    assert expected in str(results[loser]), results[loser]
    got, _ = load(tmp_path / "fresh", cfg, mib=4)
    assert equal(got, state(winners[0], mib=4))  # the winner's bytes, not a mixture
    # Only the winner's save is left under the step: the loser removed its own objects.
    saves = {k.split("/")[1] for k in keys_under(s3, cfg.url) if k.count("/") >= 2}
    assert len(saves) == 1


def test_objects_of_a_save_never_committed_are_removed_by_the_next_writer(
    tmp_path, s3, fault_proxy
):
    """The sweep removes this run's claimed saves that never committed, once old enough and
    held by no root of the run; never what it cannot prove is its run's (see
    tests/test_sweep_ownership.py for the foreign objects it leaves alone)."""
    # The marker of step-2 is refused: its data is uploaded, its step never committed.
    cfg = config(s3, fault_proxy(0.0, deny="_COMMITTED"))
    writer = save(tmp_path / "a", cfg, "step-2", state(2))
    with pytest.raises(UploadFailedError):
        writer.wait_durable("step-2", timeout_secs=60)
    writer.close(wait_durable=False)
    left = [k for k in keys_under(s3, cfg.url) if k.endswith(".distcp")]
    assert left
    # Another node, not holding step-2: too young to be an orphan, then old enough.
    plain = RemoteConfig(url=cfg.url, storage_options=s3.options(), retry=FAST_RETRY)
    TieredStorageWriter(tmp_path / "b", remote=plain).recover()
    assert [k for k in keys_under(s3, cfg.url) if k.endswith(".distcp")] == left
    young = RemoteConfig(
        url=cfg.url, storage_options=s3.options(), retry=FAST_RETRY, orphan_grace_secs=0
    )
    # The root that holds step-2 committed keeps its objects, and its upload resumes.
    keeper = TieredStorageWriter(tmp_path / "a", remote=young)
    keeper.recover()
    keeper.wait_durable("step-2", timeout_secs=60)
    keeper.close()
    # A save of the run killed before its commit (its claim names the run): nobody holds it,
    # so its objects go; the same objects without a claim are not provably ours: they stay.
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.options())
    base = cfg.url.removeprefix("s3://")
    run_id = json.loads(fs.cat(f"{base}/.dcp-tiered-run.json"))["run_id"]
    claim = {"format": "dcp-tiered-claim", "run_id": run_id, "step": "step-3"}
    fs.pipe(f"{base}/step-3/0123456789ab/__0_0.distcp", b"x" * 1000)
    fs.pipe(
        f"{base}/step-3/0123456789ab/_claims/node-0.json",
        json.dumps({**claim, "save_id": "0123456789ab"}).encode(),
    )
    fs.pipe(f"{base}/step-3/00000000ffff/__0_0.distcp", b"y" * 1000)  # no claim
    TieredStorageWriter(tmp_path / "c", remote=young).recover()
    keys = keys_under(s3, cfg.url)
    assert not any(k.startswith("step-3/0123456789ab/") for k in keys), keys
    assert "step-3/00000000ffff/__0_0.distcp" in keys
    assert "step-2/_COMMITTED.json" in keys
    got, _ = load(tmp_path / "fresh", plain)
    assert equal(got, state(2))


def test_a_step_in_the_earlier_remote_layout_still_restores(tmp_path, s3):
    """Layout 1 kept a step's objects directly under STEP/; its marker had no "layout"."""
    cfg = config(s3)
    save(tmp_path / "local", cfg, "step-1", state(1)).wait_durable("step-1", timeout_secs=60)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.options())
    base = cfg.url.removeprefix("s3://")
    marker = json.loads(fs.cat(f"{base}/step-1/_COMMITTED.json"))
    sid = marker.pop("layout") and marker["save_id"]
    for key in fs.find(f"{base}/step-1/{sid}/"):
        fs.mv(key, key.replace(f"/step-1/{sid}/", "/step-1/"))
    fs.pipe(f"{base}/step-1/_COMMITTED.json", json.dumps(marker).encode())
    got, reader = load(tmp_path / "fresh", cfg)
    assert equal(got, state(1)) and reader.files_read_remotely


def test_a_writer_whose_step_another_job_replaced_is_not_told_it_is_durable(tmp_path):
    from dcp_tiered.backends.local import LocalBackend
    from dcp_tiered.tiers.root import Tiers

    remote = RemoteConfig(url=f"file://{tmp_path}/remote", retry=FAST_RETRY)
    root = tmp_path / "shared"
    # Hold the root's upload queue until both jobs have saved, so the first one's promotion
    # reads the local step after the second job replaced it.
    gate = threading.Event()
    tiers = Tiers.open(root, remote)  # one upload queue for both
    tiers.upload_queue()._steps.submit(gate.wait)
    first = save(tiers, None, "step-1", state(1), overwrite=True)
    second = save(tiers, None, "step-1", state(2), overwrite=True)
    gate.set()
    second.wait_durable("step-1", timeout_secs=60)
    with pytest.raises(UploadFailedError, match="another save"):
        first.wait_durable("step-1", timeout_secs=60)
    got, _ = load(tmp_path / "fresh", remote)
    assert equal(got, state(2))
    first.close(wait_durable=False)
    second.close()
    tiers.close(wait_durable=False)


def test_a_reader_never_sees_a_half_written_marker_or_pointer_on_a_file_remote(tmp_path):
    """Markers and the latest pointer are created and replaced while other ranks read them
    (a follower checks its step is still its own while the coordinator commits). On a
    ``file://`` remote, as on S3, a reader gets the whole object or none, never a prefix."""
    from dcp_tiered.backends.remote import RemoteBackend

    remote = RemoteBackend(RemoteConfig(url=f"file://{tmp_path / 'remote'}"))
    body = json.dumps({"save_id": "x" * 4_000_000}).encode()  # big enough to be seen torn
    done, seen = threading.Event(), []

    def read() -> None:
        while not done.is_set():
            for key in ("step-1/_COMMITTED.json", "latest.json"):
                try:
                    seen.append(len(remote.get_bytes(key)))
                except FileNotFoundError:
                    pass

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(30):
            assert remote.create_exclusive("step-1/_COMMITTED.json", body)
            assert not remote.create_exclusive("step-1/_COMMITTED.json", b"{}")
            remote.put_bytes("latest.json", body if i % 2 else body[:-2] + b" }")
            remote.remove("step-1/_COMMITTED.json", reason="test")
    finally:
        done.set()
        reader.join()
    assert seen and set(seen) <= {len(body)}, sorted(set(seen))[:5]
    assert sorted(p.name for p in (tmp_path / "remote").rglob("*")) == ["latest.json", "step-1"]
