"""Hostile records read back from storage: remote commit markers, the remote ``latest`` pointer,
pending markers and the tiers record, truncated, replaced, nested deep, holding 1e999, of the
wrong types or naming a save that is not there. Each makes its own step unreadable, with a
typed error and a WARNING; none stops a job from starting, listing, pruning, or loading the
other steps. Real stores (``file://`` and the moto server), real files, the CLI in a process
of its own."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import (
    CheckpointManager,
    CheckpointNotFoundError,
    DcpTieredError,
    Every,
    ManifestError,
    RemoteConfig,
    Retention,
    RetentionPolicy,
    RetryConfig,
    SavePolicy,
    TieredStorageReader,
    TieredStorageWriter,
)
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.backends.remote import RemoteBackend
from dcp_tiered.cli import main
from dcp_tiered.policy import layout, records
from dcp_tiered.policy.prefixes import PrefixStrategy
from dcp_tiered.tiers import catalog
from dcp_tiered.tiers.local import LocalTier
from dcp_tiered.tiers.remote import RemoteTier

FAST = RetryConfig(max_attempts=3, initial_backoff_secs=0.02, max_backoff_secs=0.1)
STEPS = ["epoch-3", "epoch-4", "epoch-5"]  # names and numbers the examples do not use
DEEP = b"[" * 200_000 + b"]" * 200_000


@pytest.fixture(params=["file", "s3"])
def remote(request, tmp_path, monkeypatch) -> RemoteConfig:
    """A remote tier; for S3 the moto server, its endpoint also in the environment for the
    CLI's own process."""
    if request.param == "file":
        return RemoteConfig(url=f"file://{tmp_path / 'remote'}", retry=FAST)
    s3 = request.getfixturevalue("s3")
    for k, v in {
        "AWS_ACCESS_KEY_ID": s3.key,
        "AWS_SECRET_ACCESS_KEY": s3.secret,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3.endpoint,
    }.items():
        monkeypatch.setenv(k, v)
    return RemoteConfig(url=s3.url(), storage_options=s3.options(), retry=FAST)


def _state(value: float) -> dict:
    return {"w": torch.full((300,), value), "b": torch.arange(5000, dtype=torch.float64)}


def _save_steps(root, remote: RemoteConfig, steps=STEPS) -> None:
    with TieredStorageWriter(root, remote=remote, sync_files=False) as writer:
        for i, step in enumerate(steps):
            dcp.save(_state(float(i)), checkpoint_id=step, storage_writer=writer, no_dist=True)
    # close() waited until every step is durable


def _load(root, remote: RemoteConfig, step: str) -> dict:
    state = _state(-1.0)
    reader = TieredStorageReader(root, remote=remote)
    dcp.load(state, checkpoint_id=step, storage_reader=reader, no_dist=True)
    return state


def _cause(e: CheckpointException) -> BaseException:
    (failure,) = e.failures.values()
    return failure[0] if isinstance(failure, tuple) else failure


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dcp_tiered.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )


def _marker(body: dict, **changes) -> bytes:
    return json.dumps({**body, **changes}).encode()


# What a marker may be replaced with: (bytes from the good marker, the typed error it gives).
MARKERS = {
    "a JSON list": (lambda m, raw: b'["epoch-4", 1]', ManifestError),
    "1e999": (
        lambda m, raw: raw.replace(b'"committed_at_ns": ', b'"committed_at_ns": 1e999, "x": '),
        ManifestError,
    ),
    "NaN": (lambda m, raw: _marker(m, committed_at_ns=float("nan")), ManifestError),
    "200k-deep JSON": (lambda m, raw: DEEP, ManifestError),
    "deep inside an object": (
        lambda m, raw: raw[:-1] + b', "x": ' + b"{" * 50 + b"}" * 50 + b"}",
        ManifestError,
    ),
    "truncated": (lambda m, raw: raw[: len(raw) // 2], ManifestError),
    "a commit time that is a string": (
        lambda m, raw: _marker(m, committed_at_ns="yesterday"),
        ManifestError,
    ),
    "a save id that is a path": (lambda m, raw: _marker(m, save_id="../../x"), ManifestError),
    "a save id that is a number": (lambda m, raw: _marker(m, save_id=17), ManifestError),
    "another step's marker": (lambda m, raw: _marker(m, step="epoch-5"), ManifestError),
    "2**40 hash prefixes": (lambda m, raw: _marker(m, hash_prefixes=2**40), ManifestError),
    "a run id that is a path": (lambda m, raw: _marker(m, run_id="../other"), ManifestError),
    "a run id that is a list": (lambda m, raw: _marker(m, run_id=["a"]), ManifestError),
    "a missing save": (lambda m, raw: _marker(m, save_id="abcdef0123"), CheckpointNotFoundError),
}


S3_MARKERS = {
    "a JSON list",
    "1e999",
    "200k-deep JSON",
    "a save id that is a path",
    "a missing save",
}


def test_a_hostile_marker_makes_only_its_step_unreadable(tmp_path, remote, caplog, capsys):
    """Every kind of bad marker in turn, on one set of saved steps (the good marker put back
    after each); the CLI in a process of its own for the deep one, in this one for the rest."""
    root, fresh = tmp_path / "root", tmp_path / "fresh"
    _save_steps(root, remote)
    fresh.mkdir()
    store = RemoteBackend(remote)
    key = f"epoch-4/{layout.REMOTE_MARKER}"
    raw = store.get_bytes(key)
    # Every case on file://; on S3 (slower per request) the ones that exercise the parser's
    # guards and the missing save.
    cases = sorted(MARKERS) if remote.url.startswith("file://") else sorted(S3_MARKERS)
    for n, case in enumerate(cases):
        make, expected = MARKERS[case]
        store.put_bytes(key, make(json.loads(raw), raw))
        caplog.clear()
        # Starting: recovery (with the orphan sweep) and a manager, which both read markers.
        with caplog.at_level(logging.WARNING, logger="dcp_tiered"):
            writer = TieredStorageWriter(root, remote=remote, sync_files=False)
            writer.recover()
            writer.close(wait_durable=False)
            with CheckpointManager(local=tmp_path / f"mgr-{n}", remote=remote, events=None):
                pass
            listed = catalog.list_steps(LocalTier(LocalBackend(fresh)), store)
        # Listing leaves the step out, with a warning; a well-formed marker whose save is gone
        # is only found out when the save is read.
        hostile = expected is ManifestError
        names = [s.name for s in listed if s.remote]
        assert names == ["epoch-3"] + ["epoch-4"] * (not hostile) + ["epoch-5"], case
        if hostile:
            warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
            assert any("epoch-4" in w for w in warned), case
        # Loading that step on a node without a local copy: a typed error saying where.
        with pytest.raises(CheckpointException) as e:
            _load(fresh, remote, "epoch-4")
        cause = _cause(e.value)
        assert isinstance(cause, expected) and "epoch-4" in str(cause), (case, cause)
        # The local copy of the step still loads: the remote's marker does not shadow it.
        assert torch.equal(_load(root, remote, "epoch-4")["w"], _state(1.0)["w"]), case
        # Every other step, and 'latest', load from the remote alone.
        assert torch.equal(_load(fresh, remote, "epoch-3")["w"], _state(0.0)["w"]), case
        assert torch.equal(_load(fresh, remote, "latest")["w"], _state(2.0)["w"]), case
        # The CLI lists the rest and exits 0.
        if case == "200k-deep JSON":
            proc = _cli("status", str(fresh), "--remote", remote.url, "--json")
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        else:
            capsys.readouterr()
            code = main(["status", str(fresh), "--remote", remote.url, "--json"])
            out, err = capsys.readouterr()
        assert code == 0 and "Traceback" not in err, (case, err)
        rows = {r["step"]: r for r in json.loads(out)["steps"]}
        assert rows["epoch-3"]["remote"] and rows["epoch-5"]["remote"], case
        assert ("epoch-4" in rows) == (not hostile), case
        # verify --remote reports that step and checks the others; pull of it is a typed
        # refusal, pull of 'latest' works.
        capsys.readouterr()
        code = main(["verify", str(root), "--remote", remote.url, "--json"])
        results = {r["step"]: r for r in json.loads(capsys.readouterr().out)["steps"]}
        assert code == 1 and not results["epoch-4"]["ok"], (case, results)
        assert results["epoch-3"]["ok"] and results["epoch-5"]["ok"], case
        pulled = tmp_path / f"pulled-{n}"
        code = main(["pull", str(pulled), "epoch-4", "--remote", remote.url])
        assert code in (1, 2) and "Traceback" not in capsys.readouterr().err, case
        assert main(["pull", str(pulled), "latest", "--remote", remote.url]) == 0, case
        assert (pulled / "epoch-5" / "manifest.json").is_file(), case
    store.put_bytes(key, raw)


LATEST = {
    "a JSON list": b"[]",
    "1e999": None,  # built from the good pointer below
    "200k-deep JSON": DEEP,
    "truncated": b'{"step": "epo',
    "a step that is not a name": b'{"step": "../x", "marker": {}}',
    "a commit time that is a string of digits": None,
}


def test_a_hostile_latest_pointer_is_ignored_and_replaced(tmp_path, remote, caplog, capsys):
    """Each bad pointer in turn: 'latest' resolves by listing the root, with a warning, and
    the next save replaces the pointer with a good one."""
    root, fresh = tmp_path / "root", tmp_path / "fresh"
    fresh.mkdir()
    _save_steps(root, remote, STEPS[:2])
    store = RemoteBackend(remote)
    newest, value = "epoch-4", 1.0
    for n, (case, bad) in enumerate(sorted(LATEST.items())):
        good = json.loads(store.get_bytes(layout.REMOTE_LATEST))
        if case == "1e999":
            text = json.dumps(good)
            bad = text.replace('"committed_at_ns": ', '"committed_at_ns": 1e999, "x": ').encode()
        elif bad is None:
            good["marker"]["committed_at_ns"] = "2" * 70
            bad = json.dumps(good).encode()
        store.put_bytes(layout.REMOTE_LATEST, bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dcp_tiered"):
            assert catalog.remote_latest(store)[0] == newest, case  # by listing the root
            state = _load(fresh, remote, "latest")
        assert torch.equal(state["w"], _state(value)["w"]), case
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any("latest" in w for w in warned), case
        if case == "200k-deep JSON":
            proc = _cli("status", str(fresh), "--remote", remote.url, "--json")
            code, err = proc.returncode, proc.stderr
        else:
            capsys.readouterr()
            code = main(["status", str(fresh), "--remote", remote.url, "--json"])
            err = capsys.readouterr().err
        assert code == 0 and "Traceback" not in err, (case, err)
        # The next save moves the pointer on, replacing what was not a pointer of ours.
        newest, value = f"epoch-{10 + n}", 0.0
        _save_steps(root, remote, [newest])
        body = records.latest_pointer(store.get_bytes(layout.REMOTE_LATEST), where="latest")
        assert body["step"] == newest, case


def test_a_garbage_marker_of_a_step_on_disk_does_not_stop_retention(tmp_path):
    """Retention keeps the step whose marker it cannot read (its durability cannot be told)
    and prunes the others, pass after pass, instead of aborting every pass."""
    remote = RemoteConfig(url=f"file://{tmp_path / 'remote'}", retry=FAST)
    local = tmp_path / "disk"
    every = SavePolicy(memory=None, local=Every(steps=1), remote=Every(steps=1))
    keep_all = Retention(local=RetentionPolicy(keep_latest=100))
    with CheckpointManager(
        local=local, remote=remote, policy=every, retention=keep_all, events=None
    ) as mgr:
        for step in range(3):
            mgr.save(step, _state(float(step)))
    RemoteBackend(remote).put_bytes(f"step-0/{layout.REMOTE_MARKER}", b'{"step": "step-0", ')
    keep_two = Retention(local=RetentionPolicy(keep_latest=2))
    with CheckpointManager(
        local=local, remote=remote, policy=every, retention=keep_two, events=None
    ) as mgr:
        for step in range(3, 9):
            mgr.save(step, _state(float(step)))
            mgr.wait()
    kept = sorted(p.name for p in local.iterdir() if p.name.startswith("step-"))
    assert kept == ["step-0", "step-7", "step-8"]


def test_a_garbage_marker_of_a_step_pruned_locally_does_not_stop_the_start(tmp_path):
    """Recovery's orphan sweep reads the marker of every step with uploads under it: one it
    cannot read leaves that step's objects alone (which save is committed is unknown) and the
    job starts."""
    remote = RemoteConfig(url=f"file://{tmp_path / 'remote'}", retry=FAST, orphan_grace_secs=0)
    _save_steps(tmp_path / "old", remote, ["ckpt-11"])
    store = RemoteBackend(remote)
    orphan = "ckpt-11/0123456789ab/__0_0.distcp"  # a save id no marker names
    store.put_bytes(orphan, b"left by a killed upload")
    store.put_bytes(f"ckpt-11/{layout.REMOTE_MARKER}", b'{"step": "ckpt-11", "save_id": "')
    with CheckpointManager(local=tmp_path / "new", remote=remote, events=None):
        pass
    assert store.get_bytes(orphan) == b"left by a killed upload"


PENDING = {
    "200k-deep JSON": DEEP,
    "a JSON list": b'["sidecar.pt"]',
    "a sidecar that is a path": b'{"step": "ckpt-2", "sidecars": ["../../etc"], "whole": false}',
    "whole that is a string": b'{"step": "ckpt-2", "sidecars": [], "whole": "yes"}',
    "1e999": b'{"step": "ckpt-2", "sidecars": [], "whole": false, "n": 1e999}',
}


@pytest.mark.parametrize("case", sorted(PENDING))
def test_a_hostile_pending_marker_is_left_alone_and_the_writer_starts(tmp_path, case, caplog):
    root = tmp_path / "root"
    pending = root / "ckpt-2"
    pending.mkdir(parents=True)
    (pending / layout.PENDING_MARKER).write_bytes(PENDING[case])
    (pending / "sidecar.pt").write_bytes(b"someone's file")
    with caplog.at_level(logging.WARNING, logger="dcp_tiered"):
        LocalTier(LocalBackend(root)).sweep_pending()
        with TieredStorageWriter(root, sync_files=False) as writer:
            dcp.save(_state(1.0), checkpoint_id="ckpt-3", storage_writer=writer, no_dist=True)
    assert (pending / "sidecar.pt").read_bytes() == b"someone's file"
    assert (pending / layout.PENDING_MARKER).read_bytes() == PENDING[case]
    assert any("pending marker" in r.getMessage() for r in caplog.records)


def test_a_hostile_tiers_record_is_ignored_by_status_and_rewritten(tmp_path, capsys):
    """`status` warns and goes on without the record (the CLI in a process of its own for the
    deep one); the next writer records its remote again."""
    root = tmp_path / "root"
    url = f"file://{tmp_path / 'remote'}"
    _save_steps(root, RemoteConfig(url=url, retry=FAST), ["ckpt-1"])
    bodies = (DEEP, b"[1]", b'{"remote": 1e999}', b'{"remote": 7}', b'{"memory": [')
    bodies += (b'{"remote_retention": {"keep_latest": 0}}', b'{"remote_retention": [true]}')
    for body in bodies:
        (root / layout.TIERS_RECORD).write_bytes(body)
        if body is DEEP:
            proc = _cli("status", str(root), "--json")
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        else:
            capsys.readouterr()
            code = main(["status", str(root), "--json"])
            out, err = capsys.readouterr()
        assert code == 0 and "Traceback" not in err, (body[:20], err)
        assert layout.TIERS_RECORD in err  # the warning names it
        assert [r["step"] for r in json.loads(out)["steps"]] == ["ckpt-1"]
        with TieredStorageWriter(root, remote=url) as writer:
            writer.recover()  # records the remote again
        written = (root / layout.TIERS_RECORD).read_bytes()
        recorded = records.tiers_record(written, where="t")
        assert recorded == {"memory": None, "remote": url, "remote_retention": None}


def test_read_marker_keeps_its_contract(tmp_path):
    """What the lifecycle relies on: the marker dict, None when there is none, ManifestError
    (never JSONDecodeError, RecursionError, TypeError) when it is not a marker of ours."""
    remote = RemoteConfig(url=f"file://{tmp_path / 'remote'}", retry=FAST)
    _save_steps(tmp_path / "root", remote, ["ckpt-1"])
    store = RemoteBackend(remote)
    marker = RemoteTier(store).marker("ckpt-1")
    assert marker is not None and layout.is_save_id(marker["save_id"])
    assert RemoteTier(store).marker("ckpt-2") is None
    for bad in (DEEP, b"[]", b"{", b'{"save_id": "0a", "committed_at_ns": 1e999}', b"\xff"):
        store.put_bytes(f"ckpt-1/{layout.REMOTE_MARKER}", bad)
        with pytest.raises(ManifestError, match="ckpt-1/_COMMITTED.json"):
            RemoteTier(store).marker("ckpt-1")
    assert issubclass(ManifestError, DcpTieredError)


# ---------------------------------------------------------------- the record checks, unit


def test_node_and_quarantine_records_are_checked_field_by_field():
    good = {
        "save_id": "0a1b",
        "files": {"__0_0.distcp": {"size": 3, "checksum": "0a0b0c0d", "rank": 0}},
    }
    assert records.node_record(json.dumps(good).encode(), where="n", save_id_="0a1b") == good
    for bad in (
        {**good, "save_id": "../x"},
        {**good, "files": []},
        {**good, "files": {"../etc": good["files"]["__0_0.distcp"]}},
        {**good, "files": {"__0_0.distcp": {"size": -1, "checksum": "0a0b0c0d", "rank": 0}}},
        {**good, "files": {"__0_0.distcp": {"size": 3, "checksum": "zz", "rank": 0}}},
        {**good, "files": {"__0_0.distcp": {"size": True, "checksum": "0a0b0c0d", "rank": 0}}},
    ):
        with pytest.raises(ManifestError):
            records.node_record(json.dumps(bad).encode(), where="n")
    with pytest.raises(ManifestError, match="not of 0a1c"):
        records.node_record(json.dumps(good).encode(), where="n", save_id_="0a1c")
    marker = layout.marker_body("ckpt-1", "0a1b", 5, PrefixStrategy())
    record = {**marker, "quarantined_at_ns": 9, "reason": "restore fell back"}
    assert records.quarantine_record(json.dumps(record).encode(), step="ckpt-1", where="q")
    for bad in (
        {**record, "reason": 3},
        {**record, "quarantined_at_ns": "x"},
        {**record, "step": "x"},
    ):
        with pytest.raises(ManifestError):
            records.quarantine_record(json.dumps(bad).encode(), step="ckpt-1", where="q")


def test_the_parser_refuses_before_it_parses():
    with pytest.raises(ManifestError, match="more than the 100"):
        records.load_json(b" " * 101, where="x", max_bytes=100)
    with pytest.raises(ManifestError, match="nested 40 levels"):
        records.load_json(b'{"a": ' + b"[" * 39 + b"]" * 39 + b"}", where="x", max_bytes=10**6)
    # Brackets inside strings, escaped quotes included, are no nesting.
    text = json.dumps({"k": '"[[[[' * 50, "l": "\\" * 7 + "{" * 80}).encode()
    assert records.load_json(text, where="x", max_bytes=10**6)["k"].startswith('"[[[[')
    for bad in (b"1e999", b'{"a": -Infinity}', b'{"a": NaN}', b'{"a": 1' + b"0" * 5000 + b"}"):
        with pytest.raises(ManifestError):
            records.load_json(bad, where="x", max_bytes=10**6, expect=None)
    assert records.nesting_depth(b'[{"a": [1, {"b": []}]}]') == 5
    # UTF-16 is JSON to json.loads, not to us (no record of ours is written so)
    for encoding in ("utf-16", "utf-16-le", "utf-32"):
        with pytest.raises(ManifestError, match="not valid JSON"):
            records.load_json('{"a": 1}'.encode(encoding), where="x", max_bytes=100)


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


_TRICKY_TEXT = st.text(alphabet='[]{}"\\ a\u00e9', max_size=12)  # brackets, quotes, escapes
_JSON = st.recursive(
    st.none() | st.integers() | _TRICKY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY_TEXT, inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(_JSON, st.booleans())
def test_the_nesting_count_is_the_documents_depth(value, ascii_only):
    """Counted over the quotes and brackets alone, strings full of brackets, quotes and
    backslashes included, as the document's own depth."""
    text = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert records.nesting_depth(text) == _depth(value)
