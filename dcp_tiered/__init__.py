"""dcp_tiered: fast, atomic, verifiable torch.distributed.checkpoint storage."""

from ._version import __version__
from .admission import Admission
from .cadence import Every, SavePolicy
from .config import RemoteConfig, RetryConfig
from .distributed import checkpoint_process_group
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    ConfigError,
    DcpTieredError,
    ForeignPathError,
    InsufficientSpaceError,
    IntegrityError,
    ManifestError,
    MissingShardError,
    PermanentTierError,
    SaveFailedError,
    StagingError,
    TierError,
    TierUnavailableError,
    TransientTierError,
    UploadFailedError,
)
from .manager import CheckpointManager
from .rank_state import RankState
from .reader import TieredStorageReader
from .retention import Retention, RetentionPolicy
from .writer import TieredStorageWriter

__all__ = [
    "Admission",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CommitError",
    "ConfigError",
    "DcpTieredError",
    "Every",
    "ForeignPathError",
    "InsufficientSpaceError",
    "IntegrityError",
    "ManifestError",
    "MissingShardError",
    "PermanentTierError",
    "RankState",
    "RemoteConfig",
    "Retention",
    "RetentionPolicy",
    "RetryConfig",
    "SaveFailedError",
    "SavePolicy",
    "StagingError",
    "TierError",
    "TierUnavailableError",
    "TieredStorageReader",
    "TieredStorageWriter",
    "TransientTierError",
    "UploadFailedError",
    "__version__",
    "checkpoint_process_group",
]
