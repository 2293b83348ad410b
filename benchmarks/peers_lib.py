"""The peers as the benchmarks drive them, each optional (``pip install -e .[bench]``).

A peer that does not import is ``None`` in ``available()``; its figures then read "not
installed" in the table instead of failing the run.

- DLRover flash checkpoint (``DdpCheckpointer``): copies the state into shared memory (the
  caller's stall) and persists it from a saver process with ``torch.save``. It does not fsync,
  so its time to committed is taken until its tracker file names the step, plus an fsync of
  the file and its directory. Outside ``dlrover-run`` it starts its own saver process.
- torch-checkpointing (``CheckpointManager``): async staging, a writer subprocess, one file
  per top-level item. ``use_direct_io=False``: its O_DIRECT writes fail with EINVAL on ext4
  here (unaligned sizes), and it does not fsync either, so its commit is timed like DLRover's.
"""

from __future__ import annotations

import atexit
import os
import resource
import shutil
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

# the training loop: which of our variants saves at each peer's cadence
CADENCE_OF = {"dlrover": "ours", "dcp": "ours-disk", "torch-checkpointing": "ours-disk"}


def init_single_rank() -> None:
    """A one-rank gloo group: DCP, DLRover and torch-checkpointing all look for one."""
    if dist.is_initialized():
        return
    # torch-checkpointing stages each tensor in its own shared-memory file and keeps the fd:
    # 20,000 tensors need more than this machine's default 20,000 descriptors
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for limit in (max(hard, 262144), hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
            break
        except (ValueError, OSError):
            continue
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )
    # DLRover keeps its sockets under /tmp/ckpt_sock/<run id>: one of our own per run
    os.environ.setdefault("TORCHELASTIC_RUN_ID", f"dcp-tiered-bench-{uuid.uuid4().hex[:8]}")
    atexit.register(_remove_dlrover_sockets, os.environ["TORCHELASTIC_RUN_ID"])
    dist.init_process_group("gloo", rank=0, world_size=1)


def _remove_dlrover_sockets(run_id: str) -> None:
    """DLRover's sockets and shared memory of this run (only those: they carry our run id)."""
    shutil.rmtree(Path("/tmp/ckpt_sock") / run_id, ignore_errors=True)
    for shm in Path("/dev/shm").glob(f"{run_id}_ckpt_shm_*"):
        shm.unlink(missing_ok=True)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and every directory on the way (a peer's commit)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def available() -> dict[str, str | None]:
    """Peer name -> version, or None when it does not import."""
    found: dict[str, str | None] = {}
    for name, module in [
        ("dlrover", "dlrover.trainer.torch.flash_checkpoint.ddp"),
        ("torch-checkpointing", "torch_checkpointing"),
        ("s3torchconnector", "s3torchconnector.dcp"),
    ]:
        try:
            __import__(module)
            from importlib.metadata import version

            found[name] = version(name)
        except Exception:  # noqa: BLE001 - any import failure means "not installed" here
            found[name] = None
    return found


class DLRover:
    """One per process: its saver process serves one checkpointer (a second one makes the
    saver replay the first one's shared memory into the first one's directory)."""

    def __init__(self, directory: Path) -> None:
        import logging

        from dlrover.python.common.multi_process import SOCKET_TMP_DIR
        from dlrover.trainer.torch.flash_checkpoint import engine
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

        logging.getLogger("dlrover").setLevel(logging.WARNING)
        # Its saver process must be ready before the engine asks it for a saver, or the request
        # is lost and the engine times out after 60 s (a race outside dlrover-run: the socket
        # exists a moment before the queue behind it). Start it here, wait for the socket and
        # then a little longer.
        if engine.CheckpointEngine.saver_proc is None:
            engine.CheckpointEngine.saver_proc = engine.start_saver_process()
            sock = Path(
                SOCKET_TMP_DIR, os.environ["TORCHELASTIC_RUN_ID"], "sharedqueue_factory.sock"
            )
            deadline = time.monotonic() + 60
            while not sock.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(1.0)
        self.dir = directory
        self.kind = StorageType
        self.ckpt = DdpCheckpointer(str(directory))
        self.step = 0
        self.disk_step = 0  # its tracker file names the newest step persisted to disk

    def path(self, step: int) -> Path:
        return self.dir / str(step) / "rank_0.pt"

    def memory(self, state: dict) -> float:
        """The stall of a save to shared memory."""
        self.step += 1
        t = time.perf_counter()
        self.ckpt.save_checkpoint(self.step, state, storage_type=self.kind.MEMORY)
        return time.perf_counter() - t

    def commit(self, state: dict) -> tuple[float, Path]:
        """Time to committed on disk: the save, its persisting, its tracker, then fsync."""
        self.step += 1
        self.disk_step = self.step
        path = self.path(self.step)
        tracker = self.dir / "dlrover_latest.txt"
        t = time.perf_counter()
        self.ckpt.save_checkpoint(self.step, state, str(path), storage_type=self.kind.DISK)
        self.wait(tracker, t)
        fsync_tree(path.parent)
        return time.perf_counter() - t, path

    def disk_async(self, state: dict) -> None:
        self.step += 1
        self.disk_step = self.step
        self.ckpt.save_checkpoint(
            self.step, state, str(self.path(self.step)), storage_type=self.kind.DISK
        )

    def clear(self) -> None:
        """Remove the steps it persisted (after ``wait``); keeps its tracker and stage dir."""
        for path in self.dir.iterdir():
            if path.name.isdigit():
                shutil.rmtree(path, ignore_errors=True)

    def wait(self, tracker: Path | None = None, since: float | None = None) -> None:
        tracker = tracker or self.dir / "dlrover_latest.txt"
        since = since or time.perf_counter()
        while True:
            try:
                if self.disk_step == 0 or tracker.read_text().strip() == str(self.disk_step):
                    return
            except (FileNotFoundError, ValueError):
                pass
            if time.perf_counter() - since > 600:
                raise TimeoutError(f"DLRover did not commit step {self.disk_step} in 600 s")
            time.sleep(0.002)


class TorchCheckpointing:
    def __init__(self) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        self.mgr = CheckpointManager(
            CheckpointManager.Config(
                storage_config=LocalFileSystemStorageConfig(use_direct_io=False)
            )
        )
        self.future = None
        # its files fsynced once a save ends (it fsyncs nothing: use_direct_io=False), off
        # the training thread, as the others' background writers fsync theirs
        self.syncer = ThreadPoolExecutor(1, thread_name_prefix="tc-fsync")

    def save(self, path: Path, state: dict) -> tuple[float, float]:
        """(stall, time to committed incl. an fsync of its files)."""
        t = time.perf_counter()
        future = self.mgr.save(str(path), state)
        stall = time.perf_counter() - t
        future.result()
        fsync_tree(path)
        return stall, time.perf_counter() - t

    def save_async(self, path: Path, state: dict) -> None:
        """Its asynchronous save, durable (fsynced) in the background once written."""
        self.wait()
        saved = self.mgr.save(str(path), state)
        self.future = self.syncer.submit(lambda: (saved.result(), fsync_tree(path)))

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None

    def lock(self):
        return self.mgr.lock()

    def load(self, path: Path, into: dict) -> None:
        self.mgr.load(str(path), into=into)

    def close(self) -> None:
        self.wait()
        self.syncer.shutdown()
        self.mgr.close()


def torch_load_into(path: Path, target: dict) -> None:
    """What DLRover does from storage (``torch.load``), then the copy into the model."""
    loaded = torch.load(path, weights_only=True, mmap=False)
    for key, part in target.items():
        for name, t in part.items():
            t.copy_(loaded[key][name])
