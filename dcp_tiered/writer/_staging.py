"""The writer's AsyncStager role: ``dcp.async_save`` stages the state dict through the writer
itself, into the reused, double-buffered host memory of its
:class:`~dcp_tiered.staging.DoubleBufferStager`.

:class:`StagingRole` is a role :class:`~dcp_tiered.writer.TieredStorageWriter` inherits, as
DCP's ``FileSystemWriter`` inherits ``BlockingAsyncStager``. A writer copy unpickled in DCP's
checkpoint process has no stager (``_stager`` is None) and cannot stage.
"""

from __future__ import annotations

from typing import Any

from ..staging import DoubleBufferStager


class StagingRole:
    """DCP's AsyncStager protocol, delegated to the writer's stager."""

    _stager: DoubleBufferStager | None  # set by TieredStorageWriter.__init__

    _synchronize_after_execute = True

    @property
    def should_synchronize_after_execute(self) -> bool:
        return True

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into reused, double-buffered host memory (the caller's stall)."""
        return self._require_stager().stage(state_dict)

    def synchronize_staging(self) -> None:
        # async_save calls this right after starting the save's executor thread.
        self._require_stager().after_execute()

    def staged(self) -> tuple[float, int]:
        """What the ``stage`` call that just returned cost: the caller's stall (seconds) and
        the tensor bytes it staged."""
        stager = self._require_stager()
        return stager.last_stall_secs, stager.last_staged_bytes

    def staging_buffers_ready(self) -> int:
        """Buffer sets already allocated for the last staged structure (0 to 2): staging
        allocates host memory only while this is below 2."""
        return self._require_stager().buffers_ready()

    def _require_stager(self) -> DoubleBufferStager:
        if self._stager is None:
            raise RuntimeError("this writer copy was unpickled in a worker and cannot stage")
        return self._stager

    def _wait_for_earlier_saves(self) -> None:
        # The first writer call of every save, before DCP's first collective: saves run one at
        # a time, in the order they were staged, on every rank.
        if self._stager is not None:
            self._stager.wait_for_earlier_saves()
