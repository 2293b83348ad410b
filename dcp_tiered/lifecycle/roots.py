"""A checkpoint root as the framework adapters (``dcp_tiered.shims``) see it: its local tier,
what is committed there and on the remote tier, pulling a remote step onto it, the
frameworks' own small files beside a step, and step names.

The adapters reach the tiers and backends only through here (tests/test_layering.py), so how
a root is opened or listed can change without touching them.
"""

from __future__ import annotations

import os

from ..backends.local import LocalBackend, replace_file
from ..backends.remote import RemoteBackend, remote_backend
from ..policy.layout import MANIFEST_NAME, is_step_name, validate_step_name
from ..policy.step_names import DEEPSPEED, HF, MEGATRON, STEP, StepNames, order_number
from ..tiers import catalog, pull
from ..tiers.local import LocalTier
from ..tiers.remote import RemoteTier
from ..tiers.step_record import CommittedStep

__all__ = [
    "DEEPSPEED",
    "HF",
    "MANIFEST_NAME",
    "MEGATRON",
    "STEP",
    "StepNames",
    "adopt_remote_step",
    "committed_steps",
    "files_in",
    "is_step_name",
    "local_tier",
    "newest_step",
    "numbered_steps",
    "order_number",
    "remote_backend",
    "remote_step_names",
    "validate_step_name",
    "write_file_atomically",
]


def local_tier(root: str | os.PathLike[str]) -> LocalTier:
    """The local tier of the directory ``root`` (nothing is created or recovered: listing,
    reading and the checks an adapter makes before DCP's own calls)."""
    return LocalTier(LocalBackend(os.fspath(root)))


def files_in(directory: str | os.PathLike[str]) -> LocalBackend:
    """A plain directory's files (a framework's own, beside or inside a step)."""
    return LocalBackend(os.fspath(directory))


def committed_steps(
    root: str | os.PathLike[str], remote: RemoteBackend | None, *, strict: bool
) -> list[CommittedStep]:
    """The steps committed in ``root`` and on ``remote``, oldest first (an unreadable remote
    raises TierUnavailableError with ``strict``, else it is logged and left out)."""
    return catalog.list_steps(local_tier(root), remote, strict=strict)


def numbered_steps(
    root: str | os.PathLike[str], remote: RemoteBackend | None, names: StepNames, *, strict: bool
) -> list[tuple[int, CommittedStep]]:
    """A framework's committed steps in ``root`` and on ``remote``: those named exactly as
    ``names`` builds them (any other directory is not its step), with their numbers, oldest
    first. ``strict`` as for :func:`committed_steps`."""
    return catalog.numbered_steps(local_tier(root), remote, names, strict=strict)


def newest_step(root: str | os.PathLike[str], remote: RemoteBackend | None) -> str:
    """The newest committed step on either tier; CheckpointNotFoundError when there is none."""
    return catalog.resolve(local_tier(root), remote, None).name


def adopt_remote_step(root: str | os.PathLike[str], remote: RemoteBackend, step: str) -> None:
    """Commit the durable remote ``step`` in ``root`` as its manifest alone (readers fetch its
    data from the remote, verified), so tools that look on local disk find it."""
    pull.adopt_remote_step(local_tier(root), remote, step)


def remote_step_names(remote: RemoteBackend | None) -> list[str]:
    """The steps committed on the remote tier (none without one); a store that cannot be
    listed raises DcpTieredError."""
    return RemoteTier(remote).steps() if remote is not None else []


def write_file_atomically(path: str | os.PathLike[str], data: bytes) -> None:
    """Atomic, durable replacement of a framework's small file beside a step (a tracker such
    as ``latest``, stubs, configs): readers see the old content or the new, never a mix."""
    replace_file(path, data)
