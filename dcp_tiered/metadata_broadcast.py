"""The global metadata DCP broadcasts at the end of every save, pickled as the bytes the
writer already made of it.

After the coordinator's ``finish``, ``dcp.save`` pickles the planner's global metadata (one
object per item) and broadcasts it to every rank, a world of one included: with DCP's plan
caching that is the same object every save, pickled anew each time (20,000 tensors: 0.22 s of
a 2 s save; 2,000: 24 ms; profiled). :class:`TieredSavePlanner` makes its metadata a
:class:`BroadcastMetadata`; our writer's ``finish`` hands it the pickle of the step's
``.metadata`` (kept between saves of one structure, only the step's name written anew), and
the broadcast sends those bytes. Every other rank then gets, from ``dcp.save``, the metadata
as the step's ``.metadata`` holds it (its storage data and this step's name), as vanilla
DCP's ``FileSystemWriter`` gives them. Without the bytes (another writer, a save whose finish
failed) it pickles as a plain ``Metadata``, field by field.
"""

from __future__ import annotations

import copy
import copyreg
import pickle
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

_BYTES = "_dcp_tiered_pickled"  # not a dataclass field: replace() and copies leave it behind


class BroadcastMetadata(Metadata):
    """A ``Metadata`` that pickles as the bytes :func:`remember` gave it, if any. Either way it
    unpickles as a plain ``Metadata``: nothing of ours is needed to read it."""

    def __reduce__(self) -> Any:
        pickled = self.__dict__.get(_BYTES)
        if pickled is not None:  # our own pickle of a Metadata, made in this process
            return pickle.loads, (pickled,)
        # copyreg._reconstructor: how protocols 0 and 1 pickle any plain object (an object of
        # this class may not go through copyreg.__newobj__ as a Metadata)
        rebuild = copyreg._reconstructor  # type: ignore[attr-defined]
        return rebuild, (Metadata, object, None), self._fields()

    def __eq__(self, other: object) -> bool:  # the dataclass's own: equal to a plain one too
        if not isinstance(other, Metadata):
            return NotImplemented
        return Metadata.__eq__(plain(self), plain(other))

    __hash__ = None  # type: ignore[assignment]  # as Metadata's

    # Copies are of the fields, never of the bytes (``copy`` would go through __reduce__).
    def __copy__(self) -> BroadcastMetadata:
        return _made(self._fields())

    def __deepcopy__(self, memo: dict[int, Any]) -> BroadcastMetadata:
        return _made(copy.deepcopy(self._fields(), memo))

    def _fields(self) -> dict[str, Any]:
        return _fields_of(self)


def _fields_of(metadata: Metadata) -> dict[str, Any]:
    """``metadata``'s fields, without the bytes :func:`remember` gave it."""
    return {k: v for k, v in metadata.__dict__.items() if k != _BYTES}


def _made(fields: dict[str, Any]) -> BroadcastMetadata:
    made = BroadcastMetadata.__new__(BroadcastMetadata)
    made.__dict__.update(fields)
    return made


def broadcastable(metadata: Metadata) -> BroadcastMetadata:
    """``metadata`` as a :class:`BroadcastMetadata` (the same fields, shared)."""
    if isinstance(metadata, BroadcastMetadata):
        return metadata
    return _made(dict(metadata.__dict__))


def plain(metadata: Metadata) -> Metadata:
    """``metadata`` as a plain ``Metadata`` (the same fields, shared): what a file holds."""
    if type(metadata) is Metadata:
        return metadata
    made = Metadata.__new__(Metadata)
    made.__dict__.update(_fields_of(metadata))
    return made


def forget(metadata: Metadata) -> None:
    """A new save begins: ``metadata`` pickles field by field until :func:`remember`."""
    if isinstance(metadata, BroadcastMetadata):
        metadata.__dict__.pop(_BYTES, None)


def remember(metadata: Metadata, pickled: bytes) -> None:
    """``metadata`` (the object DCP broadcasts after this save's ``finish``) pickles as
    ``pickled``: the committed step's ``.metadata``."""
    if isinstance(metadata, BroadcastMetadata):
        metadata.__dict__[_BYTES] = pickled
