"""dcp_tiered: fast, atomic, verifiable torch.distributed.checkpoint storage."""

from ._version import __version__
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
    NotWritableError,
    PermanentTierError,
    SaveFailedError,
    StagingError,
    TierError,
    TierUnavailableError,
    TransientTierError,
    UnsupportedExtensionError,
    UploadFailedError,
)
from .manager import CheckpointManager
from .policy.admission import Admission
from .policy.cadence import Every, SavePolicy
from .policy.retention import Retention, RetentionPolicy
from .rank_state import RankState
from .reader import TieredStorageReader
from .tiers.remote import Durability
from .writer import TieredStorageWriter


def _keep_old_module_paths() -> None:
    """``dcp_tiered.layout``, ``dcp_tiered.tiering``... (the modules before they moved into
    ``policy/`` and ``tiers/``) still import, as the same module objects."""
    import importlib
    import sys

    moved = {"layout": "policy.layout", "manifest": "policy.manifest",
             "integrity": "policy.integrity", "retention": "policy.retention",
             "cadence": "policy.cadence", "admission": "policy.admission",
             "memory_format": "policy.memory_format", "local_tier": "tiers.local",
             "memory_tier": "tiers.memory", "tiering": "tiers.remote", "commit": "tiers.commit",
             "catalog": "tiers.catalog", "housekeeping": "tiers.housekeeping",
             "uploads": "tiers.uploads"}
    for old, new in moved.items():
        module = importlib.import_module(f"{__name__}.{new}")
        sys.modules[f"{__name__}.{old}"] = module
        globals()[old] = module


_keep_old_module_paths()

__all__ = [
    "Admission",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CommitError",
    "ConfigError",
    "DcpTieredError",
    "Durability",
    "Every",
    "ForeignPathError",
    "InsufficientSpaceError",
    "IntegrityError",
    "ManifestError",
    "MissingShardError",
    "NotWritableError",
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
    "UnsupportedExtensionError",
    "UploadFailedError",
    "__version__",
    "checkpoint_process_group",
]
