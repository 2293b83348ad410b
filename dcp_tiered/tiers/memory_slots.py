"""A rank's memory-tier slots as files: their names, and their committed headers read from
outside the tier (the CLI's listing, a new process's choice of the slot to write next).
The layout is :mod:`dcp_tiered.tiers.memory`'s."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import torch

from ..backends.local import LocalBackend
from ..errors import ConfigError, ForeignRunError, ManifestError
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


def _rank_headers(root: str | os.PathLike[str]) -> Iterator[tuple[int, fmt.Header]]:
    """(rank, header) of each committed slot in every rank's directory under ``root``."""
    for name in LocalBackend(root).list_names():
        if name.startswith("rank-") and name[5:].isdigit():
            for header in read_headers(LocalBackend(os.path.join(root, name))).values():
                yield int(name[5:]), header


def list_steps(root: str | os.PathLike[str]) -> dict[str, list[int]]:
    """Step name -> ranks whose slots hold it, for every rank directory under ``root``."""
    found: dict[str, list[int]] = {}
    for rank, header in _rank_headers(root):
        found.setdefault(header.step, []).append(rank)
    return found


def header_runs(root: str | os.PathLike[str]) -> set[str]:
    """The runs the committed slots under memory directory ``root`` name (every rank's
    directory): whose snapshots they are, whether or not the directory records a run."""
    return {h.run_id for _, h in _rank_headers(root) if h.run_id is not None}


def refuse_links(backend: LocalBackend) -> None:
    """Before anything is written: a rank's directory (``backend``'s root) and its slot files
    are the tier's names, never links, which a write would go through (a link at a slot's
    data file: its target truncated and overwritten; at the directory: another directory's
    files replaced)."""
    names = [data_file(s) for s in range(SLOTS)] + [header_file(s) for s in range(SLOTS)]
    links = [backend.root] if backend.root.is_symlink() else []
    links += [backend.root / n for n in names if backend.is_link(n)]
    if links:
        raise ConfigError(
            f"memory tier: {', '.join(map(str, links))} is a symbolic link, which the "
            "memory tier never writes through (the file it points to would be "
            "overwritten); nothing was written. Remove the link, or give memory= a "
            "directory of its own"
        )


def refuse_foreign(backend: LocalBackend, run_id: str) -> None:
    """Before run ``run_id``'s first write in a rank's directory: a committed slot whose
    header names another run is that run's snapshot (perhaps its only copy of a step),
    whatever the directory's run record says or whether it is still there; never
    overwritten."""
    for slot, header in read_headers(backend).items():
        if header.run_id is not None and header.run_id != run_id:
            raise ForeignRunError(
                f"{backend.path_of(header_file(slot))} holds step {header.step!r} of run "
                f"{header.run_id!r}, not of run {run_id!r}: nothing was written. Give this "
                "job its own memory directory, or pass that run_id to continue it"
            )


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
