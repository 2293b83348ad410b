"""Applies retention policies to the tiers: lists, decides (retention.py), deletes.

Deletes only committed steps that are provably this run's: under the tier's own root or remote
prefix, stored under the step name their manifest (or marker) gives, naming the run the root
records (or adopted by it); each delete is logged at INFO by the backend. Vanilla DCP
directories, copies, steps of other runs or from before run identities, and steps whose
manifest or marker cannot be read are left alone: we do not delete what we cannot vouch for.
A step due on the remote is deleted locally only once the store itself shows its save whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..backends.remote import RemoteBackend
from ..errors import ManifestError, TierError
from ..policy import step_names
from ..policy.identity import Owner
from ..policy.retention import RetentionPolicy, StepState, decide, evictions
from .local import LocalTier
from .remote import RemoteTier

logger = logging.getLogger(__name__)


def _own_steps(tier: LocalTier) -> list[StepState]:
    """This run's own committed steps on ``tier`` (none when the root records no run:
    nothing there is provably ours)."""
    record = tier.record()
    if record is None:
        return []
    return [
        StepState(s.name, s.committed_at_ns) for s in tier.steps() if s.owner(record) == Owner.OURS
    ]


@dataclass(frozen=True)
class Pruned:
    """What one retention pass over a local tier did (or, dry, would do)."""

    deleted: list[str]  # oldest first; with dry_run: what would be deleted
    held: list[str]  # due by the policy but kept: not durable on the remote yet (or unknown)
    kept: list[str]  # the run's own steps left, by step number


def local_pass(
    tier: LocalTier,
    policy: RetentionPolicy,
    remote: RemoteBackend | None,
    *,
    label: str,
    dry_run: bool = False,
) -> Pruned:
    """Apply ``policy`` to a local tier's own steps (with ``dry_run``: decide only, delete
    nothing). A step whose manifest asks for promotion is kept until the store holds its save
    whole (or while that cannot be told)."""
    own = _own_steps(tier)
    deleted, held = decide(
        own, policy, lambda name: remote is not None and awaiting_remote(tier, remote, name)
    )
    if not dry_run:
        for name in deleted:
            tier.delete_step(name, reason=f"retention of the {label} tier")
    kept = sorted(
        (s.name for s in own if s.name not in deleted),
        key=lambda n: (step_names.order_number(n) or -1, n),
    )
    return Pruned(deleted, held, kept)


def prune_local(
    tier: LocalTier, policy: RetentionPolicy, remote: RemoteBackend | None, *, label: str
) -> list[str]:
    """Apply ``policy`` to a local tier's own steps; the names deleted (:func:`local_pass`)."""
    return local_pass(tier, policy, remote, label=label).deleted


def awaiting_remote(tier: LocalTier, remote: RemoteBackend, step: str) -> bool:
    """Whether ``step`` asks for promotion and the store does not show its save whole (this
    root's files of it, by one listing: not the marker alone), or it cannot be told: such a
    step may be the only durable copy and must not be deleted."""
    try:
        m = tier.read_manifest(step)
        return m.promote and not RemoteTier(remote).holds_whole(m)
    except (ManifestError, OSError, ValueError):
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


def prune_remote(remote: RemoteBackend, policy: RetentionPolicy, run_id: str | None) -> list[str]:
    """Apply ``policy`` to run ``run_id``'s steps on the remote tier; a step whose marker cannot
    be read is left alone (with a WARNING), never stopping the pass."""
    states = []
    on_remote = RemoteTier(remote)
    for name in on_remote.steps():
        try:
            marker = on_remote.marker(name)
        except ManifestError as e:  # never deleted: we cannot vouch for what it is
            logger.warning("retention leaves remote step %s alone: %s", name, e)
            continue
        if marker is not None and on_remote.owner(marker, name, run_id) == Owner.OURS:
            states.append(StepState(name, int(marker["committed_at_ns"])))
    doomed = evictions(states, policy)
    for name in doomed:
        on_remote.delete(name, reason="retention of the remote tier", run_id=run_id)
    return doomed
