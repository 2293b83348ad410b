"""Start LocalStack (S3 only, host mode, no Docker) from .venv-localstack on 127.0.0.1.

LocalStack pins botocore to a version s3fs's aiobotocore does not accept, so it lives in a venv
of its own (scripts/setup-bench makes it), as moto does. Host mode runs its gateway in this
machine's Python; ``GATEWAY_SERVER=hypercorn`` binds only the address given.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv-localstack" / "bin" / "python"


def start_localstack(timeout: float = 120) -> tuple[subprocess.Popen, str, Path]:
    """(process, endpoint, its scratch directory); the caller terminates it and removes that."""
    import sys

    sys.path.insert(0, str(REPO))
    from tests.s3server import free_port

    if not PYTHON.exists():
        raise RuntimeError("LocalStack missing: run scripts/setup-bench")
    port = free_port()
    scratch = Path(tempfile.mkdtemp(prefix="dcp-tiered-localstack-"))
    env = {
        **os.environ,
        "GATEWAY_SERVER": "hypercorn",
        "GATEWAY_LISTEN": f"127.0.0.1:{port}",
        "SERVICES": "s3",
        "EAGER_SERVICE_LOADING": "1",
        "DNS_ADDRESS": "0",
        "SKIP_SSL_CERT_DOWNLOAD": "1",
        "DISABLE_EVENTS": "1",
        "LOCALSTACK_VOLUME_DIR": str(scratch / "volume"),
        "FILESYSTEM_ROOT": str(scratch / "fs"),
        "TMPDIR": str(scratch),
    }
    log = open(scratch / "localstack.log", "wb")  # noqa: SIM115 - the server's, for its life
    proc = subprocess.Popen(
        [str(PYTHON), "-m", "localstack.runtime.main"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=scratch,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"LocalStack exited with {proc.returncode}: see {log.name}")
        try:
            with urllib.request.urlopen(f"{endpoint}/_localstack/health", timeout=2) as r:
                if json.load(r)["services"].get("s3") in ("running", "available"):
                    return proc, endpoint, scratch
        except OSError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"LocalStack did not serve S3 within {timeout} s: see {log.name}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
