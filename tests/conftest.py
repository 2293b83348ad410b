from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"


def torchrun(script: str, nproc: int, *args: str, timeout: float = 240, check: bool = True,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run tests/workers/<script> on ``nproc`` real gloo ranks."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", "--max-restarts=0", str(WORKERS / script), *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-8000:]}"
        )
    return proc


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture
def run_ranks():
    return torchrun


# ---------------------------------------------------------------- S3 (a real server on 127.0.0.1)

import socket  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout} s")


class S3:
    """An S3 endpoint and a bucket for the tests; ``options(endpoint)`` for s3fs."""

    def __init__(self, endpoint: str, bucket: str, key: str, secret: str) -> None:
        self.endpoint, self.bucket, self.key, self.secret = endpoint, bucket, key, secret

    def options(self, endpoint: str | None = None, read_timeout: float = 10) -> dict:
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": endpoint or self.endpoint, "region_name": "us-east-1"},
            "config_kwargs": {"s3": {"addressing_style": "path"}, "connect_timeout": 5,
                              "read_timeout": read_timeout, "retries": {"max_attempts": 2}},
        }

    def url(self) -> str:
        return f"s3://{self.bucket}/{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def s3() -> S3:
    """moto_server from .venv-moto, or any endpoint given by DCP_TIERED_TEST_S3_ENDPOINT (with
    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and optionally DCP_TIERED_TEST_S3_BUCKET)."""
    import s3fs

    endpoint = os.environ.get("DCP_TIERED_TEST_S3_ENDPOINT")
    proc = None
    if endpoint:
        key = os.environ.get("AWS_ACCESS_KEY_ID", "")
        secret = os.environ.get("AWS_SECRET_ACCESS_KEY", "")
    else:
        moto = REPO / ".venv-moto" / "bin" / "moto_server"
        if not moto.exists():
            pytest.fail("moto_server missing: run scripts/setup (scripts/test does it)")
        port = free_port()
        proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_port(port, proc, "moto_server")
        endpoint, key, secret = f"http://127.0.0.1:{port}", "testing", "testing"
    bucket = os.environ.get("DCP_TIERED_TEST_S3_BUCKET", f"dcp-tiered-{uuid.uuid4().hex[:8]}")
    server = S3(endpoint, bucket, key, secret)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.options())
    try:
        fs.call_s3("create_bucket", Bucket=bucket)
    except (FileExistsError, PermissionError):
        pass
    yield server
    if proc is not None:
        proc.terminate()
        proc.wait(timeout=10)


def injected_faults(proxy_url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"{proxy_url}/__faults__", timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture
def fault_proxy(s3):
    """Start a fault proxy in front of the S3 server; returns a function (rate, seed) -> URL."""
    procs = []

    def start(rate: float, seed: int = 0, stall_secs: float = 6.0) -> str:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "faultproxy.py"), "--port", str(port),
             "--upstream", s3.endpoint, "--rate", str(rate), "--seed", str(seed),
             "--stall-secs", str(stall_secs), "--max-secs", "900"],
            stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        _wait_for_port(port, proc, "fault proxy")
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=10)
            print(err)
        except subprocess.TimeoutExpired:
            proc.kill()
