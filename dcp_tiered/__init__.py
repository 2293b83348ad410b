"""dcp_tiered: fast, atomic, verifiable torch.distributed.checkpoint storage."""

__version__ = "0.1.0"

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
    StagingError,
    TierError,
    TransientTierError,
    UploadFailedError,
)
from .reader import TieredStorageReader  # noqa: E402
from .writer import TieredStorageWriter  # noqa: E402

__all__ = [
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
    "TransientTierError",
    "UploadFailedError",
    "__version__",
    "checkpoint_process_group",
]
