"""A small thread pool whose threads never hold up the interpreter's exit.

``concurrent.futures`` joins its worker threads at exit, so an upload stuck on a silent
endpoint would keep a finished job alive for as long as its socket waits. Uploads are
resumable (the next writer on the root re-enqueues every step that is not durable), so at exit
they are abandoned instead: these threads are daemons, and the upload queue stops their retries.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class DaemonPool:
    """``submit``/``shutdown`` like ``ThreadPoolExecutor``, on up to ``workers`` daemon threads
    (started on demand)."""

    def __init__(
        self, workers: int, name: str, initializer: Callable[[], None] | None = None
    ) -> None:
        self._workers, self._name, self._initializer = workers, name, initializer
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: pool is shut down")
            self._queue.put((fut, fn, args))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._workers:
                t = threading.Thread(
                    target=self._work, daemon=True, name=f"{self._name}_{len(self._threads)}"
                )
                t.start()
                self._threads.append(t)
        return fut

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._queue.put(None)
        if wait:
            for t in threads:
                if t is not threading.current_thread():
                    t.join()

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while (item := self._queue.get()) is not None:
            fut, fn, args = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                    fut.set_exception(e)
            del item, fut, fn, args
            self._idle.release()
