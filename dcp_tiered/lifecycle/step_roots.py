"""A run whose steps each have a root of their own (HF Trainer under DeepSpeed: the step
``global_stepN`` inside ``OUTPUT_DIR/checkpoint-N``): the run those roots join, and retention
over the roots, with the same rules as a root's own steps (never another run's, never one not
yet durable on the remote tier)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from ..agreement import Agreement
from ..backends.local import LocalBackend
from ..backends.remote import remote_backend
from ..config import RemoteConfig
from ..policy import identity
from ..policy.identity import Owner
from ..policy.retention import RetentionPolicy, StepState, evictions
from ..policy.step_names import StepNames
from ..tiers import ownership
from ..tiers.housekeeping import awaiting_remote
from ..tiers.local import LocalTier

logger = logging.getLogger(__name__)


def join_run(
    agree: Agreement,
    tier: LocalTier,
    remote: str | RemoteConfig | None,
    storage_options: Mapping[str, Any] | None,
) -> str:
    """Collective: the run of the directory ``tier`` (which each step root joins, so retention
    can tell the run's steps from others'). The directory records it; the first save decides
    it: ``$DCP_TIERED_RUN_ID``, else the one the remote prefix records (a fresh node), else a
    new one."""

    def decide() -> str:
        found = tier.record()
        if found is not None:
            return found.run_id
        run = os.environ.get("DCP_TIERED_RUN_ID") or None
        backend = remote_backend(remote, storage_options)
        if run is None and backend is not None:
            try:
                prefix = ownership.soon(backend, ownership.read_remote)
                run = prefix.run_id if prefix is not None else None
            except ownership.Unknown as e:
                logger.warning("cannot read the run record of %s now: %s", backend.config.url, e)
        return run or identity.new_run_id()

    run: str = agree.from_rank0(decide)
    agree.by_node_leaders(
        lambda: ownership.record_local(tier.backend, run), f"recording run {run} in {tier.root}"
    )
    return run


def prune_step_roots(
    run_dir: str,
    root_names: StepNames,
    policy: RetentionPolicy,
    remote: str | RemoteConfig | None,
    storage_options: Mapping[str, Any] | None,
    *,
    label: str,
    reason: str,
) -> list[str]:
    """Applies ``policy`` to the directories of ``run_dir`` named exactly as ``root_names``
    builds them (any other directory is not a step root); the names deleted. A root of another run, holding a step
    not the run's, or whose step is not durable on the remote tier (or it cannot tell) is never
    deleted. ``label`` names the rule in what is logged, ``reason`` each delete."""
    backend = LocalBackend(run_dir)
    states = [
        StepState(n, number)
        for n in backend.list_names()
        if (number := root_names.parse(n)) is not None
        and backend.is_dir(n)
        and not backend.is_link(n)
    ]
    remote_store = remote_backend(remote, storage_options)
    # The run: the one run_dir records (see join_run).
    record = LocalTier(backend).record()
    deleted = []
    for name in evictions(states, policy):
        tier = LocalTier(LocalBackend(os.path.join(run_dir, name)))
        found = tier.steps()
        mine = tier.record()
        if record is None or mine is None or mine.run_id != record.run_id:
            logger.warning("%s leaves %s alone: it is not this run's", label, name)
            continue
        if any(s.owner(mine) != Owner.OURS for s in found):
            logger.warning("%s leaves %s alone: it holds a step not the run's", label, name)
            continue
        steps = [s.name for s in found]
        if remote_store is not None and any(awaiting_remote(tier, remote_store, s) for s in steps):
            continue
        backend.remove_tree(name, reason=reason)
        deleted.append(name)
    return deleted
