"""Error translation at the backend edge and the retry policy, without sleeping for real."""

from __future__ import annotations

import logging

import pytest
from botocore.exceptions import ClientError

from dcp_tiered import PermanentTierError, RetryConfig, TransientTierError, _retry
from dcp_tiered.backends.remote import translate


def client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )


def wrapped(code: str, status: int) -> OSError:
    err = OSError(5, "translated by s3fs")  # s3fs keeps the ClientError as the cause
    err.__cause__ = client_error(code, status)
    return err


@pytest.mark.parametrize(
    "code,status",
    [("SlowDown", 503), ("InternalError", 500), ("RequestTimeout", 400), ("Whatever", 502)],
)
def test_throttling_and_server_errors_are_transient(code, status):
    assert isinstance(translate(wrapped(code, status), "upload", "s3://b/k"), TransientTierError)


@pytest.mark.parametrize(
    "code,hint",
    [
        ("AccessDenied", "permissions"),
        ("NoSuchBucket", "create the bucket"),
        ("InvalidAccessKeyId", "access key"),
    ],
)
def test_permanent_errors_say_what_to_fix(code, hint):
    err = translate(wrapped(code, 403), "upload", "s3://b/k")
    assert isinstance(err, PermanentTierError) and hint in str(err) and "s3://b/k" in str(err)


def test_missing_key_and_failed_precondition_keep_their_meaning():
    assert isinstance(translate(wrapped("NoSuchKey", 404), "get", "k"), FileNotFoundError)
    assert isinstance(translate(wrapped("PreconditionFailed", 412), "create", "k"), FileExistsError)
    assert isinstance(translate(ConnectionResetError(), "get", "k"), TransientTierError)


def test_retries_transient_errors_with_backoff_and_logs_each(caplog):
    sleeps: list[float] = []
    calls = {"n": 0}

    def flaky() -> str:
        calls["n"] += 1
        if calls["n"] < 4:
            raise TransientTierError("503 SlowDown")
        return "ok"

    policy = _retry.retrying(
        RetryConfig(max_attempts=5, initial_backoff_secs=0.1, max_backoff_secs=1.0),
        sleep=sleeps.append,
    )
    with caplog.at_level(logging.WARNING, logger="dcp_tiered.retry"):
        assert policy(flaky) == "ok"
    assert calls["n"] == 4 and len(sleeps) == 3 and all(0 <= s <= 1.0 for s in sleeps)
    assert caplog.text.count("Retrying") == 3


def test_gives_up_after_max_attempts_and_never_retries_permanent_errors():
    sleeps: list[float] = []
    policy = _retry.retrying(RetryConfig(max_attempts=3), sleep=sleeps.append)
    with pytest.raises(TransientTierError):
        policy(lambda: (_ for _ in ()).throw(TransientTierError("500")))
    assert len(sleeps) == 2
    sleeps.clear()
    with pytest.raises(PermanentTierError):
        policy(lambda: (_ for _ in ()).throw(PermanentTierError("AccessDenied")))
    assert sleeps == []


def test_missing_credentials_are_permanent_and_say_what_to_set():
    from botocore.exceptions import NoCredentialsError

    err = translate(NoCredentialsError(), "put", "s3://b/k")
    assert isinstance(err, PermanentTierError)
    assert "credentials" in str(err) and "AWS_ACCESS_KEY_ID" in str(err) and "s3://b/k" in str(err)


def test_a_bare_403_names_the_credential_problem():
    e = ClientError(
        {
            "Error": {"Code": "403", "Message": "Forbidden"},
            "ResponseMetadata": {"HTTPStatusCode": 403},
        },
        "HeadObject",
    )
    err = translate(e, "head", "s3://b/k")
    assert isinstance(err, PermanentTierError) and "credentials" in str(err)
    assert "S3 documentation" not in str(err)


@pytest.mark.parametrize("url", ["bucket/run", "run", "./run"])
def test_a_relative_remote_without_a_scheme_is_refused(url):
    from dcp_tiered import ConfigError, RemoteConfig, TieredStorageReader, TieredStorageWriter

    for build in (
        lambda: RemoteConfig(url=url),
        lambda: TieredStorageWriter("/tmp/unused-root", remote=url),
        lambda: TieredStorageReader("/tmp/unused-root", remote=url),
    ):
        with pytest.raises(ConfigError) as e:
            build()
        assert f"remote {url!r} has no scheme: did you mean s3://{url}?" in str(e.value)
        assert "absolute path or file://" in str(e.value)


def test_an_absolute_path_or_a_file_url_is_a_local_directory_remote(tmp_path):
    from dcp_tiered import RemoteConfig
    from dcp_tiered.backends.remote import RemoteBackend

    for url in (str(tmp_path / "r"), f"file://{tmp_path / 'r'}"):
        backend = RemoteBackend(RemoteConfig(url=url))
        assert (backend.protocol, backend.base) == ("file", str(tmp_path / "r"))
