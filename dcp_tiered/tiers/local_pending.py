"""Pending directories: a step's directory a framework writes into before the save that
commits it, and what a crashed save leaves of one."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from ..backends.local import LocalBackend
from ..errors import ManifestError
from ..policy import layout, records

logger = logging.getLogger(__name__)


class PendingDirectories:
    """Part of :class:`~dcp_tiered.tiers.local.LocalTier`: its pending directories."""

    backend: LocalBackend

    if TYPE_CHECKING:

        def has_step(self, name: str) -> bool: ...

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
                "leaving %s/%s alone: unreadable pending marker (%s)", self.backend.root, step, e
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
