"""Remote backends share one filesystem (one S3 client) per store, options and environment per
process (dcp_tiered.backends._clients), against a real S3 server on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import time

import s3fs

from dcp_tiered import RemoteConfig
from dcp_tiered.backends.remote import RemoteBackend
from tests.test_remote_tier import FAST_RETRY, equal, load, save, state


def config(s3, options: dict | None = None) -> RemoteConfig:
    return RemoteConfig(url=s3.url(), storage_options=options or s3.options(), retry=FAST_RETRY)


def test_backends_with_equal_options_share_one_filesystem_and_others_do_not(
    s3, monkeypatch, tmp_path
):
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
    # Credentials a client read from a file: one made after the file changed reads it again.
    creds = tmp_path / "credentials"
    creds.write_text("[default]\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    before = RemoteBackend(cfg).fs
    assert RemoteBackend(cfg).fs is before
    os.utime(creds, ns=(1, 10**18))
    assert RemoteBackend(cfg).fs is not before
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
    assert child.exitcode == 0


def _child_makes_a_backend(cfg: RemoteConfig) -> None:
    backend = RemoteBackend(cfg)
    backend.exists("k")
    del backend
    gc.collect()
    os._exit(0)


def test_a_forked_child_never_closes_the_parents_connections(s3):
    """A child that frees the parent's filesystem (the cache its only holder) may close its
    pooled connections (aiohttp's connector does when it is freed), taking their sockets off
    the epoll set it shares with the parent: the parent's next request on one would hang
    until its read timeout. The child keeps the parent's filesystems instead."""
    cfg = config(s3, s3.options(read_timeout=20))
    backend = RemoteBackend(cfg)
    backend.put_bytes("k", b"v")  # pooled connections now exist
    del backend  # the cache is the filesystem's only holder
    gc.collect()
    child = multiprocessing.get_context("fork").Process(target=_child_makes_a_backend, args=(cfg,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    again = RemoteBackend(cfg)
    started = time.monotonic()
    for _ in range(4):  # every pooled connection, whichever the pool hands out
        assert again.read("k") == b"v"
    assert time.monotonic() - started < 10  # not the read timeout's 20 s


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
