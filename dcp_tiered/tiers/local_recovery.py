"""Crash recovery of the local tier: what an interrupted save, overwrite or delete left."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..backends.local import LocalBackend
from ..errors import ManifestError
from ..policy import layout, manifest

logger = logging.getLogger(__name__)

# A temporary directory without a lock file may be one a rank has just created; only one older
# than this is treated as abandoned.
_UNLOCKED_GRACE_SECS = 300.0


class CrashRecovery:
    """Part of :class:`~dcp_tiered.tiers.local.LocalTier`: undoing and sweeping what crashed
    saves, overwrites and deletes left under the root."""

    backend: LocalBackend

    if TYPE_CHECKING:

        def has_step(self, name: str) -> bool: ...

        def read_head(self, step: str) -> manifest.ManifestHead: ...

        def finish_delete(self, doomed: str, step: str, *, reason: str) -> None: ...

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
                    self.backend.root,
                    name,
                )
                continue
            try:
                self._recover_entry(name, *parsed)
            except FileNotFoundError:
                pass  # another rank or a retention pass removed it meanwhile
            except OSError as e:  # housekeeping: a leftover kept for now fails no save
                logger.warning(
                    "could not finish %s/%s now (%s); the next save's sweep tries again",
                    self.backend.root,
                    name,
                    e,
                )

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
                and self._replaced_step(name, parsed[0])
            ):
                self._undo_overwrite(name, parsed[0])

    def _undo_overwrite(self, name: str, step: str) -> bool:
        if self.backend.exists(step):
            return False
        # Crash between the two renames of a non-atomic overwrite: the old step is the last
        # committed version, so it goes back under its name.
        logger.warning("restoring %s/%s from interrupted overwrite", self.backend.root, step)
        self.backend.rename(name, step)
        return True

    def _replaced_step(self, name: str, step: str) -> bool:
        """Whether hidden ``name`` is what an overwrite of ``step`` set aside: a committed
        manifest of that step, or the directory made for the step before its commit (its
        marker). A directory merely named like one is not ours, and left alone."""
        if self.backend.exists(name, layout.PENDING_MARKER):
            return True
        try:
            return self.read_head(name).step == step
        except (ManifestError, OSError):
            return False

    def _run_of(self, name: str) -> str | None:
        try:
            return self.read_head(name).run_id
        except (ManifestError, OSError):
            return None

    def _recover_old(self, name: str, step: str) -> None:
        """An overwrite's hidden copy of the replaced step: back under its name if the crash
        left none there, else deleted, only when the step there now is a commit of the same
        run (the overwrite went through). Anything else is left alone, and said."""
        if not self._replaced_step(name, step):
            logger.warning(
                "leaving %s/%s alone: named like the copy an overwrite of %s sets aside, but "
                "it holds no manifest of that step; remove it if it is not needed",
                self.backend.root,
                name,
                step,
            )
            return
        if self._undo_overwrite(name, step):
            return
        was, now = self._run_of(name), self._run_of(step)
        if self.backend.exists(name, layout.PENDING_MARKER) or (now is not None and was == now):
            self.backend.remove_step_dir(name, reason="replaced by a newer commit")
            return
        logger.warning(
            "leaving %s/%s alone: the step %s it held (run %r) was replaced by a save of "
            "run %r; remove it once it is not needed",
            self.backend.root,
            name,
            step,
            was,
            now,
        )

    def _recover_entry(self, name: str, step: str, save_id: str, suffix: str) -> None:
        if not self.backend.is_dir(name) or suffix == layout.QUARANTINE_SUFFIX:
            return  # a quarantined step is an operator's to inspect and delete
        if suffix == layout.DELETE_SUFFIX:
            if self._abandoned(name):
                self.finish_delete(name, step, reason="finishing an interrupted delete")
        elif suffix == layout.UPLOAD_SUFFIX:
            if not self._upload_area_wanted(step, save_id):
                self.backend.remove_tree(name, reason="upload records of an abandoned save")
        elif suffix == layout.OLD_SUFFIX:
            self._recover_old(name, step)
        elif self._abandoned(name):
            self.backend.remove_tree(name, reason="temporary directory of a crashed save")

    def _upload_area_wanted(self, step: str, save_id: str) -> bool:
        """Early-upload records matter while their save is in flight or awaits promotion, and
        while an upload holds a file's lock in them (a failed save's early upload ends on its
        own: the next save never deletes the records under it)."""
        if self.backend.exists(layout.tmp_dir_name(step, save_id)):
            return True
        area = layout.upload_area_name(step, save_id)
        if any(
            name.endswith(".lock") and self.backend.is_locked_file(area, name)
            for name in self.backend.list_files(area)
        ):
            return True
        try:
            return self.has_step(step) and self.read_head(step).save_id == save_id
        except (ManifestError, OSError):
            return False

    def _abandoned(self, name: str) -> bool:
        if self.backend.exists(name, layout.LOCK_NAME):
            return not self.backend.is_locked(name)
        return time.time() - self.backend.mtime(name) > _UNLOCKED_GRACE_SECS
