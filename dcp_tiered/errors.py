"""Exceptions raised by dcp_tiered.

Every message says what failed, where (step, file, rank, tier) and what to do.
Library errors subclass the built-in exception a caller would naturally catch::

    DcpTieredError(Exception)
    ├── ConfigError(ValueError)              bad argument or unsafe checkpoint name
    │   └── ForeignRunError                  a root, prefix or memory dir belongs to another run
    ├── CheckpointNotFoundError(FileNotFoundError)
    ├── CheckpointExistsError(FileExistsError)
    │   └── ForeignPathError                 the path holds something that is not our step
    ├── MissingShardError(FileNotFoundError) a data file named by the manifest is gone
    ├── ManifestError(ValueError)            manifest unreadable, tampered or of another version
    ├── UnsupportedExtensionError(ValueError) a vanilla step's stream extension cannot be applied
    ├── IntegrityError                       checksum or size mismatch
    ├── InsufficientSpaceError(OSError)      no room on a tier: bytes or inodes
    ├── NotWritableError(PermissionError)    a tier's directory is read-only or not ours to write
    ├── StagingError                         staging buffers still held by an earlier save
    ├── CommitError                          a node failed to publish the step
    ├── SaveFailedError                      a background save or upload failed on some rank
    ├── PeerLostError(RuntimeError)          another rank is gone: a checkpoint collective failed
    │   └── ReplicationError                 ... and it is (or took) a replication partner
    └── TierError                            a storage tier failed
        ├── TransientTierError               5xx, SlowDown, timeouts, resets; retried
        ├── PermanentTierError               AccessDenied, NoSuchBucket; not retried
        ├── UploadFailedError                a step could not be made durable remotely
        └── TierUnavailableError             a configured tier cannot be read (restore)

Note: ``dcp.save``/``dcp.load`` re-raise any rank's failure as
``torch.distributed.checkpoint.api.CheckpointException`` (a ``BaseException``); the
original errors above are in its ``.failures[rank]``.
"""

from __future__ import annotations

__all__ = [
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CommitError",
    "ConfigError",
    "DcpTieredError",
    "ForeignPathError",
    "ForeignRunError",
    "InsufficientSpaceError",
    "IntegrityError",
    "ManifestError",
    "MissingShardError",
    "NotWritableError",
    "PeerLostError",
    "PermanentTierError",
    "ReplicationError",
    "SaveFailedError",
    "StagingError",
    "TierError",
    "TierUnavailableError",
    "TransientTierError",
    "UnsupportedExtensionError",
    "UploadFailedError",
]


class DcpTieredError(Exception):
    """Base class of every error raised by dcp_tiered."""


class ConfigError(DcpTieredError, ValueError):
    """An argument or a checkpoint name is invalid."""


class ForeignRunError(ConfigError):
    """A local root, remote prefix or memory directory belongs to another run (or another job
    runs on it now): this job is refused at start, or the act (a delete, a quarantine, an
    overwrite) is refused, and nothing is changed. The message names the other run."""


class CheckpointNotFoundError(DcpTieredError, FileNotFoundError):
    """The requested step does not exist (or is not committed)."""


class CheckpointExistsError(DcpTieredError, FileExistsError):
    """A committed step with that name exists and overwrite was not asked for."""


class ForeignPathError(CheckpointExistsError):
    """The step's path holds files that are not a checkpoint of ours: never replaced, even
    with overwrite; the message says to move them away or save elsewhere."""


class MissingShardError(DcpTieredError, FileNotFoundError):
    """A data file listed in the manifest is missing."""


class ManifestError(DcpTieredError, ValueError):
    """The manifest cannot be trusted: unreadable, tampered or of an unknown version."""


class UnsupportedExtensionError(DcpTieredError, ValueError):
    """A vanilla DCP checkpoint was written with a stream extension (``_extensions=``) that
    this reader cannot apply: not registered, or its package is not installed."""


class IntegrityError(DcpTieredError):
    """Bytes read from storage do not match the checksum recorded at save time.

    ``proves_bad`` is True on the errors that prove a stored step bad (:meth:`proof`): bytes
    that fail their checksum on every tier the reader could take them from, or an object of a
    committed save that the store says is gone. Only those make a restore quarantine the step
    it fell back past; an unreachable tier, a timeout or a state that does not fit never does.
    (The flag is instance state, so it survives the pickling DCP sends errors through.)"""

    proves_bad = False

    @classmethod
    def proof(cls, message: str) -> IntegrityError:
        error = cls(message)
        error.proves_bad = True
        return error


class InsufficientSpaceError(DcpTieredError, OSError):
    """A tier has not enough free space for the save: bytes, or inodes (ENOSPC while bytes
    are free; the message says which)."""


class NotWritableError(DcpTieredError, PermissionError):
    """A tier's directory cannot be written: a read-only filesystem (EROFS) or no permission
    (EACCES, EPERM). It does not pass by itself, so it is never skipped like a full disk; the
    message names the path and what to do (remount read-write, fix the owner or mode)."""


class StagingError(DcpTieredError):
    """The staging buffers are still held by an earlier save that did not finish."""


class StateChangedError(StagingError):
    """The state changed while a memory snapshot or a disk save's staging copied it beside
    training (``CheckpointManager(async_snapshots=True)``): the copy mixes two steps, so it was not
    committed. Call ``wait_staged()`` before changing the state (``optimizer.step()``)."""


class CommitError(DcpTieredError):
    """A node did not publish the step in time."""


class SaveFailedError(DcpTieredError):
    """An asynchronous save or upload failed on one or more ranks; raised on every rank.

    ``failures`` lists ``{"rank", "step", "tier", "where", "error"}`` for each failure.
    """

    def __init__(self, message: str, failures: list[dict[str, object]]) -> None:
        super().__init__(message)
        self.failures = failures


class PeerLostError(DcpTieredError, RuntimeError):
    """A collective of the checkpoint lifecycle failed because another rank is gone (its
    process died, its node was lost) or cannot be reached: the job can no longer checkpoint.
    A RuntimeError, as the process group's own error is; the message says what to do (restart
    the job: the restore takes the newest step every rank can still get)."""


class ReplicationError(PeerLostError):
    """As PeerLostError, on a job with peer replication: the message names this rank's
    replication partners (ranks and nodes) and why replication stopped, if it had."""


class TierError(DcpTieredError):
    """A storage tier failed an operation."""


class TransientTierError(TierError):
    """Throttling, 5xx, timeouts, connection resets: retried with backoff."""


class PermanentTierError(TierError):
    """AccessDenied, NoSuchBucket, bad credentials: not retried; the message says what to fix."""


class UploadFailedError(TierError):
    """A step could not be made durable on the remote tier."""


class TierUnavailableError(TierError):
    """A configured tier cannot be read, so which steps exist is unknown: a restore refuses to
    guess (it could start from scratch, or from an old step, while newer ones exist)."""


def causes(e: BaseException) -> list[BaseException]:
    """The errors behind ``e``: each rank's for DCP's CheckpointException, else ``e`` itself."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]
    return [e]


def describe(e: BaseException) -> str:
    """One line for an exception; for DCP's CheckpointException, every rank's cause."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, f in sorted(failures.items()):
            exc = f[0] if isinstance(f, tuple) else f
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return "; ".join(parts)[:2000]
    return f"{type(e).__name__}: {e}"[:2000]
