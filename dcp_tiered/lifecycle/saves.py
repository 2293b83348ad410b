"""The saves in flight of one entry point: each with the hooks it runs when it ends, oldest
first, at most ``limit`` of them writing to disk at once.

Two ways to end a save share this record. A shim ends its saves collectively
(:meth:`~dcp_tiered.lifecycle.finishing.Finishing.finish`: ``finalize`` on every
rank, ``on_commit`` on rank 0, ``on_failure`` on every rank when any failed). The manager
never waits for a save on the training thread: each rank reaps what ended
(:meth:`~dcp_tiered.lifecycle.reaping.Reaping.reap`: ``on_written``, then ``on_durable``
once this process's upload ended), records failures, and the ranks agree on them at the next
save's vote.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..tiers.root import SaveReport

DISK, MEMORY = "local", "memory"


@dataclass
class Save:
    """One save in flight and what runs when it ends."""

    root: str
    step: str
    future: Future[Any]  # ends when this rank's part is written
    finalize: Callable[[], Any] | None = None  # every rank, once written (mcore's finalize fns)
    on_commit: Callable[[], Any] | None = None  # rank 0, once committed (the framework's tracker)
    on_failure: Callable[[], Any] | None = None  # every rank, when it failed on any (clean-up)
    # Reaped per rank: this rank's part ended (the future, done); True: follow its upload.
    on_written: Callable[[Future[Any]], bool] | None = None
    on_durable: Callable[[BaseException | None], None] | None = None  # this process's upload
    tier: str = DISK  # a disk save holds staging buffers: those count against the cap
    started: float = field(default_factory=time.time)  # epoch seconds
    published: Future[Any] | None = None  # rank 0: on_commit run in the background
    report: SaveReport | None = None  # a disk save's, from its tiers once written
    upload: Future[Any] | None = None  # this process's promotion of the step, once published


class InFlight:
    """Saves in flight, oldest first (at most ``limit`` to disk), and the saves written whose
    upload this process follows."""

    def __init__(self, limit: int = 1) -> None:
        self.limit = limit
        self.saves: list[Save] = []
        self.uploading: list[Save] = []

    def add(self, save: Save) -> None:
        self.saves.append(save)

    @property
    def newest(self) -> Save | None:
        return self.saves[-1] if self.saves else None

    def full(self) -> bool:
        """Whether as many disk saves as the cap allows are in flight."""
        return len(self.on_disk()) >= self.limit

    def on_disk(self) -> list[Save]:
        return [s for s in self.saves if s.tier == DISK]

    def take_all(self) -> list[Save]:
        saves, self.saves = self.saves, []
        return saves

    def take_written(self) -> list[Save]:
        """The saves whose future ended, taken out of flight, oldest first."""
        done = [s for s in self.saves if s.future.done()]
        self.saves = [s for s in self.saves if s not in done]
        return done

    def wait(self, saves: list[Save] | None = None) -> None:
        """Until ``saves`` (default: all in flight) are written or failed, without raising."""
        futures.wait([s.future for s in (self.saves if saves is None else saves)])


def after(future: Future[Any], then: Callable[[], Any]) -> Any:
    future.result()
    return then()


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Without a process group, DCP warns on every call that it runs in one process: yes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield


def settled(value: Any = None, error: BaseException | None = None) -> Future[Any]:
    """A future that has already ended, with ``value`` or ``error``."""
    future: Future[Any] = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future
