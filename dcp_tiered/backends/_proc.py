"""What Linux's /proc tells of the processes holding a lock file: which they are, and whether
the kernel is already tearing them down.

A process killed while one of its threads is in uninterruptible I/O (an fsync on a busy disk,
a write to a slow network filesystem) keeps its open files, and so its flocks, until that I/O
ends, although its main thread is already a zombie and ``/proc/PID/fd`` reads empty. A job
restarted at once on the same machine must wait for such a process, not take it for a live job.
Elsewhere (another OS, another host's lock, another PID namespace) nothing is known, and the
callers decide as if the holders were alive.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

PROC = Path("/proc")
_SIGKILL = 1 << (signal.SIGKILL - 1)  # its bit in /proc/PID/status's signal masks


def lock_holders(path: Path) -> list[int] | None:
    """The processes that hold a granted lock on the file at ``path``, as /proc/locks names
    them; None where that is not known (no /proc/locks, or a holder it cannot name)."""
    try:
        st = os.stat(path)
        table = (PROC / "locks").read_text()
    except OSError:
        return None
    # "1: FLOCK  ADVISORY  READ 14263 fe:00:2146312 0 EOF"; a waiting request has "->" after
    # the number and is not a holder.
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in table.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] != "->" and fields[5] == where:
            pids.append(int(fields[4]))
    if any(pid <= 0 for pid in pids):  # an OFD lock, or a holder outside our PID namespace
        return None
    return pids


def exiting(pid: int) -> bool:
    """Whether process ``pid`` is gone or being torn down: SIGKILL is pending for it or for
    one of its threads (``kill -9``; the kernel also sends it to every thread of a process
    that a fatal signal or ``exit_group`` ends)."""
    try:
        if _sigkill_pending(PROC / str(pid) / "status", "ShdPnd"):
            return True
        tasks = list((PROC / str(pid) / "task").iterdir())
    except FileNotFoundError:
        return True  # exited since it was named
    except OSError:
        return False
    for task in tasks:
        try:
            if _sigkill_pending(task / "status", "SigPnd"):
                return True
        except OSError:
            continue  # that thread has exited
    return False


def _sigkill_pending(status: Path, field: str) -> bool:
    for line in status.read_text().splitlines():
        key, _, value = line.partition(":")
        if key == field:
            return bool(int(value, 16) & _SIGKILL)
    return False
