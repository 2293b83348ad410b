"""Remote backends share one filesystem (one S3 client) per store, options and environment per
process (dcp_tiered.backends._clients), against a real S3 server on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os

import s3fs

from dcp_tiered import RemoteConfig
from dcp_tiered.backends.remote import RemoteBackend
from tests.test_remote_tier import FAST_RETRY, equal, load, save, state


def config(s3, options: dict | None = None) -> RemoteConfig:
    return RemoteConfig(url=s3.url(), storage_options=options or s3.options(), retry=FAST_RETRY)


def test_backends_with_equal_options_share_one_filesystem_and_others_do_not(s3, monkeypatch):
    cfg = config(s3)
    one, two = RemoteBackend(cfg), RemoteBackend(dataclasses.replace(cfg, url=s3.url()))
    assert one.fs is two.fs is one.with_one_attempt().fs
    one.put_bytes("k", b"v")  # the shared client works for both
    assert two.exists("k") is False and one.read("k") == b"v"
    assert RemoteBackend(config(s3, {**s3.options(), "use_ssl": False})).fs is not one.fs
    # The client reads the environment when made: a backend made after a change sees it.
    monkeypatch.setenv("AWS_PROFILE_FOR_THE_TEST", "other")
    assert RemoteBackend(cfg).fs is not one.fs
    monkeypatch.delenv("AWS_PROFILE_FOR_THE_TEST")
    assert RemoteBackend(cfg).fs is one.fs
    # Options holding an object (not plain data) are never compared: a filesystem each.
    marker = object()
    odd = dataclasses.replace(cfg, storage_options={**cfg.storage_options, "x": marker})
    assert RemoteBackend(odd).fs is not RemoteBackend(odd).fs


def _child_fs_is_new(cfg: RemoteConfig, parent_id: int, out) -> None:
    backend = RemoteBackend(cfg)
    out.send(id(backend.fs) != parent_id and backend.exists("k") is False)


def test_a_forked_child_makes_its_own_filesystem(s3):
    cfg = config(s3)
    parent = RemoteBackend(cfg).fs
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_fs_is_new, args=(cfg, id(parent), send))
    child.start()
    assert recv.poll(60) and recv.recv() is True  # the parent's object is at that id there too
    child.join(30)
    assert child.exitcode == 0 and os.getpid() != child.pid


def test_a_save_and_restore_make_at_most_one_client_for_the_store(s3, tmp_path, monkeypatch):
    """Before: each writer, reader, housekeeping pass and once-tried view made its own client
    (0.15-0.25 s of CPU each: botocore parses its models)."""
    made = []
    real_init = s3fs.S3FileSystem.__init__

    def counting(self, *args, **kwargs):
        made.append(kwargs.get("client_kwargs", {}).get("endpoint_url"))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "__init__", counting)
    options = s3.options(read_timeout=11)  # options no other test uses
    for round_ in range(2):
        cfg, root = config(s3, options), tmp_path / f"r{round_}"
        writer = save(root, cfg, "step-1", state(round_))
        writer.wait_durable("step-1")
        writer.close()
        got, _ = load(tmp_path / f"empty{round_}", cfg, "step-1")
        assert equal(got, state(round_))
        # the store's client, and the checksum probe's own (once per store and process)
        assert len(made) <= 2, made
    assert len(made) >= 1
