"""The remote tier: what a committed remote step is, and the acts on one (read, quarantine,
release, delete), each on proof.

A step is committed on the remote once its marker ``STEP/_COMMITTED.json`` names a save whose
objects live under ``STEP/<save id>/`` (how a save gets there, and the proof a marker needs, is
:mod:`dcp_tiered.tiers.promotion`'s). Readers trust only steps with a marker. The root's
``latest`` pointer is moved before the marker is written, so no step is ever committed while
the pointer names an older one: a pointer whose step has no marker of the save it names is
stale, and readers then list the root instead.

Acts that un-commit or delete (quarantine, delete) act only on a marker that names this run
(or a save the run adopted), and delete only keys of our exact name grammar; anything else
under the prefix is left alone. Quarantine is :mod:`dcp_tiered.tiers.remote_quarantine`'s and
the orphan sweep :mod:`dcp_tiered.tiers.orphans`', both parts of :class:`RemoteTier`.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections.abc import Iterable
from typing import Any

from ..backends.remote import RemoteBackend
from ..errors import (
    CheckpointNotFoundError,
    ForeignPathError,
    IntegrityError,
    ManifestError,
    TierError,
    UploadFailedError,
)
from ..policy import layout, manifest, records, step_names
from ..policy.identity import Owner
from ..policy.manifest import Manifest
from ..policy.prefixes import PrefixStrategy
from . import ownership
from .local import LocalTier
from .orphans import OrphanSweep
from .remote_quarantine import RemoteQuarantine

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 16 * 2**20
_MAX_CHUNK_BYTES = 64 * 2**20  # memory a read-back or a download holds at once


def chunk_bytes(remote: RemoteBackend) -> int:
    """Ranged GETs as large as the upload's parts (fewer requests), within a memory bound."""
    return min(max(_CHUNK_BYTES, remote.config.part_size_bytes), _MAX_CHUNK_BYTES)


class Durability(str, enum.Enum):
    STAGED = "staged"  # being written on the local tier
    COMMITTED_LOCAL = "committed-local"
    DURABLE_REMOTE = "durable-remote"
    MEMORY = "memory"  # in a node's memory tier only (``dcp-tiered status``)
    PEER_COPIES = "copies"  # only partners' copies of some ranks' snapshots (peer replication)


class RemoteTier(RemoteQuarantine, OrphanSweep):
    """The committed steps under one remote root (one :class:`RemoteBackend`), and the acts on
    them. Holds no state besides the backend: build one wherever a backend is at hand."""

    def __init__(self, backend: RemoteBackend) -> None:
        self.backend = backend

    def __repr__(self) -> str:
        return f"RemoteTier({self.backend.config.url!r})"

    @property
    def strategy(self) -> PrefixStrategy:
        """How the saves this tier writes spread their data keys (from the config)."""
        return self.backend.config.strategy

    def keys(self, step: str, save_id: str) -> layout.RemoteKeys:
        """The keys of a save of ``step`` this tier writes."""
        return layout.RemoteKeys(step, save_id, self.strategy)

    def _marker_url(self, step: str) -> str:
        return self.backend.url(f"{step}/{layout.REMOTE_MARKER}")

    # ------------------------------------------------------------ what is committed

    def steps(self) -> list[str]:
        """Steps whose commit marker exists, as the store holds them now (one listing)."""
        found = self.backend.glob(f"*/{layout.REMOTE_MARKER}")
        if not found:
            self.backend.require_bucket()  # s3fs lists a missing bucket as empty
        return sorted(s for k in found if layout.is_step_name(s := k.split("/")[0]))

    def marker(self, step: str) -> dict[str, Any] | None:
        """The commit marker of ``step``, checked field by field (:func:`records.marker`); None
        if there is none. ManifestError if it is not a marker dcp_tiered wrote (truncated,
        replaced, nested deep, naming a save id that is not one of ours): the step is then
        unreadable, and callers that look at many steps skip it with a warning."""
        key = f"{step}/{layout.REMOTE_MARKER}"
        try:
            data = self.backend.get_bytes(key)
        except FileNotFoundError:
            return None
        return records.marker(data, step=step, where=self.backend.url(key))

    def durable(self, step: str, save_id: str) -> bool:
        """Whether save ``save_id`` is the one committed as ``step``."""
        marker = self.marker(step)
        return marker is not None and marker.get("save_id") == save_id

    def keys_of(self, step: str) -> layout.RemoteKeys | None:
        """The keys of the save committed as ``step`` on the remote, or None if none is."""
        marker = self.marker(step)
        if marker is None:
            return None
        try:
            return layout.keys_of_marker(step, marker)
        except ValueError as e:
            raise IntegrityError(
                f"{self._marker_url(step)}: {e}; this is not a marker dcp_tiered wrote. "
                "Restore another step."
            ) from e

    def holds_whole(self, m: Manifest) -> bool:
        """Whether the store holds save ``m`` whole as far as ``m`` knows its files: its marker
        names that save, and one listing per prefix shows every file ``m`` lists with its size.
        What deletes the last local copy of a step asks this first."""
        marker = self.marker(m.step)
        if marker is None or marker.get("save_id") != m.save_id:
            return False
        keys = layout.keys_of_marker(m.step, marker)
        wanted = {keys.file(name): int(info["size"]) for name, info in m.files.items()}
        listed: dict[str, tuple[int, str | None]] = {}
        for prefix in sorted({key.rpartition("/")[0] + "/" for key in wanted}):
            listed.update(self.backend.listing(prefix))
        return all(key in listed and listed[key][0] == size for key, size in wanted.items())

    def owner(self, marker: dict[str, Any], step: str, run_id: str | None) -> Owner:
        """Whose the save a marker (or a quarantine record) commits is, for run ``run_id``: this
        run's when it names the run, or the prefix's record says the run adopted it."""
        written_by = layout.run_of(marker)
        save_id = str(marker.get("save_id"))
        if run_id is not None and written_by == run_id:
            return Owner.OURS
        record = ownership.read_remote(self.backend)
        if record is not None and record.run_id == run_id:
            return record.owner(written_by, step, save_id)
        return Owner.UNOWNED if written_by is None else Owner.FOREIGN

    def _require_ours(
        self, marker: dict[str, Any], step: str, run_id: str | None, doing: str
    ) -> None:
        whose = self.owner(marker, step, run_id)
        if whose == Owner.OURS:
            return
        written = (
            "saved before run identities"
            if whose == Owner.UNOWNED
            else f"run {layout.run_of(marker)!r}'s"
        )
        raise ForeignPathError(
            f"{self._marker_url(step)} commits a save {written}, not run "
            f"{run_id!r}'s: it was not {doing}. If it is yours, make it this run's with "
            f"`dcp-tiered adopt ROOT {step} --remote {self.backend.config.url}`"
        )

    # ------------------------------------------------------------ manifests

    def read_manifest(
        self, keys: layout.RemoteKeys, nodes: Iterable[int] | None = None
    ) -> Manifest:
        """A committed save's manifest, with the sections of ``nodes`` (default: all) merged in."""
        return self.read_manifest_files(keys, nodes)[0]

    def merge_sections(
        self, keys: layout.RemoteKeys, m: Manifest, nodes: Iterable[int]
    ) -> Manifest:
        for node in m.missing(nodes):
            key = keys.section(node)
            m = manifest.parse_section(
                m, node, self.backend.get_bytes(key), where=self.backend.url(key)
            )
        return m

    def read_manifest_files(
        self, keys: layout.RemoteKeys, nodes: Iterable[int] | None = None
    ) -> tuple[Manifest, dict[str, bytes]]:
        """The manifest (as :meth:`read_manifest`) and the bytes of its files, by file name.
        CheckpointNotFoundError when the save's manifest is not on the store (its marker names a
        save whose objects are gone)."""
        remote = self.backend
        try:
            index = remote.get_bytes(keys.manifest)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(
                f"{remote.url(keys.manifest)} is not there: the commit marker of step "
                f"{keys.step!r} names a save ({keys.save_id}) whose objects are gone from the "
                "store. That step cannot be restored from it; restore another step."
            ) from e
        m = manifest.parse(index, where=remote.url(keys.manifest))
        files = {}
        for node in m.sections if nodes is None else nodes:
            key = keys.section(node)
            files[layout.manifest_section_name(node)] = data = remote.get_bytes(key)
            m = manifest.parse_section(m, node, data, where=remote.url(key))
        files[layout.MANIFEST_NAME] = index  # last, as a save writes it
        return m, files

    # ------------------------------------------------------------ the commit

    def read_latest(self) -> tuple[dict[str, Any] | None, str | None] | None:
        """The root's ``latest`` pointer and its version tag (for compare-and-set), None if
        there is none; the pointer is None if it is unreadable (readers then list the root)."""
        got = self.backend.get_tagged(layout.REMOTE_LATEST)
        if got is None:
            return None
        try:
            body = records.latest_pointer(got[0], where=self.backend.url(layout.REMOTE_LATEST))
        except ManifestError as e:
            logger.warning("ignoring the latest pointer: %s", e)
            return None, got[1]
        return body, got[1]

    def advance_latest(self, step: str, marker: dict[str, Any]) -> None:
        """Move the ``latest`` pointer to ``step`` unless it names a newer step (in
        `step_names.newest`'s order) that is committed, or about to be. Compare-and-set: two saves
        racing re-read and retry, so the pointer only ever moves forward. A pointer naming a
        step whose marker is another save's, or missing while no save of it is running, is
        replaced."""
        remote = self.backend
        body = json.dumps(layout.latest_body(step, marker)).encode()
        for _ in range(16):
            current = self.read_latest()
            if current is not None and current[0] is not None:
                cur = current[0]
                there = (str(cur["step"]), int(cur["marker"]["committed_at_ns"]))
                if not step_names.is_newer(step, int(marker["committed_at_ns"]), there):
                    try:
                        found = self.marker(there[0])
                    except ManifestError as e:  # not a commit of that step: the pointer is stale
                        logger.warning("%s", e)
                        found = None
                    if found is not None and found.get("save_id") == cur["marker"].get("save_id"):
                        return  # a newer step is committed: it stays latest
                    if time.time_ns() - there[1] < remote.config.durable_timeout_secs * 1e9:
                        return  # a newer save still committing: its marker comes soon
            if remote.put_if(layout.REMOTE_LATEST, body, None if current is None else current[1]):
                return
        raise UploadFailedError(
            f"{remote.url(layout.REMOTE_LATEST)} kept changing under 16 attempts to move it to "
            f"{step!r}: many saves commit into this prefix at once; the step is retried"
        )

    def commit(self, keys: layout.RemoteKeys, marker: dict[str, Any]) -> None:
        """The last act of a promotion, once the store holds the whole save ``keys``: move
        ``latest`` forward, then create the step's marker exclusively. A save that loses the
        marker to another save of the step is an orphan nobody else removes: its objects are
        removed here, and UploadFailedError says so (the other copy is never touched)."""
        step, save_id = keys.step, keys.save_id
        self.advance_latest(step, marker)
        if self.backend.create_exclusive(
            f"{step}/{layout.REMOTE_MARKER}", json.dumps(marker).encode()
        ):
            return
        existing = self.marker(step) or {}
        if existing.get("save_id") == save_id:
            return
        self.remove_save(
            keys,
            reason=f"save {save_id} of step {step} lost its commit to save "
            f"{existing.get('save_id')}",
        )
        raise UploadFailedError(
            f"step {step!r} was committed on {self.backend.config.url} by another "
            f"save ({existing.get('save_id')}) while this one ({save_id}) uploaded: two "
            "jobs save into this prefix. The other copy was left untouched and this "
            "one's objects were removed; give each job its own remote prefix."
        )

    # ------------------------------------------------------------ delete

    def delete(self, step: str, *, reason: str, run_id: str | None) -> None:
        """Remove a committed remote step: its marker first, so readers stop trusting it before
        any of its objects go; then its save's objects (quarantined saves of the name stay).
        ForeignPathError if it is not run ``run_id``'s: never deleted."""
        marker = self.marker(step)
        if marker is None:
            return
        self._require_ours(marker, step, run_id, "deleted")
        keys = self.keys_of(step)
        self.backend.remove(f"{step}/{layout.REMOTE_MARKER}", reason=reason)
        if keys is not None:
            self.remove_save(keys, reason=reason)
        self.backend.remove_empty_dirs(f"{step}/")

    def remove_save(self, keys: layout.RemoteKeys, *, reason: str) -> None:
        """Delete every object of one save by our name grammar, its claims last (never a marker,
        another save's objects, or anything else someone put under its prefixes)."""
        found: list[str] = []
        for prefix in keys.listed_prefixes(also_hashed=self.strategy.hashed):
            found += [key for key in self.backend.sizes(prefix) if keys.owns(key)]
        for key in sorted(found, key=lambda k: (k.startswith(keys.claims_prefix), k)):
            self.backend.remove(key, reason=reason)


def durability(tier: LocalTier, remote: RemoteBackend | None, step: str) -> Durability:
    """Where ``step`` stands across the local tier and the remote (None: no remote tier)."""
    local = {s.name for s in tier.steps()}
    on_remote = None if remote is None else RemoteTier(remote)
    try:
        if step in local:
            if on_remote is not None:
                m = tier.read_manifest(step)
                if on_remote.durable(m.step, m.save_id):
                    return Durability.DURABLE_REMOTE
            return Durability.COMMITTED_LOCAL
        if on_remote is not None and on_remote.marker(step) is not None:
            return Durability.DURABLE_REMOTE
    except TierError as e:  # an unreachable remote holds nothing we can count on
        logger.warning("cannot query %s: %s", remote, e)
        if step in local:
            return Durability.COMMITTED_LOCAL
    if step in layout.unfinished_steps(tier.backend.list_names()):
        return Durability.STAGED
    raise CheckpointNotFoundError(f"step {step!r} is neither in {tier.root} nor remote")
