"""One guarded parser for every JSON document read back from storage, and the checks of each
small record kind. Pure: no I/O.

Whatever we read back may have been truncated, replaced or written by someone else. Each
document is refused with a ManifestError naming where it came from, before it can cost more
than its own size: too large (checked before parsing), nested deeper than the format ever
nests (counted without recursion, before ``json.loads``, whose C parser recurses per level),
holding a non-finite number (``1e999``, ``NaN``), or not of the expected top-level type. The
record checks then refuse wrong field types and values, so callers index the result freely.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import ConfigError, ManifestError
from . import identity, layout
from .retention import RetentionPolicy

# Small records: markers, the latest pointer, pending markers, the tiers record, quarantine
# records. Ours are a few hundred bytes.
MAX_RECORD_BYTES = 1 * 2**20
# A node's completion record lists its files: a few hundred bytes per file.
MAX_NODE_RECORD_BYTES = 256 * 2**20
# Manifest index and sections, memory-tier headers: the largest we write at 16 k ranks is a few
# hundred MiB (format 1, one document, is 350 B per item; docs/scale.md).
MAX_MANIFEST_BYTES = 8 * 2**30
# No document of ours nests deeper than 8 levels (a manifest index: tensors, entry, grid, dims,
# runs, pair).
MAX_DEPTH = 32

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_QUOTE = ord('"')
# +1 for a byte that opens an array or object, -1 for one that closes it
_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b'"[]{}')))  # what bytes.translate drops
_DEPTH_CHUNK = 4 * 2**20


def nesting_depth(data: bytes | bytearray | memoryview) -> int:
    """The deepest nesting of arrays and objects in JSON text ``data``, counted without
    recursion: brackets outside strings (a string is inside an odd number of unescaped quotes),
    their running sum, its maximum; vectorised (numpy) over the quotes and brackets alone
    (``bytes.translate`` drops every other byte: a seventh of the time of counting over all
    of a 1.7 MB manifest), in chunks of bounded memory."""
    raw = bytes(data)
    if b"\\" in raw:  # escaped characters (\" in particular) never open or close a string
        raw = _ESCAPE.sub(b"", raw)
    marks = raw.translate(None, _NOT_STRUCTURE)
    depth = deepest = quotes = 0
    for start in range(0, len(marks), _DEPTH_CHUNK):
        chunk = np.frombuffer(marks[start : start + _DEPTH_CHUNK], dtype=np.uint8)
        is_quote = chunk == _QUOTE
        outside = ((np.cumsum(is_quote, dtype=np.int32) + quotes) & 1) == 0
        running = np.cumsum(_STEP[chunk] * outside, dtype=np.int32)
        deepest = max(deepest, depth + int(running.max()))
        depth += int(running[-1])
        quotes += int(np.count_nonzero(is_quote))
    return deepest


def _count_opening(data: bytes | bytearray | memoryview) -> int:
    raw = data if isinstance(data, (bytes, bytearray)) else bytes(data)
    return raw.count(b"[") + raw.count(b"{")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"non-finite number {text[:40]}")
    return value


def _constant(text: str) -> Any:
    raise ValueError(f"non-finite number {text}")


def _check_size(data: bytes | bytearray | memoryview, where: str, max_bytes: int) -> None:
    if len(data) > max_bytes:
        raise ManifestError(
            f"{where}: {len(data)} bytes, more than the {max_bytes} such a file of ours ever "
            "holds; it was not parsed"
        )


def load_json(
    data: bytes | bytearray | memoryview,
    *,
    where: str,
    max_bytes: int,
    max_depth: int = MAX_DEPTH,
    expect: type | None = dict,
) -> Any:
    """Parse JSON ``data`` read from ``where``, or raise ManifestError saying why not."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ManifestError(f"{where}: expected bytes, got {type(data).__name__}")
    _check_size(data, where, max_bytes)
    depth = 0
    if _count_opening(data) > max_depth:  # deeper than that cannot be: skip the count
        depth = nesting_depth(data)
    if depth > max_depth:
        raise ManifestError(
            f"{where}: JSON nested {depth} levels deep (ours nest at most {max_depth}); it "
            "was not parsed"
        )
    try:
        # UTF-8 only, as every record of ours is written: json.loads would also take UTF-16
        # and -32, whose quotes and brackets the nesting count above does not see as such
        text = bytes(data).decode("utf-8") if isinstance(data, memoryview) else data.decode()
        body = json.loads(text, parse_float=_finite, parse_constant=_constant)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:  # also 5,000-digit ints
        raise ManifestError(f"{where}: not valid JSON ({str(e)[:200]})") from e
    if expect is not None and not isinstance(body, expect):
        raise ManifestError(
            f"{where}: a JSON {type(body).__name__} where a JSON {_json_name(expect)} belongs"
        )
    return body


def _json_name(kind: type) -> str:
    names: dict[type, str] = {dict: "object", list: "array", str: "string"}
    return names.get(kind, kind.__name__)


# ---------------------------------------------------------------- field checks


def integer(body: Mapping[str, Any], name: str, where: str, *, low: int = 0) -> int:
    value = body.get(name)
    if type(value) is not int or value < low:
        raise ManifestError(f"{where}: {name} {value!r} is not an integer >= {low}")
    return value


def text(body: Mapping[str, Any], name: str, where: str) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise ManifestError(f"{where}: {name} {value!r} is not a string")
    return value


def save_id(body: Mapping[str, Any], where: str) -> str:
    value = body.get("save_id")
    if not layout.is_save_id(value):
        raise ManifestError(
            f"{where}: save id {value!r} is not one dcp_tiered makes (1-32 lowercase hex "
            "digits); the record is not ours or was modified"
        )
    return str(value)


# ---------------------------------------------------------------- remote records


def marker(data: bytes, *, step: str, where: str) -> dict[str, Any]:
    """A remote commit marker (``STEP/_COMMITTED.json``, :func:`layout.marker_body`), checked
    field by field: every field a reader uses is there with its type, and its save's keys
    (:func:`layout.keys_of_marker`) can be derived from it."""
    return check_marker(load_json(data, where=where, max_bytes=MAX_RECORD_BYTES), step, where)


def check_marker(body: Any, step: str, where: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ManifestError(f"{where}: a marker is a JSON object, got {type(body).__name__}")
    if body.get("step", step) != step:
        raise ManifestError(f"{where}: the marker names step {body.get('step')!r}, not {step!r}")
    save_id(body, where)
    integer(body, "committed_at_ns", where)
    run = body.get("run_id")  # absent or null: written before run ids
    if run is not None and not identity.is_run_id(run):
        raise ManifestError(f"{where}: run id {run!r} is not one dcp_tiered accepts")
    kind = body.get("layout", 1)
    if type(kind) is not int or kind not in (1, layout.REMOTE_LAYOUT):
        raise ManifestError(f"{where}: unknown marker layout {body.get('layout')!r}")
    try:
        layout.keys_of_marker(step, body)
    except ValueError as e:
        raise ManifestError(f"{where}: {e}") from e
    return body


def latest_pointer(data: bytes, *, where: str) -> dict[str, Any]:
    """The remote root's ``latest`` pointer (:func:`layout.latest_body`): a valid step name
    and a valid marker of that step."""
    body = load_json(data, where=where, max_bytes=MAX_RECORD_BYTES)
    step = body.get("step")
    if not isinstance(step, str) or not layout.is_step_name(step):
        raise ManifestError(f"{where}: step {step!r} is not a step name")
    check_marker(body.get("marker"), step, f"{where} (its marker)")
    return body


def node_record(data: bytes, *, where: str, save_id_: str | None = None) -> dict[str, Any]:
    """A node's completion record (``STEP/<save id>/_nodes/node-K.json``): its save id and,
    per data file it uploaded, size, CRC32C and rank."""
    body = load_json(data, where=where, max_bytes=MAX_NODE_RECORD_BYTES)
    sid = save_id(body, where)
    if save_id_ is not None and sid != save_id_:
        raise ManifestError(f"{where}: a record of save {sid}, not of {save_id_}")
    files = body.get("files")
    if not isinstance(files, dict):
        raise ManifestError(f"{where}: files {type(files).__name__} is not a JSON object")
    for name, info in files.items():
        if not _plain_name(name) or not isinstance(info, dict):
            raise ManifestError(f"{where}: {name!r} is not a data file of ours")
        integer(info, "size", where)
        integer(info, "rank", where)
        checksum(info, where)
    return body


def _plain_name(name: object) -> bool:
    """A file name a manifest may list: one path component, not hidden."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and "/" not in name
        and "\x00" not in name
        and not name.startswith(".")
    )


def checksum(body: Mapping[str, Any], where: str, name: str = "checksum") -> str:
    value = body.get(name)
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{8}", value):
        raise ManifestError(f"{where}: {name} {value!r} is not a CRC32C")
    return value


def quarantine_record(data: bytes, *, step: str, where: str) -> dict[str, Any]:
    """A remote quarantine record (``STEP/_quarantined/<save id>.json``): the marker it moved
    aside, when, and why."""
    body = check_marker(load_json(data, where=where, max_bytes=MAX_RECORD_BYTES), step, where)
    integer(body, "quarantined_at_ns", where)
    text(body, "reason", where)
    return body


# ---------------------------------------------------------------- local records


def pending_marker(data: bytes, *, step: str, where: str) -> tuple[list[str], bool]:
    """A pending directory's marker (``STEP/.dcp-tiered-pending.json``): the sidecar files it
    may hold and whether all of it is the save's; checked so that a delete never follows a name
    the marker should not hold."""
    body = load_json(data, where=where, max_bytes=MAX_RECORD_BYTES)
    if body.get("step", step) != step:
        raise ManifestError(f"{where}: made for step {body.get('step')!r}, not {step!r}")
    sidecars = body.get("sidecars", [])
    if not isinstance(sidecars, list) or not all(
        isinstance(n, str) and layout.is_step_name(n) for n in sidecars
    ):
        raise ManifestError(f"{where}: sidecars {sidecars!r} are not plain file names")
    whole = body.get("whole", False)
    if type(whole) is not bool:
        raise ManifestError(f"{where}: whole {whole!r} is not true or false")
    return sidecars, whole


def tiers_record(data: bytes, *, where: str) -> dict[str, Any]:
    """A root's tiers record (``.dcp-tiered-tiers.json``): the memory directory and remote URL
    (never credentials) a writer or manager recorded, and the remote's retention policy
    (``remote_retention``: a :class:`~dcp_tiered.policy.retention.RetentionPolicy`, or None:
    none recorded, the remote keeps every step)."""
    body = load_json(data, where=where, max_bytes=MAX_RECORD_BYTES)
    out: dict[str, Any] = {}
    for name in ("memory", "remote"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise ManifestError(f"{where}: {name} {value!r} is not a path or URL")
        out[name] = value
    out["remote_retention"] = _retention(body.get("remote_retention"), where=where)
    return out


def retention_record(policy: RetentionPolicy | None) -> dict[str, Any] | None:
    """``policy`` as a tiers record holds it."""
    if policy is None:
        return None
    return {
        "keep_latest": policy.keep_latest,
        "keep_every": policy.keep_every,
        "pinned": sorted(policy.pinned),
    }


def _retention(value: Any, *, where: str) -> RetentionPolicy | None:
    if value is None:
        return None
    try:
        if not isinstance(value, dict) or not isinstance(value.get("pinned", []), list):
            raise TypeError("not an object of keep_latest, keep_every and pinned")
        keep_latest, keep_every = value.get("keep_latest"), value.get("keep_every")
        if type(keep_latest) is not int or not (keep_every is None or type(keep_every) is int):
            raise TypeError("keep_latest and keep_every are not whole numbers")
        pinned = frozenset(str(n) for n in value.get("pinned", []))
        return RetentionPolicy(keep_latest=keep_latest, keep_every=keep_every, pinned=pinned)
    except (TypeError, ConfigError) as e:
        raise ManifestError(f"{where}: remote_retention {value!r}: {e}") from None


_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_constant)
_SPACE = re.compile(r"[ \t\n\r]*")


def _skip_space(text: str, at: int) -> int:
    """The index of the first non-whitespace character of ``text`` from ``at``."""
    return _SPACE.match(text, at).end()  # type: ignore[union-attr]  # * matches empty text


def load_json_members(
    data: bytes | bytearray | memoryview, *, where: str, max_bytes: int, stop_at: str
) -> dict[str, Any] | None:
    """The members of JSON object ``data`` that come before its member ``stop_at``, decoded
    one by one and under :func:`load_json`'s guards, the rest never decoded: the head of a
    manifest whose index of 20,000 tensors follows it. None where ``data`` is not an object
    that has ``stop_at`` after members of its own (the whole then goes to :func:`load_json`);
    ManifestError for what is no JSON."""
    _check_size(data, where, max_bytes)
    try:
        text = bytes(data).decode()
        at = _skip_space(text, 0)
        if text[at : at + 1] != "{":
            return None
        out: dict[str, Any] = {}
        at += 1
        while True:
            at = _skip_space(text, at)
            if text[at : at + 1] != '"':
                return None  # no member name here ({} or broken): load_json judges
            key, at = _DECODER.raw_decode(text, at)
            at = _skip_space(text, at)
            if type(key) is not str or text[at : at + 1] != ":":
                return None
            if key == stop_at:
                return out
            out[key], at = _DECODER.raw_decode(text, _skip_space(text, at + 1))
            at = _skip_space(text, at)
            if text[at : at + 1] != ",":
                return None  # the object ended (or broke) before stop_at
            at += 1
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise ManifestError(f"{where}: not valid JSON ({str(e)[:200]})") from e
