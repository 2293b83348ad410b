"""A version-2 manifest section decoded: its files, and their items as columns, checked
whole columns at a time. Pure: no I/O. :func:`dcp_tiered.policy.manifest.parse_section`
merges the result into a manifest as :class:`~dcp_tiered.policy.manifest_types.SectionLocations`.

A restore needs, per item it reads, where the item's bytes lie and their checksum; the
section holds exactly that as columns (tensor id, chunk, length, CRC32C, raw offset). Turning
every row into a key and a location up front cost a restore of 20,000 tensors 0.25 s, more
than its reading; the checks (every id, chunk, writer, offset and raw offset in range) are
the same, and an error names the first item that fails.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import ManifestError
from . import integrity, records
from .manifest_types import (
    MAX_ITEM_FRAMING_BYTES,
    REPAIR_HINT,
    SECTION_FORMAT,
    SECTION_VERSION,
    SHARED,
    FileColumns,
    Manifest,
    check_item_length,
)

__all__ = ["section_columns"]

_HINT = REPAIR_HINT
_MAX_FILE_BYTES = 1 << 62  # 4 EiB: sizes and offsets below it never pass 64 bits in a sum


def section_columns(
    m: Manifest, node: int, data: bytes, *, where: str
) -> tuple[dict[str, dict[str, Any]], list[FileColumns]]:
    """The files of node ``node``'s section of ``m`` (its bytes ``data``, read from
    ``where``): each file's size, checksum and rank, and its items as columns; a
    ManifestError saying where and what otherwise."""
    body = section_body(m, node, data, where=where)
    with malformed(where, "manifest section"):
        writers = _Writers(m)
        files: dict[str, dict[str, Any]] = {}
        columns = [_file_columns(m, node, entry, files, writers) for entry in body["files"]]
    return files, columns


def section_body(m: Manifest, node: int, data: bytes, *, where: str) -> dict[str, Any]:
    """The JSON object of node ``node``'s section of ``m``, checked to be the one the index
    names (size and CRC32C) and this step's: its files are decoded by the caller."""
    ref = m.sections.get(node)
    if ref is None:
        raise ManifestError(f"{where}: the manifest of {m.step} has no section for node {node}")
    crc = integrity.format_checksum(integrity.checksum(data))
    if len(data) != ref.size or crc != ref.checksum:
        raise ManifestError(
            f"{where}: section of node {node} does not match the index ({len(data)} bytes, "
            f"{integrity.ALGORITHM} {crc}; index says {ref.size} bytes, {ref.checksum}); {_HINT}"
        )
    try:
        body = records.load_json(data, where=where, max_bytes=records.MAX_MANIFEST_BYTES)
    except ManifestError as e:
        raise ManifestError(f"{e}; {_HINT}") from e
    with malformed(where, "manifest section"):
        if (
            body.get("format") != SECTION_FORMAT
            or body.get("version") != SECTION_VERSION
            or (body.get("step"), body.get("save_id"), body.get("node"))
            != (m.step, m.save_id, node)
        ):
            raise ManifestError("not this step's section of this node")
    return body


@contextlib.contextmanager
def malformed(where: str, what: str) -> Iterator[None]:
    """Any error decoding a part of a manifest read from ``where`` as a ManifestError that
    says where, and what to do."""
    try:
        yield
    except ManifestError as e:
        raise ManifestError(f"{where}: {e}; {_HINT}") from e
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError) as e:
        raise ManifestError(f"{where}: malformed {what} ({e!r}); {_HINT}") from e


def file_head(
    m: Manifest, node: int, entry: dict[str, Any], files: dict[str, dict[str, Any]]
) -> tuple[str, int, int, str]:
    """A section's file entry's name, size, writing rank and CRC32C, checked (a safe name,
    listed once, a rank of the node, the size and checksum any other section gives it),
    and recorded in ``files``."""
    name, size, rank = str(entry["name"]), int(entry["size"]), int(entry["rank"])
    if "/" in name or name.startswith(".") or name in files:
        raise ManifestError(f"unsafe or repeated file name {name!r}")
    if not (0 <= rank < m.world_size if node == SHARED else rank in m.nodes[node]) or size < 0:
        raise ManifestError(f"file {name!r} of rank {rank} (size {size}) is not node {node}'s")
    checksum = str(entry["checksum"])
    if name in m.files and (m.files[name]["size"], m.files[name]["checksum"]) != (size, checksum):
        raise ManifestError(f"file {name!r} has another size or checksum in another section")
    files[name] = {"size": size, "checksum": checksum, "rank": rank}
    return name, size, rank, checksum


class _Writers:
    """Every tensor's writers (Manifest.writers) as arrays indexed by tensor id."""

    def __init__(self, m: Manifest) -> None:
        lists = [m.writers[fqn] for fqn in m.fqns]
        self.count = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        self.start = np.cumsum(self.count) - self.count
        self.ranks = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64)


def _ints(values: Any, what: str) -> np.ndarray:
    """A column of JSON integers as an array (an OverflowError past 64 bits)."""
    if type(values) is not list:
        raise ManifestError(f"{what} is not a list")
    out = np.asarray(values) if values else np.zeros(0, dtype=np.int64)
    if out.ndim != 1 or out.dtype.kind != "i":
        raise ManifestError(f"{what} holds values other than integers")
    return out.astype(np.int64, copy=False)


def _file_columns(
    m: Manifest, node: int, entry: dict[str, Any], files: dict[str, dict[str, Any]], w: _Writers
) -> FileColumns:
    name, size, rank, checksum = file_head(m, node, entry, files)
    if size >= _MAX_FILE_BYTES:
        raise ManifestError(f"file {name!r}: {size} bytes is past any file's size")
    ids = _ints(entry["ids"], f"file {name!r}: ids")
    chunks = _ints(entry["chunks"], f"file {name!r}: chunks")
    lengths = _ints(entry["lengths"], f"file {name!r}: lengths")
    raws = _ints(entry["raw"], f"file {name!r}: raw offsets")
    crcs = str(entry["crcs"])
    count = len(ids)
    if not len(chunks) == len(lengths) == len(raws) == count or len(crcs) != 8 * count:
        raise ManifestError(f"file {name!r}: item columns of different lengths")
    if entry.get("offsets") is not None:
        offsets = _ints(entry["offsets"], f"file {name!r}: offsets")
        if len(offsets) != count:
            raise ManifestError(f"file {name!r}: item columns of different lengths")
    else:  # back to back from the start, summed exactly (past 64 bits: malformed)
        ends = itertools.accumulate(lengths.tolist(), initial=int(entry.get("start", 0)))
        offsets = np.asarray(list(ends)[:-1], dtype=np.int64)
    if count:
        _check_items(m, node, name, size, rank, ids, chunks, offsets, lengths, raws, w)
    return FileColumns(
        name,
        size,
        checksum,
        rank,
        ids.tolist(),
        chunks.tolist(),
        offsets.tolist(),
        lengths.tolist(),
        raws.tolist(),
        crcs,
    )


def _check_items(
    m: Manifest,
    node: int,
    name: str,
    size: int,
    rank: int,
    ids: np.ndarray,
    chunks: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    raws: np.ndarray,
    w: _Writers,
) -> None:
    """The per-item checks of :func:`manifest.parse_section`, column by column."""
    fqns = m.fqns
    bad = (ids < 0) | (ids >= len(fqns))
    if not bad.any():
        bad = (chunks < 0) | (chunks >= w.count[ids])
    if bad.any():
        i = int(np.argmax(bad))
        raise ManifestError(f"file {name!r}: item {i} names no chunk of the index")
    who = w.ranks[w.start[ids] + chunks]
    bad = (who != rank) | ((w.count[ids] == 1) != (node == SHARED))
    if bad.any():
        fqn = fqns[int(ids[int(np.argmax(bad))])]
        raise ManifestError(f"file {name!r}: {fqn!r} was not written by rank {rank} here")
    # no sum of two columns: nothing here can pass 64 bits (a file's size is below 2**62)
    bad = (offsets < 0) | (lengths < 0) | (lengths > size) | (offsets > size - lengths)
    bad |= (raws < -1) | (raws >= np.maximum(lengths, 1))
    if bad.any():
        fqn = fqns[int(ids[int(np.argmax(bad))])]
        raise ManifestError(f"item {fqn!r} lies outside {name!r} or its raw offset is bad")
    sdm = m.metadata.state_dict_metadata
    for i in np.flatnonzero(lengths > MAX_ITEM_FRAMING_BYTES).tolist():  # large items: few
        fqn = fqns[int(ids[i])]
        check_item_length(fqn, sdm[fqn], int(chunks[i]), int(lengths[i]))
