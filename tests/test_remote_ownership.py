"""Run identity on the remote tier: the orphan sweep, "durable", quarantine, pull and the acts
that delete the last local copy, each acting only on proof (issue 29).

Real stores: a ``file://`` directory and the moto S3 server on 127.0.0.1, with the fault proxy
where the store must fail; what would be lost is compared byte for byte."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

import pytest
import s3fs
import torch

from dcp_tiered import (
    CheckpointManager,
    Every,
    ForeignRunError,
    RemoteConfig,
    RetryConfig,
    SavePolicy,
    TierUnavailableError,
    TieredStorageWriter,
    UploadFailedError,
)
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.backends.remote import RemoteBackend
from dcp_tiered.cli import main
from dcp_tiered.tiers.local import LocalTier
from dcp_tiered.tiers.root import Tiers
from tests.conftest import heal
from tests.test_remote_tier import FAST_RETRY, equal, load, save, state

DAY = 24 * 3600
BRIEF = RetryConfig(max_attempts=2, initial_backoff_secs=0.05, max_backoff_secs=0.1)


class Raw:
    """The store's objects under one remote URL, read and written behind dcp_tiered's back."""

    def __init__(self, url: str, options: dict) -> None:
        self.url, self.options = url, options
        if url.startswith("file://"):
            self.base, self.fs = Path(url[7:]), None
        else:
            self.fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
            self.base = url.removeprefix("s3://")

    def put(self, key: str, data: bytes, *, age: float = 0) -> None:
        if self.fs is None:
            path = self.base / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            if age:
                os.utime(path, (time.time() - age, time.time() - age))
        else:
            self.fs.pipe_file(f"{self.base}/{key}", data)

    def get(self, key: str) -> bytes:
        if self.fs is None:
            return (self.base / key).read_bytes()
        return self.fs.cat_file(f"{self.base}/{key}")

    def keys(self) -> set[str]:
        if self.fs is None:
            return {str(p.relative_to(self.base)) for p in self.base.rglob("*") if p.is_file()}
        self.fs.invalidate_cache()
        return {k[len(self.base) + 1 :] for k in self.fs.find(self.base)}

    def delete(self, key: str) -> None:
        if self.fs is None:
            (self.base / key).unlink()
        else:
            self.fs.rm_file(f"{self.base}/{key}")


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path) -> Raw:
    if request.param == "file":
        return Raw(f"file://{tmp_path / 'remote'}", {})
    s3 = request.getfixturevalue("s3")
    return Raw(s3.url(), s3.options())


def config(
    store: Raw, endpoint_url: str | None = None, *, retries: int | None = None, **kw
) -> RemoteConfig:
    """``retries``: botocore's own retries of each request (see tests.s3server.s3fs_options)."""
    options = dict(store.options)
    if endpoint_url is not None:
        options["client_kwargs"] = {
            **options.get("client_kwargs", {}),
            "endpoint_url": endpoint_url,
        }
    if retries is not None:
        options["config_kwargs"] = {
            **options.get("config_kwargs", {}),
            "retries": {"max_attempts": retries},
        }
    return RemoteConfig(url=store.url, storage_options=options, retry=FAST_RETRY, **kw)


def durable(root: Path, cfg: RemoteConfig, step: str, value: float, **kw) -> str:
    writer = save(root, cfg, step, state(value), **kw)
    writer.wait_durable(step, timeout_secs=120)
    writer.close()
    return LocalTier(LocalBackend(root)).read_manifest(step).save_id


def claim(run_id: str, step: str, save_id: str) -> bytes:
    body = {"format": "dcp-tiered-claim", "run_id": run_id, "step": step, "save_id": save_id}
    return json.dumps(body).encode()


def test_the_orphan_sweep_removes_only_what_it_proves_is_its_runs(tmp_path, store):
    """Objects shaped like `<name>/<hex>/...` that no claim of the run names survive the sweep
    whatever their age and layout (the issue's examples and more); the run's own killed save
    goes, and only the keys of our grammar in it."""
    cfg = config(store, orphan_grace_secs=0)
    sid = durable(tmp_path / "a", cfg, "step-1", 1)
    run_id = json.loads(store.get(".dcp-tiered-run.json"))["run_id"]
    foreign = {
        "logs/2024/app.log": b"a log line\n",
        "models/abc123/weights.bin": b"\x01" * 2048,
        "cache/ff/blob": b"blob",
        "runs/1/events.out": b"events",
        "ckpt/deadbeef/.metadata": b"not ours",
        "step-9/00aa11bb22cc/__0_0.distcp": b"x" * 100,  # our grammar, nobody's claim
        "step-1/abcdef012345/manifest.json": b"{}",  # beside the committed save, unclaimed
        "data/3/step-1/0a0a0a0a/__0_0.distcp": b"y" * 10,  # hashed-looking, unclaimed
        f"step-1/{sid}/notes.txt": b"a user's note in the committed save",
        "step-2/ffff0000/_claims/node-0.json": claim("another-run", "step-2", "ffff0000"),
        "step-2/ffff0000/__0_0.distcp": b"another run's killed save",
        "step-5/0123456789ab/README.txt": b"not in our grammar, inside our orphan",
    }
    ours = {
        "step-5/0123456789ab/_claims/node-0.json": claim(run_id, "step-5", "0123456789ab"),
        "step-5/0123456789ab/__0_0.distcp": b"z" * 100,
        "step-5/0123456789ab/_nodes/node-0.json": b"{}",
    }
    for key, data in {**foreign, **ours}.items():
        store.put(key, data, age=2 * DAY)
    # A fresh node of the run (its root records nothing: it joins the prefix's run), then the
    # run's own root, recover: each sweeps.
    TieredStorageWriter(tmp_path / "b", remote=cfg).recover()
    TieredStorageWriter(tmp_path / "a", remote=cfg).recover()
    keys = store.keys()
    assert {k: store.get(k) for k in foreign} == foreign
    assert not keys & set(ours), sorted(keys & set(ours))
    got, _ = load(tmp_path / "fresh", cfg)
    assert equal(got, state(1))


def test_objects_gone_after_their_early_upload_are_sent_again_after_a_restart(
    tmp_path, s3, fault_proxy
):
    """The early uploads succeed, then the store fails the promotion; the data objects vanish
    (another job's sweep, a lifecycle rule, an operator); the job restarts: its earlier
    process's upload records prove nothing, so each file is checked on the store, sent again,
    and only then is the step called durable."""
    store = Raw(s3.url(), s3.options())
    root = tmp_path / "a"
    failing = config(store, fault_proxy(0.0, deny="/_nodes/"))
    writer = save(root, failing, "step-1", state(1, mib=2))
    with pytest.raises(UploadFailedError):
        writer.wait_durable("step-1", timeout_secs=60)
    writer.close(wait_durable=False)
    assert list(root.glob(".step-1.*.dcp-tiered-up/*.done")), "the early uploads ran"
    data = [k for k in store.keys() if k.endswith(".distcp")]
    assert data
    for key in data:
        store.delete(key)
    again = TieredStorageWriter(root, remote=config(store))
    again.recover()
    again.wait_durable("step-1", timeout_secs=120)
    again.close()
    assert set(data) <= store.keys()
    got, _ = load(tmp_path / "fresh", config(store), mib=2)
    assert equal(got, state(1, mib=2))


def test_objects_gone_before_the_commit_are_sent_again_before_the_marker(tmp_path):
    """Within one process: the early uploads are done and recorded, the objects vanish before
    the promotion runs; the commit's listing of the save finds them missing and they are sent
    again before the marker is written."""
    store = Raw(f"file://{tmp_path / 'remote'}", {})
    cfg, root = config(store), tmp_path / "a"
    gate = threading.Event()
    tiers = Tiers.open(root, cfg)
    tiers.upload_queue()._steps.submit(gate.wait)  # the promotion waits until objects are gone
    writer = save(tiers, None, "step-1", state(1, mib=2), thread_count=2)
    # Early uploads are best effort: one deferred to the promotion (seen once in four CI runs
    # under load) waits behind the gate, so after a while the test goes on with those that
    # did arrive early (at least one: the path under test).
    deadline = time.monotonic() + 60
    while len([k for k in store.keys() if k.endswith(".distcp")]) < 2:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [k for k in store.keys() if k.endswith(".distcp")], store.keys()
    time.sleep(0.2)  # the .done records are written just after the uploads
    for key in [k for k in store.keys() if k.endswith(".distcp")]:
        store.delete(key)
    gate.set()
    writer.wait_durable("step-1", timeout_secs=60)
    writer.close()
    tiers.close()
    got, _ = load(tmp_path / "fresh", cfg, mib=2)
    assert equal(got, state(1, mib=2))


def _cli_env(store: Raw, monkeypatch) -> None:
    if store.fs is not None:
        for k, v in {
            "AWS_ACCESS_KEY_ID": store.options["key"],
            "AWS_SECRET_ACCESS_KEY": store.options["secret"],
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": store.options["client_kwargs"]["endpoint_url"],
        }.items():
            monkeypatch.setenv(k, v)


def test_deleting_the_last_local_copy_asks_the_store_not_the_marker(
    tmp_path, store, capsys, monkeypatch
):
    """A step whose marker is there but whose objects are not is not "durable" to `rm` and to
    retention: the local copy, the only whole one, is kept."""
    _cli_env(store, monkeypatch)
    root = tmp_path / "root"
    for n in (1, 2, 3):
        durable(root, config(store), f"step-{n}", n)
    sid = LocalTier(LocalBackend(root)).read_manifest("step-1").save_id
    for key in [k for k in store.keys() if k.startswith(f"step-1/{sid}/__")]:
        store.delete(key)
    capsys.readouterr()
    assert main(["rm", str(root), "step-1", "--json"]) == 2
    answer = json.loads(capsys.readouterr().out)
    assert "only durable copy" in answer["errors"][0]["message"]
    assert main(["prune", str(root), "--keep-latest", "1", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["deleted"] == ["step-2"] and answer["kept_not_durable"] == ["step-1"]
    got, _ = load(root, None, "step-1")
    assert equal(got, state(1))


def test_a_second_run_on_a_prefix_is_refused_at_start_and_changes_nothing(tmp_path, store):
    cfg = config(store)
    durable(tmp_path / "a", cfg, "step-10", 10, run_id="run-a")
    before = {k: store.get(k) for k in store.keys()}
    b = tmp_path / "b"
    save(b, None, "step-3", state(3), run_id="run-b")  # job B's own root, its own run
    with pytest.raises(ForeignRunError) as e:
        CheckpointManager(local=b, remote=cfg)
    assert "run 'run-a'" in str(e.value) and store.url in str(e.value)
    assert {k: store.get(k) for k in store.keys()} == before


def _manager(root: Path, cfg: RemoteConfig, **kw) -> CheckpointManager:
    every = Every(steps=1)
    return CheckpointManager(
        local=root, remote=cfg, policy=SavePolicy(memory=None, local=every, remote=every), **kw
    )


def test_a_transient_read_error_never_quarantines_a_good_step(tmp_path, s3, fault_proxy):
    """A fresh node whose reads of step 3's data fail for a while: the restore refuses to
    start from an older step (or, when told to skip, restores step 2 and leaves step 3
    committed); once the store answers, step 3 restores."""
    store = Raw(s3.url(), s3.options())
    mgr = _manager(tmp_path / "a", config(store))
    for n in (1, 2, 3):
        mgr.save(n, {"app": state(n)})
    mgr.close()
    marker = json.loads(store.get("step-3/_COMMITTED.json"))
    proxy = fault_proxy(0.0, fail_reads=f"step-3/{marker['save_id']}/__")
    # Each read is tried twice (BRIEF), each try once by botocore: the store's failure, not
    # botocore's backoff, is what the restore meets.
    flaky = dataclasses.replace(config(store, proxy, retries=0), retry=BRIEF)
    fresh = _manager(tmp_path / "fresh", flaky)
    app = {"app": state(0)}
    with pytest.raises(TierUnavailableError, match="step-3"):
        fresh.restore(app)
    assert fresh.restore(app, on_unreadable_tier="skip") == 3  # step 2 restored
    assert equal(app["app"], state(2))
    assert json.loads(store.get("step-3/_COMMITTED.json")) == marker  # still committed
    assert not [k for k in store.keys() if "_quarantined" in k]
    fresh.close()
    heal(proxy)
    again = _manager(tmp_path / "fresh2", flaky)
    assert again.restore(app) == 4 and equal(app["app"], state(3))
    again.close()


def test_a_step_that_does_not_fit_is_passed_over_but_never_quarantined(tmp_path):
    """Falling back past a step without proof it is bad (here: the state no longer fits it)
    leaves it committed on every tier; only proof (a checksum) quarantines."""
    store = Raw(f"file://{tmp_path / 'remote'}", {})
    root = tmp_path / "a"
    mgr = _manager(root, config(store))
    mgr.save(2, {"app": {"w": torch.ones(4, 4)}})
    mgr.save(3, {"app": {"w": torch.ones(8, 8)}})  # the model grew
    mgr.close()
    again = _manager(root, config(store))
    app = {"app": {"w": torch.zeros(4, 4)}}
    assert again.restore(app) == 3 and torch.equal(app["app"]["w"], torch.ones(4, 4))
    again.close()
    assert (root / "step-3").is_dir() and not list(root.glob(".step-3.*quarantined"))
    assert "step-3/_COMMITTED.json" in store.keys()
    assert not [k for k in store.keys() if "_quarantined" in k]


def test_pull_never_replaces_a_step_a_job_committed_during_the_download(
    tmp_path, s3, fault_proxy, capsys, monkeypatch
):
    store = Raw(s3.url(), s3.options())
    sid = durable(tmp_path / "a", config(store), "step-5", 5, run_id="run-a")
    proxy = fault_proxy(0.0, slow_reads=f"step-5/{sid}/__", slow_secs=3.0)
    _cli_env(store, monkeypatch)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy)
    node = tmp_path / "node"
    node.mkdir()
    result: dict = {}
    pull = threading.Thread(
        target=lambda: result.update(
            code=main(["pull", str(node), "step-5", "--remote", store.url, "--json"])
        )
    )
    pull.start()
    time.sleep(1.0)  # the download is under way
    save(node, None, "step-5", state(50), run_id="run-a")  # the job commits step-5 meanwhile
    job = LocalTier(LocalBackend(node)).read_manifest("step-5").save_id
    pull.join(timeout=120)
    out = capsys.readouterr().out
    assert result["code"] == 2 and "CheckpointExistsError" in out, out
    assert LocalTier(LocalBackend(node)).read_manifest("step-5").save_id == job != sid
    got, _ = load(node, None, "step-5")
    assert equal(got, state(50))


def test_export_force_replaces_only_an_earlier_export(tmp_path, capsys):
    """Not the root's own file:// remote tier, another root's steps, or an export a user added
    files to."""
    pytest.importorskip("safetensors")
    store = Raw(f"file://{tmp_path / 'remote'}", {})
    root, other = tmp_path / "root", tmp_path / "other"
    durable(root, config(store), "step-1", 1)
    save(other, None, "step-2", state(2))
    earlier = tmp_path / "earlier"
    assert main(["export", str(root), "step-1", str(earlier)]) == 0
    (earlier / "my-notes.txt").write_text("mine")
    for out in (store.base, other, earlier):
        before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
        capsys.readouterr()
        assert main(["export", str(root), "step-1", str(out), "--force", "--json"]) == 2
        assert "ForeignPathError" in capsys.readouterr().out
        assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    got, _ = load(tmp_path / "fresh", config(store))
    assert equal(got, state(1))
