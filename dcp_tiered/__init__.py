"""dcp_tiered: fast, atomic, verifiable torch.distributed.checkpoint storage.

The public names are imported on first use (PEP 562): ``import dcp_tiered`` and the light
modules under it (the CLI's argument parsing, ``--help``, ``--version``) do not import torch,
which takes seconds. ``from dcp_tiered import X`` and ``dcp_tiered.X`` work as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports these
    from .config import RemoteConfig, RetryConfig
    from .distributed import checkpoint_process_group
    from .errors import (
        CheckpointExistsError,
        CheckpointNotFoundError,
        CommitError,
        ConfigError,
        DcpTieredError,
        ForeignPathError,
        ForeignRunError,
        InsufficientSpaceError,
        IntegrityError,
        ManifestError,
        MissingShardError,
        NotWritableError,
        PeerLostError,
        PermanentTierError,
        ReplicationError,
        SaveFailedError,
        StagingError,
        StateChangedError,
        TierError,
        TierUnavailableError,
        TransientTierError,
        UnsupportedExtensionError,
        UploadFailedError,
    )
    from .load_planner import TieredLoadPlanner
    from .manager import CheckpointManager
    from .planner import TieredSavePlanner
    from .policy.admission import Admission
    from .policy.cadence import Every, SavePolicy
    from .policy.outcomes import SaveOutcome
    from .policy.replication import Replication
    from .policy.retention import Retention, RetentionPolicy
    from .rank_state import RankState
    from .reader import TieredStorageReader
    from .tiers.remote import Durability
    from .writer import SaveRequest, TieredStorageWriter, WriterConfig

_ERRORS = (
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
    "StateChangedError",
    "TierError",
    "TierUnavailableError",
    "TransientTierError",
    "UnsupportedExtensionError",
    "UploadFailedError",
)
# public name -> the module (relative to the package) that defines it
_PUBLIC = {
    **dict.fromkeys(_ERRORS, "errors"),
    "RemoteConfig": "config",
    "RetryConfig": "config",
    "checkpoint_process_group": "distributed",
    "CheckpointManager": "manager",
    "Admission": "policy.admission",
    "Every": "policy.cadence",
    "SavePolicy": "policy.cadence",
    "SaveOutcome": "policy.outcomes",
    "Replication": "policy.replication",
    "Retention": "policy.retention",
    "RetentionPolicy": "policy.retention",
    "RankState": "rank_state",
    "TieredStorageReader": "reader",
    "Durability": "tiers.remote",
    "TieredStorageWriter": "writer",
    "WriterConfig": "writer",
    "SaveRequest": "writer",
    "TieredSavePlanner": "planner",
    "TieredLoadPlanner": "load_planner",
}


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


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
    "ForeignRunError",
    "InsufficientSpaceError",
    "IntegrityError",
    "ManifestError",
    "MissingShardError",
    "NotWritableError",
    "PeerLostError",
    "PermanentTierError",
    "RankState",
    "RemoteConfig",
    "Replication",
    "ReplicationError",
    "Retention",
    "RetentionPolicy",
    "RetryConfig",
    "SaveFailedError",
    "SaveOutcome",
    "SavePolicy",
    "SaveRequest",
    "StagingError",
    "StateChangedError",
    "TierError",
    "TierUnavailableError",
    "TieredLoadPlanner",
    "TieredSavePlanner",
    "TieredStorageReader",
    "TieredStorageWriter",
    "TransientTierError",
    "UnsupportedExtensionError",
    "UploadFailedError",
    "WriterConfig",
    "__version__",
    "checkpoint_process_group",
]
