"""Start moto_server (from .venv-moto) on a free 127.0.0.1 port; used by tests and benchmarks."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout} s")


def start_moto(env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """``env``: e.g. INITIAL_NO_AUTH_ACTION_COUNT, after which moto checks every signature."""
    moto = REPO / ".venv-moto" / "bin" / "moto_server"
    if not moto.exists():
        raise RuntimeError("moto_server missing: run scripts/setup")
    port = free_port()
    proc = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=None if env is None else {**os.environ, **env},
    )
    wait_for_port(port, proc, "moto_server")
    return proc, f"http://127.0.0.1:{port}"


def s3fs_options(
    endpoint: str,
    key: str = "testing",
    secret: str = "testing",
    read_timeout: float = 10,
    retries: int = 2,
) -> dict:
    """``retries``: botocore's own retries of a request (0 where the store fails by design:
    the library's RetryConfig then decides alone how often an operation is tried)."""
    return {
        "key": key,
        "secret": secret,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "config_kwargs": {
            "s3": {"addressing_style": "path"},
            "connect_timeout": 5,
            "read_timeout": read_timeout,
            "retries": {"max_attempts": retries},
        },
    }
