"""Run identity: which run a root, a remote prefix or a memory directory belongs to, and whether
a step, a save or a snapshot is that run's. Pure: no I/O.

Every run has an id that survives its own restarts: it is recorded once in each place the run
writes to (``.dcp-tiered-run.json`` in the local root, the memory directory and the remote
prefix) and written into everything the run creates (manifests, remote markers, node records,
claims, memory snapshots). Deletes, replacements, quarantines and restores act only on what
carries the run's id (or was adopted by ``dcp-tiered adopt``); anything else is foreign.

Where the id comes from, at a start (:func:`decide`): ``run_id=`` if given, else what the
places already record, which must agree; else a new id. So a job restarting on its root goes
on as the same run, a fresh node (empty root) joins the run its remote prefix records, and a
job whose root or ``run_id=`` names another run than a place it would write to is refused.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, ForeignRunError, ManifestError

RUN_RECORD = ".dcp-tiered-run.json"
RECORD_FORMAT = "dcp-tiered-run"
# Held (flock, shared) by every process of a live job instance on a root: a second job on the
# root is refused while another instance's file is locked.
LIVE_PREFIX, LIVE_SUFFIX = ".dcp-tiered-live.", ".lock"
_MAX_RECORD_BYTES = 4 * 2**20  # adoptions included
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_TOKEN_RE = re.compile(r"[0-9a-f]{16}")


class Owner(str, enum.Enum):
    """Whose a step, save or snapshot is, seen from one run."""

    OURS = "ours"  # written by this run, or adopted by it
    FOREIGN = "foreign"  # written by another run: never deleted, replaced or restored
    UNOWNED = "unowned"  # written before run identities: readable, touched only once adopted


@dataclass(frozen=True)
class RunRecord:
    """What a root, prefix or memory directory records of the run it belongs to."""

    run_id: str
    created_at_ns: int
    host: str = ""
    where: str = ""  # the root or URL the run first recorded itself in
    adopted: frozenset[tuple[str, str]] = field(default_factory=frozenset)  # (step, save id)

    def describe(self) -> str:
        made = f", first recorded from {self.host}:{self.where}" if self.host else ""
        return f"run {self.run_id!r}{made}"

    def owner(self, run_id: str | None, step: str, save_id: str | None) -> Owner:
        """Whose the save ``save_id`` of ``step``, written by ``run_id``, is for this run."""
        if run_id == self.run_id or (step, save_id or "") in self.adopted:
            return Owner.OURS
        return Owner.UNOWNED if run_id is None else Owner.FOREIGN

    def adopting(self, saves: Iterable[tuple[str, str]]) -> RunRecord:
        return RunRecord(
            self.run_id, self.created_at_ns, self.host, self.where, self.adopted | set(saves)
        )


def validate_run_id(value: object) -> str:
    if not isinstance(value, str) or not _RUN_ID_RE.fullmatch(value):
        raise ConfigError(
            f"run_id must be 1-64 letters, digits, '.', '_' or '-' (not starting with one of "
            f"the last three), got {value!r}"
        )
    return value


def is_run_id(value: object) -> bool:
    return isinstance(value, str) and bool(_RUN_ID_RE.fullmatch(value))


def new_run_id() -> str:
    return uuid.uuid4().hex


def encode_record(record: RunRecord) -> bytes:
    return json.dumps(
        {
            "format": RECORD_FORMAT,
            "run_id": record.run_id,
            "created_at_ns": record.created_at_ns,
            "host": record.host,
            "where": record.where,
            "adopted": sorted([s, sid] for s, sid in record.adopted),
        },
        indent=1,
    ).encode()


def decode_record(data: bytes, *, where: str) -> RunRecord:
    """Parse a run record; ManifestError (saying what to do) if it is not one of ours."""
    bad = (
        f"{where} is not a readable dcp_tiered run record; nothing there is touched until it "
        "is fixed. If this root, prefix or directory is yours, delete the file (the next start "
        "records the run again) or restore it from a backup"
    )
    if len(data) > _MAX_RECORD_BYTES:
        raise ManifestError(f"{bad} (it has {len(data)} bytes)")
    try:
        body = json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{bad} ({str(e)[:100]})") from e
    if not isinstance(body, dict) or body.get("format") != RECORD_FORMAT:
        raise ManifestError(bad)
    adopted = body.get("adopted", [])
    created = body.get("created_at_ns")
    if (
        not is_run_id(body.get("run_id"))
        or type(created) is not int
        or not isinstance(body.get("host", ""), str)
        or not isinstance(body.get("where", ""), str)
        or not isinstance(adopted, list)
        or not all(
            isinstance(a, list) and len(a) == 2 and all(isinstance(x, str) for x in a)
            for a in adopted
        )
    ):
        raise ManifestError(bad)
    return RunRecord(
        body["run_id"],
        created,
        body.get("host", ""),
        body.get("where", ""),
        frozenset((a[0], a[1]) for a in adopted),
    )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a record holds")


def decide(explicit: str | None, recorded: Mapping[str, str | None]) -> str | None:
    """The run a start joins: ``explicit`` (``run_id=``) or the one every place in ``recorded``
    (place -> the run id it records, None: none yet) agrees on; None when nothing names one
    (the caller makes a new id). ForeignRunError, naming each place and its run, when they
    disagree: a second job on a root, prefix or memory directory of another run."""
    named = {where: rid for where, rid in recorded.items() if rid is not None}
    ids = set(named.values()) | ({explicit} if explicit is not None else set())
    if len(ids) <= 1:
        return next(iter(ids), None)
    places = "; ".join(f"{where} belongs to run {rid!r}" for where, rid in sorted(named.items()))
    this = f"this job was given run_id={explicit!r}; " if explicit is not None else ""
    raise ForeignRunError(
        f"{this}{places}. A root, remote prefix and memory directory hold one run's "
        "checkpoints: nothing was changed. Give this job its own directories and prefix, pass "
        "the run_id of the run to continue, or (for what you know is yours) run `dcp-tiered "
        "adopt` on the place to hand its steps to this run"
    )


def live_lock_name(token: str) -> str:
    return f"{LIVE_PREFIX}{token}{LIVE_SUFFIX}"


def parse_live_lock(name: str) -> str | None:
    """The instance token of a live-lock file's name, or None if it is not one of ours."""
    if name.startswith(LIVE_PREFIX) and name.endswith(LIVE_SUFFIX):
        token = name[len(LIVE_PREFIX) : -len(LIVE_SUFFIX)]
        return token if _TOKEN_RE.fullmatch(token) else None
    return None
