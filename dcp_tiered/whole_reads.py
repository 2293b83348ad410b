"""Whole reads left to the reader: how a TieredLoadPlanner knows that the reader of its load
reads whole tensors straight from the manifest's columns, so it makes no read item for them.

DCP hands the planner the metadata the reader returned (``read_metadata``, then
``set_up_planner`` on the same rank), and the reader the planner (``read_data``); nothing
else links them. A :class:`~dcp_tiered.reader.TieredStorageReader` offers the metadata
object it returned; the planner asks whether *that* object came from such a reader that still
reads by columns. Any other reader (DCP's own, a vanilla step, a remote-only step) is never
found, and the planner plans every item as before.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol


class ColumnReader(Protocol):
    def reads_by_columns(self, metadata: Any) -> bool:
        """Whether this reader returned ``metadata`` and will read, from the manifest's
        columns, the whole tensors its planner leaves to it."""


# id of the metadata object -> the reader that returned it (ids are checked by identity)
_OFFERED: dict[int, weakref.ReferenceType[Any]] = {}


def offer(metadata: Any, reader: ColumnReader) -> None:
    """``reader`` returned ``metadata`` (and may read its whole tensors by columns)."""
    for key, ref in list(_OFFERED.items()):  # a snapshot: loads may run in other threads
        if ref() is None:
            _OFFERED.pop(key, None)
    _OFFERED[id(metadata)] = weakref.ref(reader)


def reader_of(metadata: Any) -> ColumnReader | None:
    """The reader that returned ``metadata`` and reads whole tensors by columns, or None."""
    ref = _OFFERED.get(id(metadata))
    reader = ref() if ref is not None else None
    if reader is None or not reader.reads_by_columns(metadata):
        return None
    return reader
