"""The writer of each root an entry point saves to, built and recovered once, then kept."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import UploadFailedError
from ..writer import TieredStorageWriter


class Writers:
    """One :class:`TieredStorageWriter` per root, kept: staging buffers are reused save after
    save. A writer is recovered (crashed saves swept, unfinished uploads resumed) when first
    used, as an explicit step, not as a side effect of building it."""

    def __init__(
        self, remote: Any = None, storage_options: Mapping[str, Any] | None = None, **options: Any
    ) -> None:
        self.remote, self.storage_options, self.options = remote, storage_options, options
        self._writers: dict[str, TieredStorageWriter] = {}
        self.run_id: str | None = None  # the run every root of these writers records

    def get(self, root: str | os.PathLike[str]) -> TieredStorageWriter:
        root = os.path.abspath(root)
        if root not in self._writers:
            writer = TieredStorageWriter(
                root, remote=self.remote, storage_options=self.storage_options, **self.options
            )
            writer.recover()
            # A root the run saves to later (a shim's root per checkpoint) joins the run: the
            # one agreed at start, else the one the earlier roots' saves decided.
            run = self.run_id or next((w.run_id for w in self._writers.values() if w.run_id), None)
            if run is not None:
                writer.join_run(run)
            self._writers[root] = writer
        return self._writers[root]

    def __iter__(self) -> Any:
        return iter(list(self._writers.values()))

    def close(self, timeout_secs: float | None = None, *, wait_durable: bool = True) -> None:
        """Closes every writer; with ``wait_durable``, raises UploadFailedError naming the
        steps that did not become durable (after closing them all)."""
        writers, self._writers = list(self._writers.values()), {}
        error: UploadFailedError | None = None
        for writer in writers:
            try:
                writer.close(timeout_secs, wait_durable=wait_durable)
            except UploadFailedError as e:
                error = error or e
        if error is not None:
            raise error
