"""Names on disk: step names, temporary and hidden entries, and "latest". Pure, no I/O."""

from __future__ import annotations

import re
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .prefixes import (  # noqa: F401 - names callers know from here
    DEFAULT_HASH_PREFIXES,
    HASHED_DATA,
    MAX_HASH_PREFIXES,
    PrefixStrategy,
    hash_prefixes_of,
)

MANIFEST_NAME = "manifest.json"  # the index; each node's items are in its own section
_SECTION_RE = re.compile(r"manifest\.(shared|node-(0|[1-9][0-9]{0,6}))\.json")
DCP_METADATA_NAME = ".metadata"
LATEST = "latest"
# Hidden (dot-prefixed) so that no listing of committed steps can ever pick them up.
TMP_SUFFIX = ".dcp-tiered-tmp"
OLD_SUFFIX = ".dcp-tiered-old"
UPLOAD_SUFFIX = ".dcp-tiered-up"  # bookkeeping of uploads that start before the local commit
DELETE_SUFFIX = ".dcp-tiered-del"  # a step being deleted: renamed out of sight first
# A step a restore fell back past, moved aside so that training can save that step again.
# Never swept, pruned or loaded: an operator decides what becomes of it.
QUARANTINE_SUFFIX = ".dcp-tiered-quarantined"
LOCK_NAME = ".dcp-tiered.lock"
# In a directory a shim made at a step's path before the step is committed (mcore writes its
# common.pt there first): which files it may hold. Only such a directory is ours to replace or
# sweep; the commit's rename replaces it, marker and all.
PENDING_MARKER = ".dcp-tiered-pending.json"
UPLOADER_LOCK_NAME = ".dcp-tiered-uploader.lock"
# A CheckpointManager's files next to the local tier's steps.
TIERS_RECORD = ".dcp-tiered-tiers.json"  # where `dcp-tiered status ROOT` finds the other tiers
EVENTS_LOG = ".dcp-tiered-events.jsonl"
RETENTION_LOCK_NAME = ".dcp-tiered-retention.lock"  # held by the process that prunes a root
HYDRATE_LOCK_NAME = ".dcp-tiered-hydrate.lock"  # ranks of a node hydrate one at a time

# Remote tier: a step is committed there once its marker exists (created exclusively, last).
REMOTE_MARKER = "_COMMITTED.json"
REMOTE_QUARANTINE = "_quarantined"  # STEP/_quarantined/<save id>.json: a marker moved aside
NODE_RECORDS = "_nodes"
# STEP/<save id>/_claims/node-K.json: written by each node before its first object of a save,
# naming the run; the orphan sweep removes only saves a claim of its own run names.
CLAIMS = "_claims"
REMOTE_LAYOUT = 2  # objects of a save under STEP/<save id>/ (layout 1: directly under STEP/)
# The remote root's pointer to its newest committed step (hidden: never a step name). Written
# after the step's marker, moved only forward in `step_names.newest`'s order; restores read it
# instead of listing the root, and fall back to listing when it is missing or names no
# committed save.
REMOTE_LATEST = ".dcp-tiered-latest.json"
# The remote root's checksum probe (backends/s3_checksums.py): a tiny object only this library
# writes, under a hidden prefix that is never a step name, deleted by the probe that made it.
REMOTE_PROBE = "_probe"
_PROBE_RE = re.compile(r"_probe/crc32c-[0-9a-f]{16}")

_STEP_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # fullmatch: no trailing newline
_DATA_FILE_RE = re.compile(r"__(0|[1-9][0-9]{0,8})_(0|[1-9][0-9]{0,5})\.distcp")
_NODE_FILE_RE = re.compile(r"node-(0|[1-9][0-9]{0,6})\.json")
_SAVE_ID_RE = re.compile(r"[0-9a-f]{1,32}")
# the save ids our hidden entries are named with: a save's, a delete's, or "h" and 11 hex
# digits (a step made by hydration, tiers.pull)
_HIDDEN_ID_RE = re.compile(r"[0-9a-f]{1,32}|h[0-9a-f]{11}")


def validate_step_name(name: object) -> str:
    """Return ``name`` if it is a safe step name, else raise ConfigError.

    A step name is one path component: letters, digits, ``.``, ``_`` and ``-``, not starting
    with a dot, at most 128 characters. Absolute paths, ``..`` and separators are refused so
    that no checkpoint_id can make us write outside the configured root.
    """
    if not isinstance(name, str):
        raise ConfigError(
            f"checkpoint_id must be a step name such as 'step-100', got {type(name).__name__} "
            f"{name!r}; the directory is given to the writer/reader constructor."
        )
    if name == LATEST:
        raise ConfigError(f"'{LATEST}' is reserved for loading; save under a real step name.")
    if name == HASHED_DATA:
        raise ConfigError(
            f"'{HASHED_DATA}' is reserved: it is the remote tier's prefix for "
            "hashed data keys (prefix_strategy='hash'), and a step of that name "
            "would shadow or delete other steps' objects. Use another name."
        )
    if not _STEP_RE.fullmatch(name) or ".." in name:
        raise ConfigError(
            f"unsafe checkpoint_id {name!r}: use one name made of letters, digits, '.', '_' "
            "and '-', not starting with '.', without '/' or '..' (e.g. 'step-100')."
        )
    return name


def is_step_name(name: str) -> bool:
    return bool(_STEP_RE.fullmatch(name)) and ".." not in name and name not in (LATEST, HASHED_DATA)


def tmp_dir_name(step: str, save_id: str) -> str:
    return f".{step}.{save_id}{TMP_SUFFIX}"


def old_dir_name(step: str, save_id: str) -> str:
    return f".{step}.{save_id}{OLD_SUFFIX}"


def upload_area_name(step: str, save_id: str) -> str:
    return f".{step}.{save_id}{UPLOAD_SUFFIX}"


def delete_dir_name(step: str, save_id: str) -> str:
    return f".{step}.{save_id}{DELETE_SUFFIX}"


def quarantine_dir_name(step: str, save_id: str) -> str:
    return f".{step}.{save_id}{QUARANTINE_SUFFIX}"


def parse_hidden_dir(name: str) -> tuple[str, str, str] | None:
    """Split a hidden entry of ours into ``(step, save_id, suffix)``; None for anything else."""
    for suffix in (TMP_SUFFIX, OLD_SUFFIX, UPLOAD_SUFFIX, DELETE_SUFFIX, QUARANTINE_SUFFIX):
        if name.startswith(".") and name.endswith(suffix):
            stem = name[1 : -len(suffix)]
            step, _, save_id = stem.rpartition(".")
            if step and _HIDDEN_ID_RE.fullmatch(save_id) and is_step_name(step):
                return step, save_id, suffix
    return None


def unfinished_steps(names: Iterable[str]) -> set[str]:
    """The steps among a root's entry ``names`` that have a save directory not committed (yet):
    being written, or left by a writer that died."""
    return {p[0] for n in names if (p := parse_hidden_dir(n)) and p[2] == TMP_SUFFIX}


def manifest_section_name(node: int) -> str:
    """Node ``node``'s manifest section; node -1 is the section every node holds."""
    return "manifest.shared.json" if node == -1 else f"manifest.node-{node}.json"


def is_step_metadata(name: str) -> bool:
    """The manifest, its sections and DCP's ``.metadata``: what a step holds besides data."""
    return name in (MANIFEST_NAME, DCP_METADATA_NAME) or bool(_SECTION_RE.fullmatch(name))


# Files an adapter writes into a committed step, derived from it and deleted with it: mcore's
# beside a torch_dist step (shims.megatron.sidecars), HF Trainer's state (shims.hf.trainer).
_SIDECAR_NAMES = ("metadata.json", "common.pt", "trainer_state.json")
# Any other name an adapter writes there (DeepSpeed's file stubs, named by the framework) is
# marked ours by an empty file of this prefix beside it, written first.
SIDECAR_MARK = ".dcp-tiered-sidecar."
# an atomic small-file write's temporary file (backends.local), left by a crash
_ATOMIC_TMP_RE = re.compile(r"\.(.+)\.[0-9]+-[0-9]+" + re.escape(TMP_SUFFIX))


def is_step_file(name: str, beside: Container[str] = ()) -> bool:
    """Whether ``name``, a file in a local step directory whose entries are ``beside``, is one
    a save of ours or an adapter writes there. Anything else in a step (a user's notes, an
    eval result) is not the step's: deleting the step leaves it where it is."""
    tmp = _ATOMIC_TMP_RE.fullmatch(name)
    if tmp:
        name = tmp.group(1)
    return (
        is_data_file(name)
        or is_step_metadata(name)
        or name in (PENDING_MARKER, LOCK_NAME, *_SIDECAR_NAMES)
        or name.startswith(SIDECAR_MARK)
        or SIDECAR_MARK + name in beside
    )


def step_files_in_order(names: Iterable[str]) -> list[str]:
    """``names`` in the order a delete removes them: the manifest and DCP's ``.metadata``
    first, so that a crash part way leaves no directory that reads as committed."""
    return sorted(names, key=lambda n: (n not in (MANIFEST_NAME, DCP_METADATA_NAME), n))


def data_file_name(rank: int, index: int) -> str:
    """DCP FileSystemWriter's naming, so that a vanilla FileSystemReader finds the data."""
    return f"__{rank}_{index}.distcp"


def is_data_file(name: str) -> bool:
    return bool(_DATA_FILE_RE.fullmatch(name))


def data_file_rank(name: str) -> int | None:
    """The rank that wrote data file ``name`` (see :func:`data_file_name`); None for any other
    name."""
    found = _DATA_FILE_RE.fullmatch(name)
    return int(found.group(1)) if found else None


def is_save_object(rel: str) -> bool:
    """Whether ``rel`` (a key relative to a save's prefix ``STEP/<save id>/``) is a name a save
    of ours writes, exactly: data files, the manifest files, ``.metadata``, node records and
    claims. Anything else under the prefix is not ours, whoever put it there."""
    head, _, tail = rel.partition("/")
    if tail:
        return head in (NODE_RECORDS, CLAIMS) and bool(_NODE_FILE_RE.fullmatch(tail))
    return is_data_file(rel) or is_step_metadata(rel)


def is_save_id(value: object) -> bool:
    return isinstance(value, str) and bool(_SAVE_ID_RE.fullmatch(value))


@dataclass(frozen=True)
class RemoteKeys:
    """Where the objects of one save of a step live under the remote root.

    Layout 2 puts every object of a save under ``STEP/<save id>/`` (hashed data under
    ``data/<h>/STEP/<save id>/``), so two saves of one step name (two jobs sharing a prefix, or
    a re-save after a quarantine) never write the same key. Only the marker
    ``STEP/_COMMITTED.json``, created exclusively, says which save *is* the step. Layout 1
    (``save_id=None``), written before, keeps its objects directly under ``STEP/``.
    """

    step: str
    save_id: str | None
    strategy: PrefixStrategy = field(default_factory=PrefixStrategy)

    @property
    def _base(self) -> str:
        return f"{self.step}/{self.save_id}/" if self.save_id else f"{self.step}/"

    def file(self, name: str) -> str:
        """Key of a data file; data may be spread over hashed prefixes."""
        return self.strategy.data_key(self.step, self._base, name)

    @property
    def manifest(self) -> str:
        return f"{self._base}{MANIFEST_NAME}"

    @property
    def metadata(self) -> str:
        return f"{self._base}{DCP_METADATA_NAME}"

    def section(self, node: int) -> str:
        return f"{self._base}{manifest_section_name(node)}"

    def node_record(self, node: int) -> str:
        return f"{self._base}{NODE_RECORDS}/node-{node}.json"

    def claim(self, node: int) -> str:
        return f"{self._base}{CLAIMS}/node-{node}.json"

    @property
    def claims_prefix(self) -> str:
        return f"{self._base}{CLAIMS}/"

    @property
    def node_records_prefix(self) -> str:
        """The prefix of this save's node records (one listing polls them all)."""
        return f"{self._base}{NODE_RECORDS}/"

    def prefixes(self) -> list[str]:
        """Every prefix that may hold this save's objects (layout 1: the whole step's)."""
        return [self._base, *self.strategy.hashed_prefixes(self._base)]

    def listed_prefixes(self, *, also_hashed: bool = False) -> list[str]:
        """The prefixes a cleanup of this save lists: its own, and the hashed ones where its
        strategy (or ``also_hashed``: the writer's own) spreads data there."""
        hashed = self.strategy.hashed or also_hashed
        return self.prefixes() if hashed else [self._base]

    def owns(self, key: str) -> bool:
        """Whether ``key`` is one of this save's objects by our exact name grammar (never the
        step's marker, nor anything else someone put under the save's prefixes). Hashed
        prefixes hold data files only."""
        for prefix in self.prefixes():
            if key.startswith(prefix):
                rest = key[len(prefix) :]
                if prefix.startswith(f"{HASHED_DATA}/"):
                    return is_data_file(rest)
                return is_save_object(rest)
        return False


def marker_body(
    step: str,
    save_id: str,
    committed_at_ns: int,
    strategy: PrefixStrategy,
    run_id: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "step": step,
        "save_id": save_id,
        "committed_at_ns": committed_at_ns,
        **strategy.record(),
        "layout": REMOTE_LAYOUT,
    }
    if run_id is not None:
        body["run_id"] = run_id
    return body


def run_of(record: Mapping[str, Any]) -> str | None:
    """The run id a marker, claim or node record names (None: written before run ids)."""
    value = record.get("run_id")
    return value if isinstance(value, str) else None


def latest_body(step: str, marker: Mapping[str, Any]) -> dict[str, Any]:
    """The ``latest`` pointer's content: the step and the marker that committed it."""
    return {"step": step, "marker": dict(marker)}


def keys_of_marker(step: str, marker: Mapping[str, Any]) -> RemoteKeys:
    """The keys of the save a marker commits. Its fields come from storage: a save id that
    is not one of ours could name a path elsewhere, so it is refused, not used."""
    strategy = PrefixStrategy.of_record(marker)
    if marker.get("layout", 1) == 1:
        return RemoteKeys(step, None, strategy)
    if marker.get("layout") != REMOTE_LAYOUT or not is_save_id(marker.get("save_id")):
        raise ValueError(
            f"unsupported marker (layout {marker.get('layout')!r}, save id "
            f"{marker.get('save_id')!r})"
        )
    return RemoteKeys(step, str(marker["save_id"]), strategy)


def quarantine_record_key(step: str, save_id: str) -> str:
    return f"{step}/{REMOTE_QUARANTINE}/{save_id}.json"


def save_id_of_key(step: str, key: str) -> str | None:
    """The save id whose layout-2 prefix holds ``key`` of ``step``, or None."""
    if key.startswith(f"{HASHED_DATA}/"):  # data/<h>/STEP/...: any count of prefixes
        bucket, _, rest = key[len(HASHED_DATA) + 1 :].partition("/")
        key = rest if bucket and rest else key
    prefix = f"{step}/"
    if not key.startswith(prefix):
        return None
    head = key[len(prefix) :].split("/", 1)
    return head[0] if len(head) == 2 and is_save_id(head[0]) else None


def probe_key(token: str) -> str:
    """The key of one checksum probe's object (``token``: 16 hex digits, unique per probe)."""
    key = f"{REMOTE_PROBE}/crc32c-{token}"
    if not _PROBE_RE.fullmatch(key):
        raise ValueError(f"not a probe token: {token!r}")
    return key


def is_probe_key(key: str) -> bool:
    return bool(_PROBE_RE.fullmatch(key))
