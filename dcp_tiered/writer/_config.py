"""How a :class:`~dcp_tiered.writer.TieredStorageWriter` writes, fixed for its life; and
:class:`SaveRequest`, what one save asks of it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import ConfigError, StateChangedError
from ..policy import layout


@dataclass(frozen=True, kw_only=True)
class WriterConfig:
    """How a writer writes every save (where it writes is its tiers').

    Args:
        overwrite: allow re-saving an existing step; the old one survives until the new one
            is committed.
        sync_files: fsync data, manifest and directories (turn off only for tests).
        thread_count: files (and threads) per rank; checksumming and torch.save framing are
            CPU-bound, so two threads keep up with a fast local disk.
        free_space_margin_bytes: headroom required beyond the planned bytes.
        staging_share_memory: stage into shared memory (saves a copy in PROCESS mode).
        staging_timeout_secs: how long staging waits for an earlier save to release buffers.
        commit_timeout_secs: how long nodes wait for each other during the commit.
        collective_timeout_warn_secs: log one ERROR when a save has waited this long in one
            of DCP's collectives (the plan gather/scatter, or the final gather before
            ``finish``) because other ranks never joined: the sign of an ``async_save`` on the
            training process group. None disables the check.
    """

    overwrite: bool = False
    sync_files: bool = True
    thread_count: int = 2
    free_space_margin_bytes: int = 64 * 2**20
    staging_share_memory: bool = False
    staging_timeout_secs: float = 1800.0
    commit_timeout_secs: float = 1800.0
    collective_timeout_warn_secs: float | None = 300.0

    def __post_init__(self) -> None:
        warn = self.collective_timeout_warn_secs
        if warn is not None and not warn > 0:
            raise ConfigError(
                f"collective_timeout_warn_secs must be > 0 (or None to disable), got {warn}"
            )
        if self.thread_count < 1:
            raise ConfigError(f"thread_count must be >= 1, got {self.thread_count}")
        if self.free_space_margin_bytes < 0:
            raise ConfigError("free_space_margin_bytes must be >= 0")


@dataclass
class CopyCheck:
    """What a staging copy made beside training found (``copy_beside``): ``error`` if the
    state changed while it copied, and the save must not commit."""

    error: StateChangedError | None = None


@dataclass(frozen=True)
class SaveRequest(os.PathLike[str]):
    """A ``checkpoint_id`` that carries what one save asks beyond its step name: every rank
    passes the same one to ``dcp.save``/``dcp.async_save``, and the coordinator's goes to every
    rank with the save's facts. ``promote=False``: keep this step on the local tier only (the
    remote, if any, does not get it). ``copy_check``: this rank's staging copy was made beside
    training (the manager's ``async_snapshots``), and the save fails on every rank where it
    found the state changed."""

    step: str
    promote: bool = True
    copy_check: CopyCheck | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        layout.validate_step_name(self.step)

    def __fspath__(self) -> str:
        return self.step
