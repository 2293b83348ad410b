"""Applies retention policies to the tiers: lists, decides (retention.py), deletes.

Deletes only committed steps found under the tier's own root or remote prefix, each logged at
INFO by the backend. Vanilla DCP directories and steps whose manifest cannot be read are left
alone: we do not delete what we cannot vouch for.
"""

from __future__ import annotations

import logging

from ..backends.remote import RemoteBackend
from ..errors import ManifestError, TierError
from ..policy.retention import RetentionPolicy, StepState, evictions
from . import remote as remote_tier
from .local import LocalTier

logger = logging.getLogger(__name__)


def prune_local(
    tier: LocalTier, policy: RetentionPolicy, remote: RemoteBackend | None, *, label: str
) -> list[str]:
    """Apply ``policy`` to a memory or local tier. A step whose manifest asks for promotion
    is kept until ``remote`` holds it durably (or while ``remote`` cannot tell)."""
    states = [
        StepState(s.name, s.committed_at_ns)
        for s in tier.steps()
        if s.verified_format and s.committed_at_ns >= 0
    ]
    deleted = []
    for name in evictions(states, policy):
        if remote is not None and awaiting_remote(tier, remote, name):
            continue
        tier.delete_step(name, reason=f"retention of the {label} tier")
        deleted.append(name)
    return deleted


def awaiting_remote(tier: LocalTier, remote: RemoteBackend, step: str) -> bool:
    """Whether ``step`` asks for promotion and ``remote`` does not hold it durably yet (or it
    cannot be told): such a step is the only durable copy and must not be deleted."""
    try:
        m = tier.read_manifest(step)
        return m.promote and not remote_tier.is_durable(remote, m)
    except (ManifestError, OSError):
        return True
    except TierError as e:
        logger.warning(
            "keeping %s/%s: cannot tell whether it is durable on %s (%s)",
            tier.root,
            step,
            remote.config.url,
            e,
        )
        return True


def prune_remote(remote: RemoteBackend, policy: RetentionPolicy) -> list[str]:
    states = []
    for name in remote.committed_steps():
        try:
            marker = remote_tier.read_marker(remote, name)
        except ManifestError as e:  # never deleted: we cannot vouch for what it is
            logger.warning("retention keeps remote step %s: %s", name, e)
            continue
        if marker is not None:
            states.append(StepState(name, int(marker.get("committed_at_ns", 0))))
    doomed = evictions(states, policy)
    for name in doomed:
        remote_tier.delete_remote_step(remote, name, reason="retention of the remote tier")
    return doomed
