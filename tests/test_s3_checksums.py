"""Uploads proved by the store's own CRC32C check instead of a read-back (issue 30).

Against a real S3 server (moto on 127.0.0.1). moto keeps a body whatever CRC32C it is sent,
so it is a store that does not check; the same moto behind tests/faultproxy.py with
``--check-crc32c`` is one that does, as AWS S3 (and LocalStack) do: the proxy refuses a PUT
whose body fails its ``x-amz-checksum-crc32c`` with 400 BadDigest. Requests are counted on the
wire as tests/test_s3_requests.py does."""

from __future__ import annotations

import collections
import logging
import threading

import pytest
import s3fs

from dcp_tiered import RemoteConfig
from dcp_tiered.backends import s3_checksums
from dcp_tiered.backends.remote import RemoteBackend
from dcp_tiered.errors import ConfigError
from dcp_tiered.policy import layout
from tests.conftest import injected_faults, proxied_requests
from tests.test_remote_tier import FAST_RETRY, equal, load, save, state


def config(s3, endpoint=None, **kw) -> RemoteConfig:
    kw.setdefault("part_size_bytes", 5 * 2**20)
    return RemoteConfig(url=s3.url(), storage_options=s3.options(endpoint), retry=FAST_RETRY, **kw)


def data_requests(reqs) -> dict[str, collections.Counter]:
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for kind, key in reqs:
        if key.endswith(".distcp"):
            out[key.rpartition("/")[2]][kind] += 1
    return out


def leftovers(s3, cfg) -> list[str]:
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.options())
    return [p for p in fs.find(cfg.url.removeprefix("s3://")) if "/_probe/" in p]


def durable(tmp_path, cfg, mib=1.0, step="step-1"):
    writer = save(tmp_path / "local", cfg, step, state(1, mib=mib))
    writer.wait_durable(step, timeout_secs=120)
    writer.close()


def test_probe_names_are_ours_alone():
    key = layout.probe_key("0123456789abcdef")
    assert key == "_probe/crc32c-0123456789abcdef" and layout.is_probe_key(key)
    assert not layout.is_step_name(layout.REMOTE_PROBE)
    assert not layout.is_probe_key("_probe/other") and not layout.is_probe_key("step-1/x")
    with pytest.raises(ValueError):
        layout.probe_key("../x")


def test_verify_uploads_takes_auto_true_or_false(s3):
    assert RemoteConfig(url=s3.url()).verify_uploads == "auto"
    for ok in ("auto", True, False):
        RemoteConfig(url=s3.url(), verify_uploads=ok)
    with pytest.raises(ConfigError, match="verify_uploads"):
        RemoteConfig(url=s3.url(), verify_uploads="yes")


def test_a_store_that_keeps_a_wrong_checksum_keeps_the_read_back(tmp_path, s3, fault_proxy, caplog):
    proxy = fault_proxy(0.0)
    cfg = config(s3, proxy)
    caplog.set_level(logging.INFO, logger="dcp_tiered")
    assert RemoteBackend(cfg).validates_checksums() is False  # moto keeps it
    assert not leftovers(s3, cfg)
    assert any("deleting" in r.message and "/_probe/crc32c-" in r.message for r in caplog.records)
    proxied_requests(proxy, reset=True)
    durable(tmp_path, cfg, mib=12)  # 12 MiB: a multipart upload of 3 parts
    for name, count in data_requests(proxied_requests(proxy)).items():
        assert count["GET"] >= 1, (name, count)  # read back
    got, _ = load(tmp_path / "fresh", cfg, mib=12)
    assert equal(got, state(1, mib=12))


def test_a_store_that_checks_checksums_is_not_read_back(tmp_path, s3, fault_proxy):
    proxy = fault_proxy(0.0, check_crc32c=True)
    cfg = config(s3, proxy)
    assert RemoteBackend(cfg).validates_checksums() is True
    # the probe's wrong checksum, refused (botocore itself resends a BadDigest body a few times)
    refused = injected_faults(proxy)["bad_digest"]
    assert refused >= 1
    assert not leftovers(s3, cfg)
    proxied_requests(proxy, reset=True)
    mib = 24  # 24 MiB in 5 MiB parts: 5 parts, each with its CRC32C
    durable(tmp_path, cfg, mib=mib)
    counts = data_requests(proxied_requests(proxy))
    assert counts
    for name, count in counts.items():
        assert count["GET"] == count["HEAD"] == 0, (name, count)
        assert count["PUT"] + count["COMPLETE"] == 1, (name, count)
        if count["PART"]:
            assert count["PART"] == 5, (name, count)
    assert injected_faults(proxy)["bad_digest"] == refused  # no upload was refused
    # probed once per store and process: no second probe for this endpoint
    assert not [k for k, key in proxied_requests(proxy) if "/_probe/" in key]
    got, _ = load(tmp_path / "fresh", cfg, mib=mib)
    assert equal(got, state(1, mib=mib))


def test_always_read_back_when_asked_even_on_a_checking_store(tmp_path, s3, fault_proxy):
    proxy = fault_proxy(0.0, check_crc32c=True)
    cfg = config(s3, proxy, verify_uploads=True)
    durable(tmp_path, cfg)
    for name, count in data_requests(proxied_requests(proxy)).items():
        assert count["GET"] >= 1, (name, count)


@pytest.mark.parametrize("mib", [1, 24])
def test_a_body_corrupted_on_the_way_is_refused_and_sent_again(tmp_path, s3, fault_proxy, mib):
    """The proxy flips a byte of the first data PUT (single PUT or part), then checks the
    CRC32C as the store would: refused with BadDigest, sent again, the step restores."""
    proxy = fault_proxy(0.0, corrupt=".distcp", corrupt_count=1, check_crc32c=True)
    cfg = config(s3, proxy)
    assert RemoteBackend(cfg).validates_checksums() is True
    refused = injected_faults(proxy)["bad_digest"]
    durable(tmp_path, cfg, mib=mib)
    faults = injected_faults(proxy)
    assert faults["corrupted"] == 1 and faults["bad_digest"] == refused + 1, faults
    counts = data_requests(proxied_requests(proxy))
    assert all(c["GET"] == 0 for c in counts.values()), counts
    got, _ = load(tmp_path / "fresh", cfg, mib=mib)
    assert equal(got, state(1, mib=mib))


def test_a_local_file_that_changed_is_never_completed(tmp_path, s3):
    """The CRC32C of the bytes read for the parts must be the manifest's before the
    multipart upload is completed: otherwise it is aborted and nothing is stored."""
    cfg = config(s3)
    backend = RemoteBackend(cfg)
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * (11 * 2**20))
    from dcp_tiered.errors import IntegrityError

    with pytest.raises(IntegrityError, match="fails its checksum"):
        backend.put_file(str(path), "step-1/f.bin", "00000000")
    assert backend.stat("step-1/f.bin") is None
    bucket, _, obj = backend.path("step-1/f.bin").partition("/")
    ups = backend.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=obj)
    assert not ups.get("Uploads"), ups
    with pytest.raises(IntegrityError, match="fails its checksum"):  # a single PUT: not sent
        path.write_bytes(b"small")
        backend.put_file(str(path), "step-1/f.bin", "00000000")
    assert backend.stat("step-1/f.bin") is None
    assert s3_checksums.header(0) == "AAAAAA=="


@pytest.mark.parametrize("signing", [None, True])
def test_bodies_go_unsigned_unless_signing_is_asked_for(tmp_path, s3, fault_proxy, signing):
    """Every body carries its CRC32C in a signed header, so botocore's SHA-256 of it (on a
    plain-http endpoint) is not paid by default; storage options that ask keep it."""
    proxy = fault_proxy(0.0, check_crc32c=True)
    cfg = config(s3, proxy)
    if signing is not None:
        opts = cfg.storage_options
        opts["config_kwargs"] = {
            **opts.get("config_kwargs", {}),
            "s3": {
                **opts.get("config_kwargs", {}).get("s3", {}),
                "payload_signing_enabled": signing,
            },
        }
    durable(tmp_path, cfg, mib=12)  # parts and single PUTs both
    faults = injected_faults(proxy)
    sent = faults["signed_bodies"] + faults["unsigned_bodies"]
    assert sent >= 3, faults
    if signing:
        assert faults["unsigned_bodies"] == 0, faults
    else:
        assert faults["signed_bodies"] == 0, faults
    got, _ = load(tmp_path / "fresh", cfg, mib=12)
    assert equal(got, state(1, mib=12))


def test_a_file_renamed_while_its_parts_are_read_is_uploaded_whole(tmp_path, s3, monkeypatch):
    """An early upload reads its file from the save's temporary directory, which the local
    commit renames, maybe between two parts: every part is read from the descriptor opened at
    the start, so the upload completes (and is not begun again from the step)."""
    from dcp_tiered.policy import integrity

    cfg = config(s3)
    backend = RemoteBackend(cfg)
    tmp, step = tmp_path / ".step-1.tmp", tmp_path / "step-1"
    tmp.mkdir()
    data = bytes(range(256)) * (47 * 2**10)  # 11.75 MiB: three parts of up to 5 MiB
    (tmp / "f.bin").write_bytes(data)
    read = s3_checksums._read
    reads = []
    committing = threading.Lock()  # parts are read on several threads at once

    def read_then_commit(*args):
        out = read(*args)
        with committing:
            reads.append(len(out[0]))
            if len(reads) == 1:
                tmp.rename(step)  # the commit, after the first part was read
        return out

    monkeypatch.setattr(s3_checksums, "_read", read_then_commit)
    checksum = integrity.format_checksum(integrity.checksum(data))
    backend.put_file(str(tmp / "f.bin"), "step-1/f.bin", checksum)
    assert len(reads) == 3 and not tmp.exists()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.options())
    assert fs.cat_file(backend.path("step-1/f.bin")) == data
