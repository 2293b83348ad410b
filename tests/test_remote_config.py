"""A misconfigured remote is refused when a writer, a manager or a reader starts, typed and
saying what to fix; a remote that cannot be reached at start only warns (uploads retry later).
Credentials are checked for real: a moto_server that verifies every request's signature."""

from __future__ import annotations

import json
import logging
import time
import uuid

import botocore.session
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_tiered import (
    Durability,
    SaveRequest,
    CheckpointManager,
    PermanentTierError,
    RemoteConfig,
    RetryConfig,
    TieredStorageReader,
    TieredStorageWriter,
)
from tests.conftest import torchrun
from tests.s3server import s3fs_options, start_moto

ALLOW_S3 = json.dumps(
    {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
)


class AuthS3:
    """moto with signature checks on: ``key``/``secret`` may use S3, ``denied_*`` may not."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint, self.bucket = endpoint, f"auth-{uuid.uuid4().hex[:8]}"
        iam = botocore.session.get_session().create_client(
            "iam",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        iam.create_user(UserName="trainer")  # moto's first 5 requests are not checked
        iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=ALLOW_S3)
        k = iam.create_access_key(UserName="trainer")["AccessKey"]
        self.key, self.secret = k["AccessKeyId"], k["SecretAccessKey"]
        iam.create_user(UserName="nobody")  # no policy: every S3 request is denied
        k = iam.create_access_key(UserName="nobody")["AccessKey"]
        self.denied_key, self.denied_secret = k["AccessKeyId"], k["SecretAccessKey"]
        s3 = botocore.session.get_session().create_client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
        )
        s3.create_bucket(Bucket=self.bucket)

    def options(self, key: str | None = None, secret: str | None = None) -> dict:
        return s3fs_options(self.endpoint, key or self.key, secret or self.secret)


@pytest.fixture(scope="module")
def auth_s3():
    proc, endpoint = start_moto({"INITIAL_NO_AUTH_ACTION_COUNT": "5"})
    try:
        yield AuthS3(endpoint)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _bad_configs(auth_s3) -> dict[str, tuple[RemoteConfig, list[str]]]:
    url = f"s3://{auth_s3.bucket}/run"
    return {
        "wrong secret": (
            RemoteConfig(url=url, storage_options=auth_s3.options(secret="nope")),
            ["SignatureDoesNotMatch", "secret key"],
        ),
        "unknown key": (
            RemoteConfig(url=url, storage_options=auth_s3.options(key="AKIANOPE")),
            ["InvalidAccessKeyId", "access key"],
        ),
        "denied": (
            RemoteConfig(
                url=url, storage_options=auth_s3.options(auth_s3.denied_key, auth_s3.denied_secret)
            ),
            ["AccessDenied", "credentials"],
        ),
        "no such bucket": (
            RemoteConfig(
                url="s3://no-such-bucket-dcp-tiered/run", storage_options=auth_s3.options()
            ),
            ["NoSuchBucket", "create the bucket"],
        ),
    }


@pytest.mark.parametrize("case", ["wrong secret", "unknown key", "denied", "no such bucket"])
def test_a_misconfigured_remote_is_refused_at_start_saying_what_to_fix(tmp_path, auth_s3, case):
    remote, says = _bad_configs(auth_s3)[case]
    started = time.monotonic()
    writer = TieredStorageWriter(tmp_path / "w", remote=remote)
    with pytest.raises(PermanentTierError) as e:
        writer.recover()
    assert all(s in str(e.value) for s in says) and remote.url in str(e.value), str(e.value)
    with pytest.raises(PermanentTierError) as e:
        CheckpointManager(local=tmp_path / "m", remote=remote)
    assert all(s in str(e.value) for s in says), str(e.value)
    with pytest.raises(CheckpointException) as e:  # a reader: when it first needs the remote
        dcp.load(
            {"w": torch.zeros(4)},
            checkpoint_id="latest",
            no_dist=True,
            storage_reader=TieredStorageReader(tmp_path / "r", remote=remote),
        )
    ((err, *_),) = [f if isinstance(f, tuple) else (f,) for f in e.value.failures.values()]
    assert isinstance(err, PermanentTierError) and all(s in str(err) for s in says), str(err)
    assert time.monotonic() - started < 20  # no minute of upload retries


def test_no_credentials_at_all_are_refused_at_start(tmp_path, auth_s3, monkeypatch):
    for var in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = auth_s3.options()
    del options["key"], options["secret"]
    remote = RemoteConfig(url=f"s3://{auth_s3.bucket}/run", storage_options=options)
    with pytest.raises(PermanentTierError) as e:
        TieredStorageWriter(tmp_path / "w", remote=remote).recover()
    assert "no usable credentials" in str(e.value) and "AWS_ACCESS_KEY_ID" in str(e.value)


def test_a_good_remote_passes_and_an_unreachable_one_only_warns(tmp_path, auth_s3, caplog):
    good = RemoteConfig(url=f"s3://{auth_s3.bucket}/run", storage_options=auth_s3.options())
    with TieredStorageWriter(tmp_path / "good", remote=good) as writer:
        writer.recover()
        dcp.save({"w": torch.ones(4)}, checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    # Nothing listens on port 9: the job starts (and saves locally), with one warning.
    dead = RemoteConfig(
        url=f"s3://{auth_s3.bucket}/run",
        retry=RetryConfig(max_attempts=2),
        storage_options=s3fs_options("http://127.0.0.1:9", auth_s3.key, auth_s3.secret),
    )
    started = time.monotonic()
    writer = TieredStorageWriter(tmp_path / "dead", remote=dead)
    with caplog.at_level(logging.WARNING, logger="dcp_tiered"):
        writer.recover()
    assert time.monotonic() - started < 20
    assert [
        r
        for r in caplog.records
        if "cannot be reached now" in r.getMessage() and "retried later" in r.getMessage()
    ], caplog.text
    local_only = SaveRequest("step-1", promote=False)  # no upload to retry against the dead one
    dcp.save({"w": torch.ones(4)}, checkpoint_id=local_only, storage_writer=writer, no_dist=True)
    assert writer.durability("step-1") == Durability.COMMITTED_LOCAL
    writer.close(wait_durable=False)


def test_a_bad_remote_on_one_rank_fails_the_manager_start_on_every_rank(tmp_path, auth_s3):
    """Rank 1 alone has a wrong secret: both ranks raise at the manager's start (rank 0
    naming rank 1's problem) instead of rank 0 waiting forever at the next collective."""
    options = {r: auth_s3.options(secret=None if r == 0 else "nope") for r in (0, 1)}
    torchrun(
        "remote_check.py",
        2,
        "--url",
        f"s3://{auth_s3.bucket}/run",
        "--disk",
        str(tmp_path / "disk"),
        "--options",
        json.dumps(options),
        "--out",
        str(tmp_path / "out"),
        timeout=120,
    )
    got = [json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1)]
    assert got[1]["error"] == "PermanentTierError" and "SignatureDoesNotMatch" in got[1]["msg"]
    assert got[0]["error"] == "PermanentTierError", got[0]
    assert "another rank" in got[0]["msg"] and "SignatureDoesNotMatch" in got[0]["msg"]
