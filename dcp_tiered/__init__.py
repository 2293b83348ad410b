"""dcp_tiered: fast, atomic, verifiable torch.distributed.checkpoint storage.

The public names are imported on first use (PEP 562): ``import dcp_tiered`` and the light
modules under it (the CLI's argument parsing, ``--help``, ``--version``) do not import torch,
which takes seconds. ``from dcp_tiered import X`` and ``dcp_tiered.X`` work as before.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
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
    from .writer import TieredStorageWriter

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
    "TieredSavePlanner": "planner",
    "TieredLoadPlanner": "load_planner",
}

# ``dcp_tiered.layout``, ``dcp_tiered.tiering``... (the modules before they moved into
# ``policy/`` and ``tiers/``) still import, as the same module objects.
_MOVED = {
    "layout": "policy.layout",
    "manifest": "policy.manifest",
    "integrity": "policy.integrity",
    "retention": "policy.retention",
    "cadence": "policy.cadence",
    "admission": "policy.admission",
    "memory_format": "policy.memory_format",
    "local_tier": "tiers.local",
    "memory_tier": "tiers.memory",
    "tiering": "tiers.remote",
    "commit": "tiers.commit",
    "catalog": "tiers.catalog",
    "housekeeping": "tiers.housekeeping",
    "uploads": "tiers.uploads",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``import dcp_tiered.layout`` to the module now at ``dcp_tiered.policy.layout``,
    on demand: the old eager aliases imported every module (and torch) with the package."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        package, _, old = fullname.rpartition(".")
        if package != __name__ or old not in _MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        module = importlib.import_module(f"{__name__}.{_MOVED[spec.name.rpartition('.')[2]]}")
        spec.loader_state = module.__spec__  # the module's own spec, for exec_module
        return module

    def exec_module(self, module: Any) -> None:
        # Already executed under its new name; the import system has just set its __spec__ to
        # the alias's, which would break importlib.reload: give it its own back.
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    elif name in _MOVED:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_MOVED})


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
    "StagingError",
    "TierError",
    "TierUnavailableError",
    "TieredLoadPlanner",
    "TieredSavePlanner",
    "TieredStorageReader",
    "TieredStorageWriter",
    "TransientTierError",
    "UnsupportedExtensionError",
    "UploadFailedError",
    "__version__",
    "checkpoint_process_group",
]
