"""Quarantine on the remote tier: a committed step's marker moved aside (its objects stay), so
the step name can be saved again, and given back on request; only ever a save of this run.

:class:`RemoteQuarantine` is a part of :class:`~dcp_tiered.tiers.remote.RemoteTier` (which
inherits it)."""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from ..backends.remote import RemoteBackend
from ..errors import CheckpointExistsError, CheckpointNotFoundError, IntegrityError, ManifestError
from ..policy import layout, records

logger = logging.getLogger(__name__)


class RemoteQuarantine:
    """The quarantine of one remote root (a role of RemoteTier)."""

    backend: RemoteBackend

    if TYPE_CHECKING:  # RemoteTier's

        def marker(self, step: str) -> dict[str, Any] | None: ...

        def _marker_url(self, step: str) -> str: ...

        def _require_ours(
            self, marker: dict[str, Any], step: str, run_id: str | None, doing: str
        ) -> None: ...

    def quarantined(self) -> list[tuple[str, str]]:
        """``(step, save id)`` of every save quarantined on the remote."""
        out = []
        for key in self.backend.glob(f"*/{layout.REMOTE_QUARANTINE}/*.json"):
            step, _, rest = key.partition("/")
            sid = rest.rpartition("/")[2].removesuffix(".json")
            if layout.is_step_name(step) and layout.is_save_id(sid):
                out.append((step, sid))
        return out

    def quarantined_saves(self, step: str) -> set[str]:
        prefix = f"{step}/{layout.REMOTE_QUARANTINE}/"
        return {k[len(prefix) :].removesuffix(".json") for k in self.backend.sizes(prefix)}

    def quarantine(self, step: str, *, reason: str, run_id: str | None) -> bool:
        """Move the commit marker of ``step`` aside (its objects stay where they are), so that
        ``latest``, retention and the step's immutability ignore it and the step can be saved
        again. Returns whether a marker was there. ForeignPathError if it commits a save that
        is not run ``run_id``'s (see :meth:`dcp_tiered.tiers.remote.RemoteTier.owner`): that
        is never touched."""
        remote = self.backend
        marker = self.marker(step)
        if marker is None:
            return False
        sid = str(marker.get("save_id"))
        if not layout.is_save_id(sid):
            raise IntegrityError(
                f"{self._marker_url(step)} names no valid save id; it was left in place"
            )
        self._require_ours(marker, step, run_id, "quarantined")
        record = {**marker, "quarantined_at_ns": time.time_ns(), "reason": reason}
        remote.put_bytes(layout.quarantine_record_key(step, sid), json.dumps(record).encode())
        remote.remove(f"{step}/{layout.REMOTE_MARKER}", reason=f"quarantined: {reason}")
        logger.warning(
            "quarantined remote step %s (save %s) of %s: %s; its objects stay under %s",
            step,
            sid,
            remote.config.url,
            reason,
            layout.quarantine_record_key(step, sid),
        )
        return True

    def release(self, step: str, save_id: str, *, run_id: str) -> None:
        """Undo :meth:`quarantine`: commit quarantined save ``save_id`` of ``step`` again (its
        marker back, exclusively, then its quarantine record removed). Refused while the step
        is committed by another save (saved again since), and for a save not run ``run_id``'s."""
        remote = self.backend
        key = layout.quarantine_record_key(step, save_id)
        try:
            record = records.quarantine_record(
                remote.get_bytes(key), step=step, where=remote.url(key)
            )
            marker = {k: v for k, v in record.items() if k not in ("quarantined_at_ns", "reason")}
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"no quarantined save {save_id} of {step} on {remote.config.url}"
            ) from None
        if marker.get("step") != step or marker.get("save_id") != save_id:
            raise ManifestError(f"{remote.url(key)} names another save than {step}/{save_id}")
        self._require_ours(marker, step, run_id, "released")
        if not remote.create_exclusive(
            f"{step}/{layout.REMOTE_MARKER}", json.dumps(marker).encode()
        ):
            raise CheckpointExistsError(
                f"{step} is committed on {remote.config.url} by another save (saved again since "
                f"the quarantine): quarantined save {save_id} was left aside"
            )
        remote.remove(key, reason=f"released from quarantine: {step} is save {save_id} again")
        logger.warning("released remote step %s (save %s) of %s", step, save_id, remote.config.url)
