"""The local tier: committed steps under one root, their manifests, and crash recovery."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

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

logger = logging.getLogger(__name__)

# A temporary directory without a lock file may be one a rank has just created; only one older
# than this is treated as abandoned.
_UNLOCKED_GRACE_SECS = 300.0


@dataclass(frozen=True)
class StepInfo:
    name: str
    committed_at_ns: int
    verified_format: bool  # False: a vanilla DCP directory without our manifest
    run_id: str | None = None  # the run its manifest names (None: before run ids, or unread)
    save_id: str = ""
    as_saved: bool = False  # stored under the step name its manifest gives (not a copy)

    def owner(self, record: RunRecord | None) -> Owner:
        """Whose this step is for the run ``record`` (a root's): ours only when its manifest
        is readable, names this directory's step and the run (or the run adopted it)."""
        if not self.verified_format or not self.as_saved or self.committed_at_ns < 0:
            return Owner.FOREIGN
        if record is None:
            return Owner.UNOWNED if self.run_id is None else Owner.FOREIGN
        return record.owner(self.run_id, self.name, self.save_id)


# (manifest path, its file version) -> its head: see LocalTier.read_head. Bounded (a root
# holds a few steps; a process may look at many roots).
_HEADS: dict[tuple[str, FileVersion], manifest.ManifestHead] = {}
_MAX_HEADS = 4096
_SETTLED_NS = 2 * 10**9  # a file unchanged this long may be cached by its version


class LocalTier:
    def __init__(self, backend: LocalBackend) -> None:
        self.backend = backend

    @property
    def root(self) -> str:
        return str(self.backend.root)

    # ------------------------------------------------------------ listing

    def steps(self) -> list[StepInfo]:
        """Committed steps: final-named directories holding a manifest (or DCP .metadata)."""
        found = (self.info(name) for name in self.backend.list_names())
        return [s for s in found if s is not None]

    def info(self, step: str) -> StepInfo | None:
        """The committed step ``step`` as :meth:`steps` lists it; None if there is none. One
        step's manifest head is read, not every step's."""
        if not layout.is_step_name(step) or not self.backend.is_dir(step):
            return None
        if self.backend.is_link(step):  # never followed: it may lead out of the root
            logger.warning("ignoring %s/%s: a symbolic link, not a step of ours", self.root, step)
            return None
        try:
            if self.backend.exists(step, layout.MANIFEST_NAME):
                return self._describe(step)
            if self.backend.exists(step, layout.DCP_METADATA_NAME):
                mtime = self.backend.mtime(step, layout.DCP_METADATA_NAME)
                return StepInfo(step, int(mtime * 1e9), False)
        except FileNotFoundError:
            pass  # deleted while we looked
        return None

    def _describe(self, name: str) -> StepInfo:
        try:
            m = self.read_head(name)
        except FileNotFoundError:
            raise
        except (ManifestError, OSError) as e:
            logger.warning("step %s in %s has an unreadable manifest: %s", name, self.root, e)
            return StepInfo(name, -1, True)
        return StepInfo(name, m.committed_at_ns, True, m.run_id, m.save_id, m.step == name)

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
            f"{self.backend.path_of(step)} is {_whose(info, owner)}, not run {run_id!r}'s: it "
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

    # ------------------------------------------------------------ pending directories

    def claim_pending(self, step: str, sidecars: list[str], *, whole: bool = False) -> bool:
        """Mark directory ``step`` (created if missing) as made for a save of ``step`` that is
        not committed yet, holding at most ``sidecars``; with ``whole``, made empty for that
        save, so that everything in it is the save's (a framework writes its own files there).
        Refuses (False) a committed step, a file, or a directory that holds anything else: that
        is not ours to replace."""
        if self.has_step(step):
            return False
        if self.backend.exists(step) and not self.backend.is_dir(step):
            return False
        self.backend.make_dir(step)
        allowed = {layout.PENDING_MARKER} | (set() if whole else set(sidecars))
        if not set(self.backend.list_files(step)) <= allowed:
            return False
        body = json.dumps({"step": step, "sidecars": sorted(sidecars), "whole": whole}).encode()
        self.backend.write_file(step, layout.PENDING_MARKER, body)
        return True

    def settle_pending(self, step: str) -> None:
        """The save a ``whole`` pending directory was made for committed: it is no longer
        pending (its marker goes)."""
        if self.backend.exists(step, layout.PENDING_MARKER):
            self.backend.remove_file(step, layout.PENDING_MARKER)

    def is_pending(self, step: str) -> bool:
        return self.backend.exists(step, layout.PENDING_MARKER) and not self.has_step(step)

    def discard_pending(self, step: str, *, reason: str) -> None:
        """Remove what a pending directory's marker lists, the marker, then the directory if
        that emptied it: never a file the marker does not name."""
        try:
            sidecars, whole = records.pending_marker(
                self.backend.read_file(step, layout.PENDING_MARKER, limit=records.MAX_RECORD_BYTES),
                step=step,
                where=self.backend.path_of(step, layout.PENDING_MARKER),
            )
        except (OSError, ManifestError) as e:
            logger.warning(
                "leaving %s/%s alone: unreadable pending marker (%s)", self.root, step, e
            )
            return
        if whole:  # made empty for the save: all of it is the save's
            self.backend.remove_tree(step, reason=reason)
            return
        for name in [*sidecars, layout.PENDING_MARKER]:
            if self.backend.exists(step, name):
                logger.info("deleting %s (%s)", self.backend.path_of(step, name), reason)
                self.backend.remove_file(step, name)
        self.backend.remove_empty_dir(step)

    def sweep_pending(self) -> None:
        """Discard the pending directories a crashed save left (call when no save runs)."""
        for name in self.backend.list_names():
            if (
                layout.is_step_name(name)
                and self.backend.is_dir(name)
                and not self.backend.is_link(name)
                and self.is_pending(name)
            ):
                self.discard_pending(name, reason=f"left by a save of {name} that never committed")

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
            self.backend.remove_tree(doomed, reason=f"{step}: {reason}")
        finally:
            self.backend.unlock(lock)

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

    # ------------------------------------------------------------ recovery

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

    def recover_and_sweep(self) -> None:
        """Undo interrupted overwrites and delete temporary directories of crashed saves.

        A temporary directory is in use while any rank writing it, or the node leader until
        it publishes, holds its lock; the kernel releases the lock of a process that dies.
        """
        for name in self.backend.list_names():
            parsed = layout.parse_hidden_dir(name)
            if parsed is None:
                continue
            if self.backend.is_link(name):  # not made by us: never followed, never deleted
                logger.warning(
                    "leaving %s/%s alone: a symbolic link named like our temporary entries, "
                    "which are never links; remove it if it is not needed",
                    self.root,
                    name,
                )
                continue
            try:
                self._recover_entry(name, *parsed)
            except FileNotFoundError:
                pass  # another rank or a retention pass removed it meanwhile

    def undo_interrupted_overwrites(self) -> None:
        """Give back its name to a step whose non-atomic overwrite a crash interrupted (only
        the old, committed version exists, under a hidden name). Readers call this before
        listing: otherwise that step, perhaps the newest, would not be found until a writer
        recovers the root. Deletes nothing."""
        for name in self.backend.list_names():
            parsed = layout.parse_hidden_dir(name)
            if (
                parsed is not None
                and parsed[2] == layout.OLD_SUFFIX
                and self.backend.is_dir(name)
                and not self.backend.is_link(name)
            ):
                self._undo_overwrite(name, parsed[0])

    def _undo_overwrite(self, name: str, step: str) -> bool:
        if self.backend.exists(step):
            return False
        # Crash between the two renames of a non-atomic overwrite: the old step is the last
        # committed version, so it goes back under its name.
        logger.warning("restoring %s/%s from interrupted overwrite", self.root, step)
        self.backend.rename(name, step)
        return True

    def _recover_entry(self, name: str, step: str, save_id: str, suffix: str) -> None:
        if not self.backend.is_dir(name) or suffix == layout.QUARANTINE_SUFFIX:
            return  # a quarantined step is an operator's to inspect and delete
        if suffix == layout.DELETE_SUFFIX:
            if self._abandoned(name):
                self.backend.remove_tree(name, reason="finishing an interrupted delete")
        elif suffix == layout.UPLOAD_SUFFIX:
            if not self._upload_area_wanted(step, save_id):
                self.backend.remove_tree(name, reason="upload records of an abandoned save")
        elif suffix == layout.OLD_SUFFIX:
            if not self._undo_overwrite(name, step):
                self.backend.remove_tree(name, reason="replaced by a newer commit")
        elif self._abandoned(name):
            self.backend.remove_tree(name, reason="temporary directory of a crashed save")

    def _upload_area_wanted(self, step: str, save_id: str) -> bool:
        """Early-upload records matter while their save is in flight or awaits promotion."""
        if self.backend.exists(layout.tmp_dir_name(step, save_id)):
            return True
        try:
            return self.has_step(step) and self.read_head(step).save_id == save_id
        except (ManifestError, OSError):
            return False

    def _abandoned(self, name: str) -> bool:
        if self.backend.exists(name, layout.LOCK_NAME):
            return not self.backend.is_locked(name)
        return time.time() - self.backend.mtime(name) > _UNLOCKED_GRACE_SECS


def _whose(info: StepInfo, owner: Owner) -> str:
    if not info.verified_format or info.committed_at_ns < 0:
        return "not a step of ours (no readable dcp_tiered manifest)"
    if not info.as_saved:
        return "a copy of another step (its manifest names another step)"
    if owner == Owner.UNOWNED:
        return "saved before run identities (no run id)"
    return f"run {info.run_id!r}'s"
