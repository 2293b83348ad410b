"""The tiers and the writer of each root an entry point saves to, built and recovered once,
then kept: the lifecycle owns them (the writer writes on tiers it is given)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import UploadFailedError
from ..policy.retention import RetentionPolicy
from ..tiers.root import Tiers
from ..writer import TieredStorageWriter, WriterConfig


class Writers:
    """One :class:`~dcp_tiered.tiers.root.Tiers` and one :class:`TieredStorageWriter` per root,
    kept: staging buffers are reused save after save, and the root's uploads run on its tiers
    until :meth:`close`. A writer is recovered (crashed saves swept, unfinished uploads resumed)
    when first used, as an explicit step, not as a side effect of building it. ``options``:
    the :class:`WriterConfig` fields, and ``run_id``."""

    def __init__(
        self, remote: Any = None, storage_options: Mapping[str, Any] | None = None, **options: Any
    ) -> None:
        self.remote, self.storage_options = remote, storage_options
        self._explicit_run = options.pop("run_id", None)
        self.config = WriterConfig(**options)
        self._writers: dict[str, tuple[Tiers, TieredStorageWriter]] = {}
        self.run_id: str | None = None  # the run every root of these writers records
        # The remote tier's retention, as its keepers hold it now (Keepers sets this).
        self.remote_retention: Callable[[], RetentionPolicy | None] = lambda: None

    def get(self, root: str | os.PathLike[str]) -> TieredStorageWriter:
        return self._of(root)[1]

    def tiers(self, root: str | os.PathLike[str]) -> Tiers:
        return self._of(root)[0]

    def _of(self, root: str | os.PathLike[str]) -> tuple[Tiers, TieredStorageWriter]:
        root = os.path.abspath(root)
        if root not in self._writers:
            tiers = Tiers.open(root, self.remote, self.storage_options)
            tiers.remote_retention = lambda: self.remote_retention()
            writer = TieredStorageWriter(tiers, config=self.config, run_id=self._explicit_run)
            writer.recover()
            # A root the run saves to later (a shim's root per checkpoint) joins the run: the
            # one agreed at start, else the one the earlier roots' saves decided.
            run = self.run_id or next((w.run_id for w in self if w.run_id), None)
            if run is not None:
                writer.join_run(run)
            self._writers[root] = (tiers, writer)
        return self._writers[root]

    def __iter__(self) -> Any:
        return iter([writer for _, writer in self._writers.values()])

    def owned(self) -> list[tuple[Tiers, TieredStorageWriter]]:
        """Each root's tiers and writer."""
        return list(self._writers.values())

    def close(self, timeout_secs: float | None = None, *, wait_durable: bool = True) -> None:
        """Closes every writer and its tiers; with ``wait_durable``, first waits for their
        uploads and raises UploadFailedError naming the steps that did not become durable
        (after closing them all)."""
        owned, self._writers = self.owned(), {}
        error: UploadFailedError | None = None
        for tiers, writer in owned:
            try:
                writer.close()
                tiers.close(timeout_secs, wait_durable=wait_durable)
            except UploadFailedError as e:
                error = error or e
        if error is not None:
            raise error
