"""Structured save events, one JSON object per line, and to the ``dcp_tiered.events`` logger."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from .backends.local import append_line

logger = logging.getLogger("dcp_tiered.events")


class EventLog:
    """Appends events to ``path`` (every rank may share one file) and logs them at INFO."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = None if path is None else os.fspath(path)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": round(time.time(), 6), **fields}
        line = json.dumps(record, sort_keys=True, default=str)
        logger.info(line)
        if self.path is not None:
            try:
                append_line(self.path, line)
            except OSError as e:  # observability must never fail a save
                logger.warning("cannot append to event log %s: %s", self.path, e)
        return record
