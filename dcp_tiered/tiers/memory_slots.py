"""A rank's memory-tier slots as files: their names, and their committed headers read from
outside the tier (the CLI's listing, a new process's choice of the slot to write next).
The layout is :mod:`dcp_tiered.tiers.memory`'s."""

from __future__ import annotations

import logging
import os

import torch

from ..backends.local import LocalBackend
from ..errors import ManifestError
from ..policy import memory_format as fmt

logger = logging.getLogger("dcp_tiered.tiers.memory")  # the tier's one logger

SLOTS = 2
_PAGE = 4096


def data_file(slot: int) -> str:
    return f"slot-{slot}.data"


def header_file(slot: int) -> str:
    return f"slot-{slot}.json"


def read_headers(backend: LocalBackend) -> dict[int, fmt.Header]:
    """Slot -> header of each committed slot in one rank's directory."""
    found = {}
    for slot in range(SLOTS):
        try:
            data = backend.read_file(header_file(slot))
        except FileNotFoundError:
            continue
        try:
            found[slot] = fmt.decode_header(data, where=backend.path_of(header_file(slot)))
        except ManifestError as e:
            logger.warning("ignoring memory-tier slot %d: %s", slot, e)
    return found


def list_steps(root: str | os.PathLike[str]) -> dict[str, list[int]]:
    """Step name -> ranks whose slots hold it, for every rank directory under ``root``."""
    found: dict[str, list[int]] = {}
    for name in LocalBackend(root).list_names():
        if name.startswith("rank-") and name[5:].isdigit():
            backend = LocalBackend(os.path.join(root, name))
            for header in read_headers(backend).values():
                found.setdefault(header.step, []).append(int(name[5:]))
    return found


def header_runs(root: str | os.PathLike[str]) -> set[str]:
    """The runs the committed slots under memory directory ``root`` name (every rank's
    directory): whose snapshots they are, whether or not the directory records a run."""
    found = set()
    for name in LocalBackend(root).list_names():
        if name.startswith("rank-") and name[5:].isdigit():
            for header in read_headers(LocalBackend(os.path.join(root, name))).values():
                if header.run_id is not None:
                    found.add(header.run_id)
    return found


def reserve(backend: LocalBackend, slot: int, nbytes: int) -> torch.Tensor | None:
    """Slot ``slot``'s data file made, ``nbytes`` long, and mapped with every page of the
    mapping faulted in: what a slot's first snapshot otherwise pays within its copy (72 MiB
    on the development VM: 16-25 ms to reserve the tmpfs's pages, 14-30 ms to fault them in).
    Only a data file this call creates, of a slot with no header: a slot file that exists
    may hold a committed snapshot (of an earlier process, or of an earlier layout), which only
    a save replaces, after removing its header. None then, or where the space cannot be had
    (the save that needs the slot meets the error itself, and names it)."""
    if backend.exists(header_file(slot)):  # a header left without its data: not made under it
        return None
    try:  # created here or not at all: a file another process made meanwhile is not ours
        buffer = backend.map_file(data_file(slot), nbytes, exclusive=True)
    except FileExistsError:
        return None
    except OSError as e:  # InsufficientSpaceError included: the save will say so
        logger.debug("memory tier: slot %d not reserved ahead: %s", slot, e)
        return None
    buffer[::_PAGE].zero_()  # a byte per page: the file is new, its bytes zeros already
    return buffer
