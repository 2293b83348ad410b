"""The orphan sweep: removing what killed or lost uploads of this run left on the remote.

An orphan is a save of a step that no marker or quarantine record names. It is removed only on
proof that it is this run's: a claim ``STEP/<sid>/_claims/node-K.json`` naming the run (written
before the save's first object), and then only the keys of our exact name grammar under its
prefixes, its claims last, each delete logged. Anything else under the prefix (another run's
saves, saves from before claims existed, files other tools put there) is foreign and left alone,
whatever its name looks like.

:class:`OrphanSweep` is a part of :class:`~dcp_tiered.tiers.remote.RemoteTier` (which inherits
it), kept here so that the tier's module stays about one thing: committed steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from ..backends.remote import RemoteBackend
from ..errors import ManifestError, TierError
from ..policy import layout, records
from ..policy.prefixes import PrefixStrategy

logger = logging.getLogger(__name__)


class OrphanSweep:
    """The orphan sweep of one remote root (a role of RemoteTier)."""

    backend: RemoteBackend

    # RemoteTier's, which the sweep asks what is committed or quarantined.
    def marker(self, step: str) -> dict[str, Any] | None:
        raise NotImplementedError

    def quarantined_saves(self, step: str) -> set[str]:
        raise NotImplementedError

    def sweep_orphans(self, pending: Iterable[tuple[str, str]], run_id: str) -> None:
        """Remove run ``run_id``'s orphans whose newest object is older than
        ``orphan_grace_secs`` and that are not ``pending``: the ``(step, save id)`` committed on
        the coordinator's local tier, whose promotion would still commit them. A step whose
        marker cannot be read is skipped (with a WARNING): one bad object never stops the
        sweep, nor the job's start."""
        pending = set(pending)
        remote = self.backend
        cutoff = time.time() - remote.config.orphan_grace_secs
        for step in sorted(n for n in remote.children() if layout.is_step_name(n)):
            keep = {sid for name, sid in pending if name == step}
            try:
                self.remove_orphan_saves(step, run_id, keep=keep, older_than=cutoff)
            except (ManifestError, ValueError) as e:
                logger.warning("not sweeping %s on %s: %s", step, remote.config.url, e)

    def remove_orphan_saves(
        self, step: str, run_id: str, *, keep: set[str], older_than: float | None = None
    ) -> None:
        """Delete run ``run_id``'s saves of ``step`` that no marker or quarantine record names,
        except those in ``keep``; with ``older_than`` (epoch s), only saves whose newest object
        is older than that (younger ones may still be uploading). Layout-1 objects (directly
        under the step) and unclaimed saves are left alone."""
        remote = self.backend
        candidates = [
            sid for sid in remote.children(f"{step}/") if layout.is_save_id(sid) and sid not in keep
        ]
        if not candidates:
            return
        marker = self.marker(step)
        keep = (
            keep
            | self.quarantined_saves(step)
            | ({str(marker.get("save_id"))} if marker else set())
        )
        for sid in candidates:
            if sid in keep:
                continue
            keys = self.claimed_by(step, sid, run_id)
            if keys is None:
                continue
            objects: dict[str, float] = {}
            for prefix in keys.listed_prefixes():
                objects.update({k: t for k, t in remote.modified(prefix).items() if keys.owns(k)})
            if not objects or (older_than is not None and max(objects.values()) >= older_than):
                continue
            if keys.manifest in objects:
                # The coordinator uploads the manifest as the save's commit begins: no marker
                # then proves nothing (a marker lost since, or a crash before it was made),
                # and the save may be the only copy of the step.
                logger.warning(
                    "not sweeping save %s of %s on %s: no marker names it, but it holds its "
                    "manifest (its commit began), so it may be the step's only copy; remove "
                    "its objects by hand if it is not needed",
                    sid,
                    step,
                    remote.config.url,
                )
                continue
            reason = f"orphan of step {step}: save {sid} of run {run_id} was never committed"
            for key in sorted(objects, key=lambda k: (k.startswith(keys.claims_prefix), k)):
                remote.remove(key, reason=reason)

    def claimed_by(self, step: str, save_id: str, run_id: str) -> layout.RemoteKeys | None:
        """The keys of save ``save_id`` of ``step`` if a claim of run ``run_id`` names it (with
        the prefix strategy the claim records), else None: not this run's to remove."""
        remote = self.backend
        base = f"{step}/{save_id}/"
        for key in sorted(remote.sizes(f"{base}{layout.CLAIMS}/")):
            if not layout.is_save_object(key[len(base) :]):
                continue
            try:
                body = records.load_json(
                    remote.get_bytes(key), where=remote.url(key), max_bytes=records.MAX_RECORD_BYTES
                )
                if (
                    not isinstance(body, dict)
                    or body.get("format") != "dcp-tiered-claim"
                    or (body.get("step"), body.get("save_id")) != (step, save_id)
                ):
                    continue
                if body.get("run_id") != run_id:
                    return None
                return layout.RemoteKeys(step, save_id, PrefixStrategy.of_record(body))
            except (FileNotFoundError, ValueError, ManifestError, TierError) as e:
                logger.debug("claim %s unreadable: %s", remote.url(key), e)
        return None
