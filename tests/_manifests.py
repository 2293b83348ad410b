"""Reading and tampering with step manifests in tests, whatever their layout (an index plus
one section per node). Tampering is done on the JSON the way an attacker or a bad disk would;
``reseal`` recomputes the checksums (a CRC, not a signature) to reach the deeper checks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcp_tiered.policy import integrity, manifest, manifest_codec


def index(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / "manifest.json").read_bytes())


def sections(step_dir: Path) -> dict[int, dict[str, Any]]:
    """The section of every node this directory holds."""
    return {
        node: json.loads((step_dir / name).read_bytes())
        for node, name, _, _ in index(step_dir)["sections"]
        if (step_dir / name).exists()
    }


def files(step_dir: Path) -> dict[str, dict[str, Any]]:
    return {f["name"]: f for s in sections(step_dir).values() for f in s["files"]}


def items(step_dir: Path) -> list[dict[str, Any]]:
    """Every item located by the sections here: fqn, file, offset, length, checksum, raw."""
    m = manifest.parse((step_dir / "manifest.json").read_bytes(), where=str(step_dir))
    for node in list(sections(step_dir)):
        data = (step_dir / manifest.layout.manifest_section_name(node)).read_bytes()
        m = manifest.parse_section(m, node, data, where=str(step_dir))
    return [
        {
            "fqn": idx.fqn,
            "file": loc.relative_path,
            "offset": loc.offset,
            "length": loc.length,
            "checksum": loc.checksum,
            "raw_offset": loc.raw_offset,
        }
        for idx, loc in m.locations.items()
    ]


def tamper(
    step_dir: Path,
    *,
    edit_index: Callable[[dict[str, Any]], None] | None = None,
    edit_section: Callable[[dict[str, Any]], None] | None = None,
    node: int = -1,
    reseal: bool = True,
) -> None:
    """Edit node ``node``'s section (default: the shared one, which holds every item of a
    single-process save) and/or the index; with ``reseal`` the index names the
    edited section's new size and CRC32C and carries a valid checksum of its own."""
    body = index(step_dir)
    if edit_section is not None:
        name = manifest.layout.manifest_section_name(node)
        section = json.loads((step_dir / name).read_bytes())
        edit_section(section)
        data = json.dumps(section, separators=(",", ":")).encode()
        (step_dir / name).write_bytes(data)
        if reseal:
            for ref in body["sections"]:
                if ref[0] == node:
                    ref[2:] = [len(data), integrity.format_checksum(integrity.checksum(data))]
    if edit_index is not None:
        edit_index(body)
    body.pop("manifest_checksum", None)
    if reseal:
        (step_dir / "manifest.json").write_bytes(manifest_codec.seal(body))
    elif edit_index is not None:
        (step_dir / "manifest.json").write_text(json.dumps(body))


def entry_of(body: dict[str, Any], fqn: str) -> list[Any]:
    """Key ``fqn``'s entry in a version-3 index as ``[entry, writers]`` (the version-2 entry
    and its writers' progressions), moved out of the whole-tensor columns into ``others``
    if it was there, so a test tampers with it as with any entry; the index still lists
    the same tensors."""
    t = body["tensors"]
    i = t["fqns"].index(fqn)
    at = sum(1 for s in t["shape"][:i] if s < 0)
    if t["shape"][i] >= 0:
        size = list(t["shapes"][t["shape"][i]])
        entry: dict[str, Any] = {"type": "tensor", "props": t["props"][i], "size": size}
        entry.update({"grid": [[[n, 1]] for n in size]} if size else {"chunks": [[]]})
        t["others"].insert(at, [entry, [[t["rank"][i], 0, 1]]])
        t["shape"][i] = t["props"][i] = t["rank"][i] = -1
    return t["others"][at]


def as_version_2(body: dict[str, Any]) -> dict[str, Any]:
    """A version-3 index body as the version-2 writer wrote it (an entry per tensor, the
    planner data as a dict): what a step saved by an earlier dcp_tiered holds."""
    out = dict(body, version=2)
    t = body["tensors"]
    fqns = list(t["fqns"])
    copy = json.loads(json.dumps(body))
    out["tensors"] = [[fqn, *entry_of(copy, fqn)] for fqn in fqns]
    paths = body["planner_data"]
    out["planner_data"] = {
        **{f: p for f, p in zip(fqns, paths["paths"]) if p is not None},
        **paths["more"],
    }
    out.pop("manifest_checksum", None)
    return out


def tensor_id(body: dict[str, Any], fqn: str) -> int:
    """The id a section gives key ``fqn`` (its position in the index)."""
    return body["tensors"]["fqns"].index(fqn)
