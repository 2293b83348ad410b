"""The live lock on a root against the processes of another job instance: refused while they
live, waited for while the kernel is still tearing them down, named in the error.

The holders are real processes holding real flocks. Only the teardown itself (a killed process
whose thread is stuck in uninterruptible I/O, which keeps its files open for as long as the I/O
lasts) cannot be made to last on demand: the default tests show the kernel's view of it through
a /proc written for the test, and the slow test makes it for real with an fsync.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcp_tiered.backends import _proc
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.errors import ForeignRunError
from dcp_tiered.policy import identity
from dcp_tiered.tiers import ownership

OTHER = identity.live_lock_name("0123456789abcdef")  # another job instance's file

# A process of another job instance: holds a shared lock on its live-lock file, says "held",
# then does what argv[2] says.
HOLDER = r"""
import fcntl, os, sys, threading, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
fcntl.flock(fd, fcntl.LOCK_SH)
if sys.argv[2] == "fsync-then-sleep":  # a thread in a long fsync when the kill comes
    def write():
        out = os.open(sys.argv[3], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        block = b"x" * (16 << 20)
        for _ in range(int(sys.argv[4]) // 16):
            os.write(out, block)
        print("held", flush=True)
        os.fsync(out)
    threading.Thread(target=write).start()
else:
    print("held", flush=True)
time.sleep(float(sys.argv[2]) if sys.argv[2] != "fsync-then-sleep" else 600)
"""


def holder(root: Path, *args: str) -> subprocess.Popen:
    root.mkdir(parents=True, exist_ok=True)
    (root / OTHER).write_text('{"run": null, "host": "elsewhere", "pid": 1}')
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root / OTHER), *args], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def grace(monkeypatch):
    monkeypatch.setattr(ownership, "_EXIT_GRACE_SECS", 0.3)


def fake_proc(tmp_path: Path, root: Path, pid: int, *, killed: bool) -> Path:
    """A /proc whose lock table names ``pid`` as holding ``root/OTHER`` and whose status of
    ``pid`` shows SIGKILL pending (``killed``) or not."""
    proc = tmp_path / "proc"
    st = os.stat(root / OTHER)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    (proc / str(pid) / "task" / str(pid)).mkdir(parents=True)
    (proc / "locks").write_text(
        f"1: FLOCK  ADVISORY  WRITE 77 00:01:5 0 EOF\n"
        f"2: FLOCK  ADVISORY  READ  {pid} {where} 0 EOF\n"
        f"2: -> FLOCK  ADVISORY  WRITE 78 {where} 0 EOF\n"
    )
    pending = f"{1 << 8:016x}" if killed else "0" * 16
    status = f"Name:\tpython\nState:\tZ (zombie)\nSigPnd:\t{'0' * 16}\nShdPnd:\t{pending}\n"
    (proc / str(pid) / "status").write_text(status)
    (proc / str(pid) / "task" / str(pid) / "status").write_text(status)
    return proc


def test_the_kernel_names_the_processes_holding_a_lock_file(tmp_path):
    root = tmp_path / "root"
    proc = holder(root, "60")
    try:
        backend = LocalBackend(root)
        assert backend.root_lock_holders(OTHER) == [proc.pid]
        assert not backend.process_exiting(proc.pid)
        assert not backend.process_exiting(os.getpid())
    finally:
        proc.kill()
        proc.wait()
    assert backend.root_lock_holders(OTHER) == []
    assert backend.process_exiting(proc.pid)  # reaped: gone


def test_a_live_holder_is_refused_after_the_grace_named_by_pid_and_its_file_kept(tmp_path, grace):
    root = tmp_path / "root"
    proc = holder(root, "60")
    try:
        started = time.monotonic()
        with pytest.raises(ForeignRunError, match=rf"in use by another job .*pid\(s\) {proc.pid}"):
            ownership.hold_root(LocalBackend(root), None)
        assert time.monotonic() - started < 5
        assert (root / OTHER).exists()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("killed", [True, False])
def test_a_holder_the_kernel_is_tearing_down_is_waited_for_and_a_live_one_is_not(
    tmp_path, grace, monkeypatch, caplog, killed
):
    root = tmp_path / "root"
    proc = holder(root, "1.5" if killed else "30")  # lets go after 1.5 s, as an fsync ends
    monkeypatch.setattr(_proc, "PROC", fake_proc(tmp_path, root, proc.pid, killed=killed))
    caplog.set_level(logging.WARNING, logger=ownership.__name__)
    try:
        if killed:
            live = ownership.hold_root(LocalBackend(root), None)
            live.release()
            assert proc.poll() is not None  # it waited for the holder to let go
            assert not (root / OTHER).exists()  # and then removed the dead instance's file
            assert f"waiting for pid(s) {proc.pid} of a killed job" in caplog.text
        else:
            with pytest.raises(ForeignRunError, match=rf"pid\(s\) {proc.pid}"):
                ownership.hold_root(LocalBackend(root), None)
            assert proc.poll() is None and (root / OTHER).exists()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_job_killed_during_a_long_fsync_is_waited_for_not_refused(tmp_path, monkeypatch):
    """For real: SIGKILL while a thread of the holder is in an fsync of 1 GiB; its main thread
    is a zombie at once, and its lock lasts as long as the fsync."""
    monkeypatch.setattr(ownership, "_EXIT_GRACE_SECS", 0.0)
    root = tmp_path / "root"
    proc = holder(root, "fsync-then-sleep", str(tmp_path / "big"), "1024")
    time.sleep(0.05)  # into the fsync
    os.kill(proc.pid, signal.SIGKILL)
    backend = LocalBackend(root)
    assert backend.root_lock_held(OTHER), "the fsync ended before the check: too fast a disk"
    assert backend.root_lock_holders(OTHER) == [proc.pid]
    assert backend.process_exiting(proc.pid)
    ownership.hold_root(backend, None).release()
    assert not (root / OTHER).exists()
    proc.wait()
    (tmp_path / "big").unlink()  # pytest keeps the last runs' directories: not 1 GiB of them
