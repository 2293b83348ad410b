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
from ..policy.identity import Owner, RunRecord
from ..policy.retention import RetentionPolicy, StepState, decide, evictions, superseded
from .local import LocalTier
from .remote import RemoteTier

logger = logging.getLogger(__name__)


def _own_steps(tier: LocalTier, record: RunRecord | None) -> list[StepState]:
    """This run's own committed steps on ``tier``, whose record is ``record`` (none when the
    root records no run: nothing there is provably ours)."""
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
    remote_policy: RetentionPolicy | None = None,
) -> Pruned:
    """Apply ``policy`` to a local tier's own steps (with ``dry_run``: decide only, delete
    nothing). A step whose manifest asks for promotion is kept until the store holds its save
    whole (or while that cannot be told), unless ``remote_policy`` (the remote tier's
    retention) would drop it there anyway (:class:`RemoteRetention`)."""
    record = tier.record()
    own = _own_steps(tier, record)
    dropped = (
        RemoteRetention(remote, remote_policy, record.run_id)
        if remote is not None and remote_policy is not None and record is not None
        else None
    )
    when = {s.name: s for s in own}

    def awaiting(name: str) -> bool:
        if remote is None or not awaiting_remote(tier, remote, name):
            return False
        return dropped is None or not dropped.superseded(when[name])

    deleted, held = decide(own, policy, awaiting)
    if not dry_run:
        for name in deleted:
            tier.delete_step(name, reason=f"retention of the {label} tier")
    kept = sorted(
        (s.name for s in own if s.name not in deleted),
        key=lambda n: (step_names.order_number(n) or -1, n),
    )
    return Pruned(deleted, held, kept)


def prune_local(
    tier: LocalTier,
    policy: RetentionPolicy,
    remote: RemoteBackend | None,
    *,
    label: str,
    remote_policy: RetentionPolicy | None = None,
) -> list[str]:
    """Apply ``policy`` to a local tier's own steps; the names deleted (:func:`local_pass`)."""
    return local_pass(tier, policy, remote, label=label, remote_policy=remote_policy).deleted


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


def remote_states(remote: RemoteBackend, run_id: str | None) -> list[StepState]:
    """Run ``run_id``'s committed steps on the remote tier, by their markers; a step whose
    marker cannot be read is left out (with a WARNING)."""
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
    return states


def prune_remote(remote: RemoteBackend, policy: RetentionPolicy, run_id: str | None) -> list[str]:
    """Apply ``policy`` to run ``run_id``'s steps on the remote tier; a step whose marker cannot
    be read is left alone (with a WARNING), never stopping the pass."""
    doomed = evictions(remote_states(remote, run_id), policy)
    on_remote = RemoteTier(remote)
    for name in doomed:
        on_remote.delete(name, reason="retention of the remote tier", run_id=run_id)
    return doomed


class RemoteRetention:
    """The remote tier's retention as the local tier's uploads and retention see it: whether a
    committed local step is one the remote's policy would drop on arrival (it already pruned
    it, or newer durable steps of the run fill its place), asked of the store once per
    instance. Such a step is not uploaded again, and no longer held locally for the remote.
    Where the store cannot be asked, nothing is superseded."""

    def __init__(self, remote: RemoteBackend, policy: RetentionPolicy, run_id: str | None) -> None:
        self.remote, self.policy, self.run_id = remote, policy, run_id
        self._states: list[StepState] | None = None
        self._names: set[str] = set()

    def superseded(self, step: StepState) -> bool:
        states = self._listed()
        return bool(states) and superseded(step, states, self.policy)

    def pruned(self, step: StepState) -> bool:
        """Superseded, and not on the remote: there is nothing to upload it for."""
        return self.superseded(step) and step.name not in self._names

    def _listed(self) -> list[StepState]:
        if self._states is None:
            try:
                self._states = remote_states(self.remote, self.run_id)
            except (TierError, OSError) as e:
                logger.warning("cannot list the steps on %s: %s", self.remote.config.url, e)
                self._states = []
            self._names = {s.name for s in self._states}
        return self._states
