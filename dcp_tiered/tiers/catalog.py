"""Which steps exist, on which tier, and what 'latest' means across tiers."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from ..backends.remote import RemoteBackend
from ..errors import CheckpointNotFoundError, ConfigError, TierError, TierUnavailableError
from ..policy import layout
from .local import LocalTier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepLocation:
    name: str
    committed_at_ns: int
    local: bool  # a committed directory on the local tier
    remote: bool  # a commit marker on the remote tier
    verified_format: bool  # False: a vanilla DCP directory without our manifest


def list_steps(
    tier: LocalTier, remote: RemoteBackend | None, *, strict: bool = False
) -> list[StepLocation]:
    """Committed steps on both tiers, oldest first. An unreadable remote raises
    TierUnavailableError with ``strict``; otherwise it is logged and left out."""
    found: dict[str, StepLocation] = {
        s.name: StepLocation(s.name, s.committed_at_ns, True, False, s.verified_format)
        for s in tier.steps()
    }
    remote_steps: list[str] = []
    if remote is not None:
        try:
            remote_steps = remote.committed_steps()
        except TierError as e:
            if strict:
                raise TierUnavailableError(
                    f"cannot read the remote tier {remote.config.url}: {e}. Which steps exist "
                    "there is unknown, so nothing was restored: fix the remote's address, "
                    "credentials or reachability (the cause above) and restore again"
                ) from e
            logger.warning(
                "remote tier %s unavailable, looking at %s only: %s",
                remote.config.url,
                tier.root,
                e,
            )
            remote = None
    for name in remote_steps:
        assert remote is not None
        try:
            marker = json.loads(remote.get_bytes(f"{name}/{layout.REMOTE_MARKER}"))
            committed_at = int(marker["committed_at_ns"])
        except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring remote step %s with an unreadable marker: %s", name, e)
            continue
        local = found.get(name)
        found[name] = StepLocation(
            name,
            max(committed_at, local.committed_at_ns) if local else committed_at,
            local is not None,
            True,
            local.verified_format if local else True,
        )
    return sorted(found.values(), key=lambda s: s.committed_at_ns)


def resolve(
    tier: LocalTier, remote: RemoteBackend | None, checkpoint_id: str | os.PathLike[str] | None
) -> StepLocation:
    """Map 'latest' (or None) or a step name to a committed step on some tier, or raise."""
    where = tier.root + (f" or {remote.config.url}" if remote is not None else "")
    try:
        steps = list_steps(tier, remote, strict=True)
    except TierUnavailableError as e:
        steps = list_steps(tier, None)
        if not steps:  # "no checkpoint" would be a guess: say what is wrong instead
            raise
        logger.warning(
            "remote tier unavailable (%s); resolving %r among the local steps of %s",
            e,
            checkpoint_id or layout.LATEST,
            tier.root,
        )
    if checkpoint_id is None or checkpoint_id == layout.LATEST:
        name = layout.newest((s.name, s.committed_at_ns) for s in steps)
        if name is None:
            raise CheckpointNotFoundError(
                f"no committed step in {where}: nothing to load for 'latest'. Check the paths, "
                "or save a checkpoint first."
            )
        return next(s for s in steps if s.name == name)
    if not isinstance(checkpoint_id, str):
        raise ConfigError(
            f"checkpoint_id must be a step name or 'latest', got {checkpoint_id!r}; "
            "the directory is given to the reader's constructor"
        )
    layout.validate_step_name(checkpoint_id)
    for s in steps:
        if s.name == checkpoint_id:
            return s
    existing = ", ".join(s.name for s in steps) or "none"
    raise CheckpointNotFoundError(
        f"step {checkpoint_id!r} not found in {where}. Committed steps: {existing}."
    )
