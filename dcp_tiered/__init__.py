"""dcp_tiered: fast, atomic, verifiable torch.distributed.checkpoint storage."""

__version__ = "0.1.0"

from .admission import Admission  # noqa: E402
from .cadence import Every, SavePolicy  # noqa: E402
from .config import RemoteConfig, RetryConfig  # noqa: E402
from .distributed import checkpoint_process_group  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    ConfigError,
    DcpTieredError,
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
from .manager import CheckpointManager  # noqa: E402
from .rank_state import RankState  # noqa: E402
from .reader import TieredStorageReader  # noqa: E402
from .retention import Retention, RetentionPolicy  # noqa: E402
from .writer import TieredStorageWriter  # noqa: E402

__all__ = [
    "Admission",
    "CheckpointManager",
    "Every",
    "RankState",
    "Retention",
    "RetentionPolicy",
    "SaveFailedError",
    "SavePolicy",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CommitError",
    "ConfigError",
    "DcpTieredError",
    "InsufficientSpaceError",
    "IntegrityError",
    "ManifestError",
    "MissingShardError",
    "PermanentTierError",
    "RemoteConfig",
    "RetryConfig",
    "StagingError",
    "TieredStorageReader",
    "TieredStorageWriter",
    "TierError",
    "TierUnavailableError",
    "TransientTierError",
    "UploadFailedError",
    "__version__",
    "checkpoint_process_group",
]
