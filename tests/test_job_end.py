"""Ending a job: close() waits (bounded) for durability, and a process always exits promptly.

Real processes and a real S3 server (moto); the silent remote is a TCP listener on 127.0.0.1
that accepts connections and never answers.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import (
    CheckpointManager,
    Every,
    SavePolicy,
    TieredStorageReader,
    TieredStorageWriter,
)
from dcp_tiered.tiers.remote import Durability
from tests.conftest import REPO
from tests.s3server import s3fs_options


@pytest.fixture
def black_hole():
    """An endpoint that accepts TCP connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    for conn in held:
        conn.close()
    server.close()


def run_job(root, url: str, options: dict, *args: str, timeout: float = 120):
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "workers" / "job_end.py"),
            str(root),
            url,
            json.dumps(options),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )
    return proc, time.monotonic() - started


def test_close_returns_once_the_last_step_is_durable(tmp_path, s3):
    url = s3.url()
    proc, _ = run_job(tmp_path / "ckpt", url, s3.options(), "--close", "120")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CLOSE-RAISED" not in proc.stdout and "MAIN-DONE" in proc.stdout
    writer = TieredStorageWriter(tmp_path / "ckpt", remote=url, storage_options=s3.options())
    try:  # durable when close() returned: nothing was left for this writer to resume
        assert writer.durability("step-1") == Durability.DURABLE_REMOTE
    finally:
        writer.close()


def test_close_against_a_silent_remote_raises_in_time_and_the_process_exits(tmp_path, black_hole):
    options = s3fs_options(black_hole, read_timeout=30)
    proc, secs = run_job(tmp_path / "ckpt", "s3://bucket/run", options, "--close", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    raised = [line for line in proc.stdout.splitlines() if line.startswith("CLOSE-RAISED")]
    assert raised and "UploadFailedError" in raised[0] and "step-1" in raised[0]
    assert "still uploading after 3" in raised[0] and "resumes" in raised[0]
    close_secs = float(proc.stdout.split("CLOSE-SECS ")[1].split()[0])
    assert close_secs < 8, f"close(timeout_secs=3) took {close_secs} s"
    assert secs < 45, f"the process took {secs:.0f} s to exit after close() gave up"


def test_exit_without_close_warns_once_and_the_next_writer_resumes_the_upload(
    tmp_path, s3, black_hole
):
    """The remote is silent while the job ends: one warning names the step, no retry noise, a
    prompt exit; the next writer on that root (remote back) makes the step durable."""
    url = s3.url()
    proc, secs = run_job(
        tmp_path / "ckpt", url, s3fs_options(black_hole, read_timeout=30), "--no-close"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert secs < 45, f"the process took {secs:.0f} s to exit"
    warnings = [line for line in proc.stderr.splitlines() if "not durable on" in line]
    assert len(warnings) == 1 and "step-1" in warnings[0] and "resumes" in warnings[0], proc.stderr
    assert "Retrying" not in proc.stderr and "cannot schedule new futures" not in proc.stderr
    writer = TieredStorageWriter(tmp_path / "ckpt", remote=url, storage_options=s3.options())
    writer.recover()  # the explicit step: finish what the last job left, uploads included
    writer.close(timeout_secs=120)  # waits for the resumed upload
    assert (
        TieredStorageWriter(tmp_path / "ckpt", remote=url, storage_options=s3.options()).durability(
            "step-1"
        )
        == Durability.DURABLE_REMOTE
    )


def test_writers_built_and_closed_in_a_loop_leave_no_threads_behind(tmp_path):
    remote = f"file://{tmp_path / 'remote'}"
    baseline = {t.name for t in threading.enumerate()}
    for i in range(6):
        with TieredStorageWriter(tmp_path / "ckpt", remote=remote) as writer:
            dcp.save(
                {"w": torch.full((64,), float(i))},
                checkpoint_id=f"step-{i}",
                storage_writer=writer,
                no_dist=True,
            )
    left = [t.name for t in threading.enumerate() if t.name not in baseline]
    assert left == [], f"threads left after 6 writers were closed: {left}"


def test_a_writer_closed_while_its_upload_runs_leaves_no_thread_once_it_ends(tmp_path, monkeypatch):
    """``close(wait_durable=False)`` with a promotion still running lets it finish; its
    threads then end. They were left waiting for work for good (CI saw the manager loop below
    keep one for more than 10 s)."""
    from dcp_tiered.tiers import uploads

    may_go = threading.Event()
    promote = uploads.Uploader._promote

    def held(self, step):  # the upload itself is real; it only starts when the test says
        assert may_go.wait(30)
        return promote(self, step)

    monkeypatch.setattr(uploads.Uploader, "_promote", held)

    before = set(threading.enumerate())  # other tests' writers may have left theirs

    def ours() -> list[str]:  # the upload pools' threads (others live as long as the process)
        new = set(threading.enumerate()) - before
        return sorted(t.name for t in new if t.name.startswith("dcp-tiered-upload"))

    writer = TieredStorageWriter(tmp_path / "ck", remote=f"file://{tmp_path / 'remote'}")
    dcp.save({"w": torch.ones(8)}, checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    writer.close(wait_durable=False)
    assert "dcp-tiered-upload_0" in ours()  # still promoting step-1
    may_go.set()
    deadline = time.monotonic() + 10
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ours() == []
    assert (tmp_path / "remote" / "step-1" / "_COMMITTED.json").exists()


def test_managers_built_and_closed_in_a_loop_return_to_the_baseline(tmp_path, shm):
    """A long-lived process that builds, uses and closes managers (every tier, save and
    restore) and readers comes back to its threads, descriptors and shared-memory entries."""
    tiers = {"local": tmp_path / "disk", "memory": shm, "remote": f"file://{tmp_path / 'remote'}"}
    policy = SavePolicy(memory=Every(steps=1), local=Every(steps=2), remote=Every(steps=4))

    def lifecycle(i: int) -> None:
        with CheckpointManager(**tiers, policy=policy) as mgr:
            for step in range(5 * i, 5 * i + 5):
                mgr.save(step, {"w": torch.full((1024,), float(step))})
        back = {"w": torch.zeros(1024)}
        with CheckpointManager(**tiers) as mgr:
            assert mgr.restore(back) == 5 * i + 5
        dcp.load(
            back,
            checkpoint_id="latest",
            no_dist=True,
            storage_reader=TieredStorageReader(tiers["local"], remote=tiers["remote"]),
        )

    def footprint() -> tuple[list[str], int, list[str]]:
        gc.collect()
        return (
            sorted(t.name for t in threading.enumerate()),
            len(os.listdir("/proc/self/fd")),
            sorted(os.listdir("/dev/shm")),
        )

    lifecycle(0)  # what the first one builds for good (the event log's handler, ...)
    baseline = footprint()
    for i in range(1, 7):
        lifecycle(i)
    # A closed pool's idle thread ends on its own a moment later (CI once counted the last
    # manager's upload thread still there): a leak is what is still there seconds later.
    deadline = time.monotonic() + 10
    while footprint() != baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    assert footprint() == baseline


def test_close_waits_for_the_uploads_its_start_resumed(tmp_path, monkeypatch):
    """A job whose upload failed leaves its step committed locally; the next job's start
    resumes that upload, and its close() returns once the step is durable (it had released
    the upload unwaited, and the step was left to the job after)."""
    from dcp_tiered import SaveFailedError
    from dcp_tiered.tiers import uploads
    from dcp_tiered.tiers.promotion import Promotion

    root, remote = tmp_path / "ckpt", f"file://{tmp_path}/remote"
    policy = SavePolicy(local=Every(steps=1), remote=Every(steps=1))
    run = Promotion.run

    def fails(self):
        raise OSError("the store is down (injected)")

    monkeypatch.setattr(Promotion, "run", fails)
    mgr = CheckpointManager(local=root, remote=remote, policy=policy, events=None)
    mgr.save(1, {"w": torch.ones(1024)})
    with pytest.raises(SaveFailedError):
        mgr.close()
    # reported by close(): the exit hook has nothing to say of it again
    assert not [up for up in uploads._LIVE if up.tier.root == str(root)], "left to the exit hook"

    def slow(self):  # the store back, slow: a resumed upload outlives a quick job
        time.sleep(1.0)
        run(self)

    monkeypatch.setattr(Promotion, "run", slow)
    with CheckpointManager(local=root, remote=remote, policy=policy, events=None):
        pass  # a job that saves nothing
    writer = TieredStorageWriter(root, remote=remote)  # reads where step-1 stands
    try:
        assert writer.durability("step-1") == Durability.DURABLE_REMOTE
    finally:
        writer.close()
