from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"
_SESSION_ENV = dict(os.environ)  # before any test changes it: the launch server's environment


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Say how to run what the default marker expression (pyproject.toml: not slow) left out."""
    deselected = terminalreporter.stats.get("deselected", [])
    slow = sum(1 for item in deselected if item.get_closest_marker("slow"))
    if slow and "slow" in (config.option.markexpr or ""):
        terminalreporter.write_line(
            f"{slow} slow tests (soaks, full matrices) deselected by -m "
            f"{config.option.markexpr!r}: run them with `scripts/test -m slow` (-k to pick some)"
        )


class _ForkedTorchrun:
    """Launches through tests/torchrun_server.py: torchrun's agent (``torch.distributed.run.main``)
    forked from one process that imported it, instead of a ``python -m torch.distributed.run``
    that imports it again (about 1.5 s of every launch on 2 cores). The agent's arguments,
    environment, working directory and workers are those of the plain command; its output is
    captured, its exit status returned, and a launch past its timeout is killed with its workers
    (its process group). The agent forks its workers too, where a fresh interpreter would
    behave alike (tests/torchrun_server.py says when). DCP_TIERED_TEST_PLAIN_TORCHRUN=1
    launches plain torchrun processes; DCP_TIERED_TEST_FRESH_WORKERS=1 keeps the forked agent
    but starts every worker as a fresh interpreter."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.server: subprocess.Popen | None = None
        self.plain = os.environ.get("DCP_TIERED_TEST_PLAIN_TORCHRUN") == "1"
        self.buffer = b""

    def _start(self) -> subprocess.Popen:
        if self.server is None or self.server.poll() is not None:
            self.buffer = b""
            self.server = subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "torchrun_server.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=_SESSION_ENV,
                cwd=REPO,
                bufsize=0,
            )
        return self.server

    def _answer(self, server: subprocess.Popen, deadline: float) -> dict | None:
        """The server's next line, or None once ``deadline`` (time.monotonic) has passed."""
        assert server.stdout is not None
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([server.stdout], [], [], left)[0]:
                return None
            chunk = os.read(server.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the torchrun server exited ({server.wait()})")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> None:
        if self.server is not None:
            self.server.kill()
            self.server.wait()
            self.server = None

    def run(self, cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
        cwd=REPO)``; a ``python -m torch.distributed.run`` of this interpreter goes through the
        server (unless another launch is using it: then a plain process)."""
        forked = cmd[0] == sys.executable and cmd[1:3] == ["-m", "torch.distributed.run"]
        if forked and not self.plain and self.lock.acquire(blocking=False):
            try:
                return self._forked(cmd, env, timeout)
            finally:
                self.lock.release()
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO, check=False
        )

    def _forked(self, cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="dcp-tiered-torchrun-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"args": cmd[3:], "env": env, "cwd": str(REPO)}
            request.update(stdout=str(out), stderr=str(err))
            server = self._start()
            assert server.stdin is not None
            deadline = time.monotonic() + timeout
            pid = None
            try:
                server.stdin.write((json.dumps(request) + "\n").encode())
                pid = (self._answer(server, time.monotonic() + 120) or {}).get("pid")
                if pid is None:
                    raise RuntimeError("the torchrun server did not start the launch")
                done = self._answer(server, deadline)
            except BaseException:  # interrupted (a test timeout): nothing of it stays behind
                if pid is not None:
                    self._stop_launch(server, pid)
                self.stop()
                raise
            if done is None:
                self._stop_launch(server, pid)
                self.stop()
                raise subprocess.TimeoutExpired(
                    cmd, timeout, _read(out).encode(), _read(err).encode()
                )
            return subprocess.CompletedProcess(cmd, done["returncode"], _read(out), _read(err))

    def _stop_launch(self, server: subprocess.Popen, pid: int) -> None:
        """SIGTERM to the agent, which stops its workers (they run in sessions of their own),
        then SIGKILL to what is left of its group."""
        for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 0.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                return
            try:
                if self._answer(server, time.monotonic() + grace) is not None:
                    return
            except RuntimeError:
                return


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


_LAUNCHER = _ForkedTorchrun()


def torchrun(
    script: str,
    nproc: int,
    *args: str,
    timeout: float = 240,
    check: bool = True,
    env: dict | None = None,
    python: str = sys.executable,
) -> subprocess.CompletedProcess:
    """Run tests/workers/<script> on ``nproc`` real gloo ranks (under ``python``'s torch)."""
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--max-restarts=0",
        str(WORKERS / script),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = _LAUNCHER.run(cmd, full_env, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-8000:]}"
        )
    return proc


def run_example(
    script: str, *args: str, ranks: int | None = None, timeout: float = 300, env: dict | None = None
) -> str:
    """Run examples/<script> (under torchrun with ``ranks``); its stdout, or fail the test."""
    launcher = (
        []
        if ranks is None
        else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    )
    cmd = [sys.executable, *launcher, str(REPO / "examples" / script), *args]
    # Fresh interpreters, as a user runs them: their end (module teardown, C++ destructors,
    # a process group left open) is part of what an example shows works
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DCP_TIERED_TEST_FRESH_WORKERS": "1",
        **(env or {}),
    }
    proc = _LAUNCHER.run(cmd, full_env, timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def visible(root: Path) -> list[str]:
    """A root's entries but the two files a run keeps there: its run record and its job's
    live-lock (see dcp_tiered.policy.identity); everything else, hidden or not, is listed."""
    from dcp_tiered.policy import identity

    return sorted(
        n
        for n in os.listdir(root)
        if n != identity.RUN_RECORD and identity.parse_live_lock(n) is None
    )


def skip_without_megatron() -> None:
    """Skip the module where megatron-core is not installed. Not pytest.importorskip: importing
    megatron.core takes seconds, and only the workers use it (the test process never does)."""
    import importlib.util

    if importlib.util.find_spec("megatron") is None or (
        importlib.util.find_spec("megatron.core") is None
    ):
        pytest.skip("megatron-core is not installed", allow_module_level=True)


def counted_calls(monkeypatch, owner, name: str) -> list[int]:
    """``owner.name`` replaced by itself counting its calls: a 1 in the list for each."""
    calls: list[int] = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


class Gate:
    """Holds every call of ``owner.name`` (a copy beside training, say) until ``open`` is set;
    ``entered`` is set once one waits there."""

    def __init__(self, monkeypatch, owner, name: str) -> None:
        self.open, self.entered = threading.Event(), threading.Event()
        real = getattr(owner, name)

        def held(*args, **kwargs):
            self.entered.set()
            assert self.open.wait(30), "the test never opened the gate"
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, held)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture
def run_ranks():
    return torchrun


def run_hf(
    out: Path, nproc: int, phase: str, *args: str, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """tests/workers/hf_resume.py (HF Trainer, a tiny GPT-2) in ``out``: on ``nproc`` torchrun
    ranks, or for 1 a plain process (Trainer without torch.distributed)."""
    argv = ["--out", str(out), "--phase", phase, *args]
    if nproc > 1:
        return torchrun(
            "hf_resume.py",
            nproc,
            *argv,
            timeout=240,
            check=check,
            env={"DS_ACCELERATOR": "cpu", **(env or {})},
        )
    proc = subprocess.run(
        [sys.executable, str(WORKERS / "hf_resume.py"), *argv],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"hf_resume.py {' '.join(argv)} failed:\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="session")
def hf_full(tmp_path_factory):
    """``hf_full(nproc, mode="async", zero=None)``: the directory of the uninterrupted HF run
    (hf_resume.py's phase full: 8 steps, saving every 2) with those settings, run once in the
    session (full.json, params-full.pt, run-full/): the reference the resume tests compare with.
    Tests only read it."""
    done: dict[tuple, Path] = {}

    def get(nproc: int, mode: str = "async", zero: int | None = None) -> Path:
        key = (nproc, mode, zero)
        if key not in done:
            out = tmp_path_factory.mktemp(f"hf-full-{nproc}-{mode}-{zero}")
            run_hf(out, nproc, "full", "--mode", mode, *(["--zero", str(zero)] if zero else []))
            done[key] = out
        return done[key]

    return get


class Tmpfs:
    """Mounts real tmpfs filesystems under a test's tmp_path: a small disk that fills up (bytes,
    or inodes with ``inodes``), which ``remount`` makes read-only and back; skips where the
    test cannot mount (not root)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path, self.mounted = tmp_path, []

    def __call__(self, size_mib: int, name: str = "tiny", inodes: int | None = None) -> Path:
        mnt = self.tmp_path / name
        mnt.mkdir()
        options = f"size={size_mib}m" + (f",nr_inodes={inodes}" if inodes else "")
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        self.mounted.append(mnt)
        return mnt

    @staticmethod
    def remount(mnt: Path, *, read_only: bool | None = None, size_mib: int | None = None) -> None:
        """Make it a real read-only filesystem (EROFS, which even root cannot write: chmod
        would not stop root) or writable again, or give it another size."""
        options = ["remount"] + ([("ro" if read_only else "rw")] if read_only is not None else [])
        options += [f"size={size_mib}m"] if size_mib is not None else []
        subprocess.run(
            ["mount", "-o", ",".join(options), str(mnt)], check=True, capture_output=True
        )

    @staticmethod
    def fill_inodes(directory: Path, leave: int = 0) -> list[Path]:
        """Create empty files in ``directory`` until only ``leave`` inodes are free (bytes stay
        free): another tenant's many small files. Returns them, for the test to delete."""
        directory.mkdir(exist_ok=True)
        made = []
        while os.statvfs(directory).f_favail > leave:
            path = directory / f"f{len(made)}"
            path.touch()
            made.append(path)
        return made


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size_mib, name="tiny", inodes=None)`` mounts a real tmpfs (see :class:`Tmpfs`)."""
    mounts = Tmpfs(tmp_path)
    yield mounts
    for mnt in mounts.mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# ---------------------------------------------------------------- S3 (a real server on 127.0.0.1)

import uuid

from tests.s3server import free_port, s3fs_options, start_moto
from tests.s3server import wait_for_port as _wait_for_port


class S3:
    """An S3 endpoint and a bucket for the tests; ``options(endpoint)`` for s3fs."""

    def __init__(self, endpoint: str, bucket: str, key: str, secret: str) -> None:
        self.endpoint, self.bucket, self.key, self.secret = endpoint, bucket, key, secret

    def options(
        self, endpoint: str | None = None, read_timeout: float = 10, retries: int = 2
    ) -> dict:
        """``retries``: see :func:`tests.s3server.s3fs_options`."""
        return s3fs_options(endpoint or self.endpoint, self.key, self.secret, read_timeout, retries)

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
        proc, endpoint = start_moto()
        key, secret = "testing", "testing"
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


def heal(proxy_url: str) -> None:
    """The proxy's store answers the reads ``fail_reads`` made fail again."""
    import urllib.request

    req = urllib.request.Request(f"{proxy_url}/__heal__", method="POST", data=b"")
    urllib.request.urlopen(req, timeout=10).close()


def injected_faults(proxy_url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"{proxy_url}/__faults__", timeout=10) as r:
        return json.loads(r.read())


def proxied_requests(proxy_url: str, *, reset: bool = False) -> list[tuple[str, str]]:
    """(kind, key) of every request the proxy passed on since it started or was last reset;
    with ``reset``, the count starts again after this."""
    import urllib.request

    with urllib.request.urlopen(f"{proxy_url}/__requests__", timeout=10) as r:
        found = [tuple(x) for x in json.loads(r.read())]
    if reset:
        req = urllib.request.Request(f"{proxy_url}/__requests__", method="POST", data=b"")
        urllib.request.urlopen(req, timeout=10).close()
    return found


@pytest.fixture
def fault_proxy(s3):
    """Start a fault proxy in front of the S3 server; returns a function (rate, seed) -> URL."""
    procs = []

    def start(
        rate: float,
        seed: int = 0,
        stall_secs: float = 6.0,
        deny: str | None = None,
        corrupt: str | None = None,
        corrupt_count: int = 1,
        fail_reads: str | None = None,
        slow_reads: str | None = None,
        slow_secs: float = 2.0,
        check_crc32c: bool = False,
    ) -> str:
        port = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "faultproxy.py"),
                "--port",
                str(port),
                "--upstream",
                s3.endpoint,
                "--rate",
                str(rate),
                "--seed",
                str(seed),
                "--stall-secs",
                str(stall_secs),
                "--max-secs",
                "900",
                *(["--deny", deny] if deny else []),
                *(["--corrupt", corrupt, "--corrupt-count", str(corrupt_count)] if corrupt else []),
                *(["--fail-reads", fail_reads] if fail_reads else []),
                *(["--check-crc32c"] if check_crc32c else []),
                *(
                    ["--slow-reads", slow_reads, "--slow-secs", str(slow_secs)]
                    if slow_reads
                    else []
                ),
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
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


class NcclLikeDefaultGroup:
    """Runs workers beside a default group that refuses dcp_tiered's collectives, as an
    NCCL-only group refuses CPU tensors (tests/workers/nccl_like/sitecustomize.py)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir()
        self.env = {
            "DCP_TIERED_REFUSED_DIR": str(directory),
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(WORKERS / "nccl_like"), os.environ.get("PYTHONPATH")])
            ),
        }

    def refused(self, processes: int) -> list[str]:
        """Every collective refused, after checking that ``processes`` ran with the guard."""
        records = [json.loads(p.read_text()) for p in self.directory.glob("*.json")]
        assert len(records) >= processes, f"only {len(records)} processes ran with the guard"
        return [call for record in records for call in record]


@pytest.fixture
def nccl_like(tmp_path) -> NcclLikeDefaultGroup:
    return NcclLikeDefaultGroup(tmp_path / "refused")


@pytest.fixture
def shm():
    """A memory-tier directory in /dev/shm, removed afterwards."""
    import shutil

    path = Path("/dev/shm") / f"dcp-tiered-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)
