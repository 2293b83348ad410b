"""The local tier: committed steps under one root, their manifests, deletes and quarantine.
Its pending directories are :mod:`dcp_tiered.tiers.local_pending`'s, its crash recovery
:mod:`dcp_tiered.tiers.local_recovery`'s."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterable

from ..backends.local import FileVersion, LocalBackend
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ForeignPathError,
    ManifestError,
)
from ..policy import layout, manifest, records
from ..policy.identity import Owner, RunRecord
from . import ownership
from .local_pending import PendingDirectories
from .local_recovery import CrashRecovery
from .step_record import CommittedStep

logger = logging.getLogger(__name__)

# (manifest path, its file version) -> its head: see LocalTier.read_head. Bounded (a root
# holds a few steps; a process may look at many roots).
_HEADS: dict[tuple[str, FileVersion], manifest.ManifestHead] = {}
_MAX_HEADS = 4096
_SETTLED_NS = 2 * 10**9  # a file unchanged this long may be cached by its version


class LocalTier(PendingDirectories, CrashRecovery):
    def __init__(self, backend: LocalBackend) -> None:
        self.backend = backend

    @property
    def root(self) -> str:
        return str(self.backend.root)

    # ------------------------------------------------------------ listing

    def steps(self) -> list[CommittedStep]:
        """Committed steps: final-named directories holding a manifest (or DCP .metadata)."""
        found = (self.info(name) for name in self.backend.list_names())
        return [s for s in found if s is not None]

    def info(self, step: str) -> CommittedStep | None:
        """The committed step ``step`` as :meth:`steps` lists it; None if there is none. One
        step's manifest head is read, not every step's."""
        if not layout.is_step_name(step):
            return None
        if self.backend.is_link(step):  # never followed: it may lead out of the root
            logger.warning("ignoring %s/%s: a symbolic link, not a step of ours", self.root, step)
            return None
        try:
            if not self.backend.is_dir(step):
                return None
        except OSError as e:  # an entry this process may not even look at: not a step of ours
            logger.warning("ignoring %s/%s: %s", self.root, step, e)
            return None
        try:
            if self.backend.exists(step, layout.MANIFEST_NAME):
                return self._describe(step)
            if self.backend.exists(step, layout.DCP_METADATA_NAME):
                mtime = self.backend.mtime(step, layout.DCP_METADATA_NAME)
                return CommittedStep(step, int(mtime * 1e9), verified_format=False, as_saved=False)
        except FileNotFoundError:
            pass  # deleted while we looked
        return None

    def _describe(self, name: str) -> CommittedStep:
        try:
            m = self.read_head(name)
        except FileNotFoundError:
            raise
        except (ManifestError, OSError) as e:
            logger.warning("step %s in %s has an unreadable manifest: %s", name, self.root, e)
            return CommittedStep(name, -1, as_saved=False)
        return CommittedStep(
            name, m.committed_at_ns, run_id=m.run_id, save_id=m.save_id, as_saved=m.step == name
        )

    def record(self) -> RunRecord | None:
        """The run this root records (see :mod:`dcp_tiered.policy.identity`)."""
        return ownership.read_local(self.backend)

    def require_ours(self, step: str, run_id: str | None) -> None:
        """ForeignPathError unless committed ``step`` is run ``run_id``'s: a step of another
        run, one saved before run ids and not adopted, or a copy of a step under another name
        is never replaced, quarantined or deleted."""
        record = self.record()
        info = self.info(step)
        if info is None:
            raise CheckpointNotFoundError(f"step {step!r} is not committed in {self.root}")
        owner = info.owner(record)
        if owner == Owner.OURS and record is not None and record.run_id == run_id:
            return
        raise ForeignPathError(
            f"{self.backend.path_of(step)} is {info.whose(owner)}, not run {run_id!r}'s: it "
            "was left untouched. Save under another step name, or, if it is yours, make it this "
            f"run's with `dcp-tiered adopt {self.root} {step}`"
        )

    def has_step(self, name: str) -> bool:
        return (
            self.backend.is_dir(name)
            and not self.backend.is_link(name)
            and (
                self.backend.exists(name, layout.MANIFEST_NAME)
                or self.backend.exists(name, layout.DCP_METADATA_NAME)
            )
        )

    def read_manifest(self, step: str, nodes: Iterable[int] | None = None) -> manifest.Manifest:
        """The step's manifest with the sections of ``nodes`` merged in (default: every
        section this directory holds: its own node's, or all on the coordinator's node)."""
        m = manifest.parse(self._read_meta(step, layout.MANIFEST_NAME), where=self._where(step))
        if nodes is None:
            here = set(self.backend.list_files(step))
            nodes = [n for n, ref in m.sections.items() if ref.name in here]
        return self.merge_sections(step, m, nodes)

    def merge_sections(
        self, step: str, m: manifest.Manifest, nodes: Iterable[int]
    ) -> manifest.Manifest:
        for node in m.missing(nodes):
            name = layout.manifest_section_name(node)
            where = self._where(step, name)
            m = manifest.parse_section(m, node, self._read_meta(step, name), where=where)
        return m

    def read_head(self, step: str) -> manifest.ManifestHead:
        """Whose save of which step ``step`` holds, and when it was committed: its manifest's
        head, without decoding the index (see :func:`manifest.parse_head`). A manifest is
        written once and renamed into place, so its head is kept per file version: listing
        a root again (each save's housekeeping) costs a stat per step, not a parse."""
        where = self._where(step)
        version = self.backend.version(step, layout.MANIFEST_NAME)
        if version is not None and (found := _HEADS.get((where, version))) is not None:
            return found
        data, version = self._read_meta_version(step, layout.MANIFEST_NAME)
        head = manifest.parse_head(data, where=where)
        # Only a file left alone for a while: file times tick in jiffies, so a file rewritten
        # in place twice within one could keep its version (git's "racy" index entries)
        if version is not None and time.time_ns() - version.ctime_ns > _SETTLED_NS:
            if len(_HEADS) >= _MAX_HEADS:
                _HEADS.clear()
            _HEADS[(where, version)] = head
        return head

    def _where(self, step: str, name: str = layout.MANIFEST_NAME) -> str:
        return os.path.join(self.root, step, name)

    def _read_meta(self, step: str, name: str) -> bytes:
        return self._read_meta_version(step, name)[0]

    def _read_meta_version(self, step: str, name: str) -> tuple[bytes, FileVersion | None]:
        try:
            return self.backend.read_file_version(step, name, limit=records.MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise
        except OSError as e:  # a link, FIFO or device where the manifest should be
            raise ManifestError(
                f"{self._where(step, name)}: cannot be read as a manifest ({e.strerror}); "
                "restore the step from another tier or load an earlier step"
            ) from e

    def delete_step(self, step: str, *, reason: str) -> None:
        """Delete a committed step. It is renamed out of sight first, so a crash halfway
        never leaves a directory that looks committed but misses files."""
        step = layout.validate_step_name(step)
        doomed = layout.delete_dir_name(step, uuid.uuid4().hex[:12])
        lock = self.backend.lock_shared(step)  # a sweep leaves a locked directory alone
        try:
            self.backend.rename(step, doomed)
            self.finish_delete(doomed, step, reason=f"{step}: {reason}")
        finally:
            self.backend.unlock(lock)

    def finish_delete(self, doomed: str, step: str, *, reason: str) -> None:
        """Delete ``doomed``, committed ``step`` renamed out of sight, as far as it is ours;
        what is not the step's (a user's file put in it) goes back under the step's name, where
        it was put, unless a new save of the step took that name."""
        if not self.backend.remove_step_dir(doomed, reason=reason):
            return
        try:  # never over whatever holds the name now: the rename itself decides
            self.backend.publish(doomed, step, "", replace=False)
        except FileExistsError:
            return  # left under the hidden name, which the remove_step_dir warning named
        logger.warning(
            "%s now holds only what was not the step's; it is no longer a step",
            self.backend.path_of(step),
        )

    def holds_ours(self, directory: str, step: str, run_id: str | None) -> bool:
        """Whether ``directory`` (a step, or one moved aside under a hidden name) is a save of
        ``step`` that is run ``run_id``'s."""
        record = self.record()
        try:
            m = self.read_head(directory)
        except (ManifestError, OSError):
            return False
        return (
            m.step == step
            and record is not None
            and record.run_id == run_id
            and record.owner(m.run_id, step, m.save_id) == Owner.OURS
        )

    def quarantine(self, step: str, *, reason: str, run_id: str | None) -> str | None:
        """Move committed ``step`` aside under a hidden name of ours (never deleted, swept,
        listed or loaded), so the step can be saved again; None if there is no such step.
        ForeignPathError if it is not run ``run_id``'s (see :meth:`require_ours`)."""
        if not self.has_step(step) or self.backend.is_link(step):
            return None
        self.require_ours(step, run_id)
        save_id = self.read_head(step).save_id
        name = layout.quarantine_dir_name(step, save_id)
        self.backend.rename(step, name)
        logger.warning(
            "quarantined %s/%s as %s: %s. It is kept for inspection; delete it "
            "when it is no longer needed.",
            self.root,
            step,
            name,
            reason,
        )
        return name

    # ------------------------------------------------------------ quarantine

    def quarantined(self) -> list[tuple[str, str]]:
        """``(step, save id)`` of every step quarantined here."""
        out = []
        for name in self.backend.list_names():
            parsed = layout.parse_hidden_dir(name)
            if parsed and parsed[2] == layout.QUARANTINE_SUFFIX and self.backend.is_dir(name):
                out.append((parsed[0], parsed[1]))
        return sorted(out)

    def release_quarantined(self, step: str, save_id: str, *, run_id: str | None) -> None:
        """Undo :meth:`quarantine`: give quarantined save ``save_id`` of ``step`` its name back.
        Refused (CheckpointExistsError) while a step of that name exists, and (ForeignPathError)
        unless it is run ``run_id``'s; logged."""
        name = layout.quarantine_dir_name(step, save_id)
        if not self.backend.is_dir(name) or self.backend.is_link(name):
            raise CheckpointNotFoundError(f"no quarantined save {save_id} of {step} in {self.root}")
        m = self.read_head(name)
        record = self.record()
        if (
            m.step != step
            or record is None
            or record.run_id != run_id
            or record.owner(m.run_id, step, m.save_id) != Owner.OURS
        ):
            raise ForeignPathError(
                f"{self.backend.path_of(name)} is not run {run_id!r}'s; it was left as it is"
            )
        try:
            self.backend.publish(name, step, "", replace=False)
        except FileExistsError:
            raise CheckpointExistsError(
                f"{self.backend.path_of(step)} exists (saved again since the quarantine): "
                f"quarantined save {save_id} was left aside. Remove or quarantine the current "
                "step first"
            ) from None
        logger.warning("released %s/%s from quarantine (save %s)", self.root, step, save_id)
