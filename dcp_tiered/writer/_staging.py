"""The writer's AsyncStager role: ``dcp.async_save`` stages the state dict through the writer
itself, into the reused, double-buffered host memory of its
:class:`~dcp_tiered.staging.DoubleBufferStager`.

:class:`StagingRole` is a role :class:`~dcp_tiered.writer.TieredStorageWriter` inherits, as
DCP's ``FileSystemWriter`` inherits ``BlockingAsyncStager``. A writer copy unpickled in DCP's
checkpoint process has no stager (``_stager`` is None) and cannot stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..staging import DoubleBufferStager
from ._config import CopyCheck


class StagingRole:
    """DCP's AsyncStager protocol, delegated to the writer's stager."""

    _stager: DoubleBufferStager | None  # set by TieredStorageWriter.__init__
    # the next stage's copy goes on beside the caller: who to let go, and where to say how
    # it went (copy_beside)
    _beside: tuple[Callable[[], None], CopyCheck] | None = None

    _synchronize_after_execute = True

    @property
    def should_synchronize_after_execute(self) -> bool:
        return True

    def copy_beside(self, let_go: Callable[[], None] | None) -> CopyCheck:
        """The next ``stage`` calls ``let_go`` before it copies the tensors' bytes (the caller
        waiting for the stage goes on beside the copy) and says in the returned check whether
        a tensor changed meanwhile; pass the check with the save's :class:`SaveRequest`, and
        the save then fails on every rank where one did, before it writes. None: the next
        ``stage`` copies as usual."""
        check = CopyCheck()
        self._beside = None if let_go is None else (let_go, check)
        return check

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into reused, double-buffered host memory (the caller's stall,
        unless ``copy_beside`` let it go first)."""
        beside, self._beside = self._beside, None
        if beside is None:
            return self._require_stager().stage(state_dict)
        let_go, check = beside
        stager = self._require_stager()
        staged = stager.stage(state_dict, beside=let_go)
        check.error = stager.last_change
        return staged

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
