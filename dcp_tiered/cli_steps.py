"""The CLI's read-only commands: ``ls``, ``verify``, ``status``, ``inspect``; and ``Run``, what
every command gets. Imported by :mod:`dcp_tiered.cli` only after the arguments are parsed (it
imports torch). Each command fills ``run.fields`` (its part of the ``--json`` object, schema in
docs/cli.md) and prints a table unless ``--json``."""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
from typing import Any

from .backends.local import LocalBackend
from .backends.remote import RemoteBackend, remote_backend
from .cli import OK, PROBLEM, UNREADABLE, error_entry
from .config import RemoteConfig, RetryConfig
from .errors import (
    CheckpointNotFoundError,
    ConfigError,
    ManifestError,
    TierError,
    TierUnavailableError,
)
from .policy import integrity, layout, manifest, records
from .policy.identity import Owner
from .tiers import catalog, replica
from .tiers import memory as memory_tier
from .tiers import remote as remote_tier
from .tiers.local import LocalTier

logger = logging.getLogger(__name__)


class Run:
    """One command's arguments, local tier, output and errors."""

    def __init__(
        self, args: argparse.Namespace, fields: dict[str, Any], errors: list[dict[str, str]]
    ) -> None:
        self.args, self.fields, self.errors = args, fields, errors
        self.tier = LocalTier(LocalBackend(args.root))
        fields["root"] = self.tier.root

    def say(self, text: str = "") -> None:
        if not self.args.json:
            print(text)

    def error(self, e: BaseException) -> None:
        print(f"dcp-tiered: {e}", file=sys.stderr)
        self.errors.append(error_entry(e))

    def recorded(self) -> dict[str, Any]:
        """The tiers the writer or manager recorded in the root (never credentials)."""
        backend = self.tier.backend
        try:
            data = backend.read_file(layout.TIERS_RECORD, limit=records.MAX_RECORD_BYTES)
            return records.tiers_record(data, where=backend.path_of(layout.TIERS_RECORD))
        except FileNotFoundError:
            return {}
        except (OSError, ManifestError) as e:  # give --remote / --memory instead
            logger.warning("ignoring %s: %s", backend.path_of(layout.TIERS_RECORD), e)
            return {}

    def remote(self, url: str | None = None) -> RemoteBackend | None:
        """The remote tier: ``url``, else ``--remote``, else the one recorded in the root."""
        url = url or getattr(self.args, "remote", None) or self.recorded().get("remote")
        self.fields["remote"] = url
        # Two attempts, not eight: an operator wants the answer, not a minute of retries.
        return remote_backend(
            RemoteConfig(url=url, retry=RetryConfig(max_attempts=2)) if url else None
        )

    def need_remote(self, url: str | None = None) -> RemoteBackend:
        remote = self.remote(url)
        if remote is None:
            raise ConfigError(f"{self.tier.root} records no remote tier: give --remote URL")
        return remote


def human(n: float) -> str:
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            break
        n /= 1024
    return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"


def iso(ns: int) -> str | None:
    if ns < 0:
        return None
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).isoformat(
        timespec="seconds"
    )


def progress(total: int, desc: str, run: Run) -> Any:
    """A tqdm bar (stderr) for work over 256 MiB; smaller work finishes before it would help."""
    from tqdm import tqdm

    return tqdm(
        total=total, unit="B", unit_scale=True, desc=desc, leave=False, disable=total < 256 * 2**20
    )


def cmd_ls(run: Run) -> int:
    tier = run.tier
    record = tier.record()
    run.fields["run_id"] = record.run_id if record else None
    rows: list[dict[str, Any]] = []
    for s in sorted(tier.steps(), key=lambda s: s.committed_at_ns):
        row: dict[str, Any] = {
            "step": s.name,
            "bytes": sum(
                tier.backend.file_size(s.name, f) for f in tier.backend.list_files(s.name)
            ),
            "run_id": s.run_id,
            "owner": s.owner(record).value,
        }
        if s.verified_format:
            try:
                world_size = tier.read_manifest(s.name).world_size
            except (ManifestError, OSError) as e:  # that step is unreadable; list the rest
                logger.warning("%s", e)
                row.update(state="unreadable", world_size=None, committed_at=None, error=str(e))
                rows.append(row)
                continue
            row.update(
                state="committed", world_size=world_size, committed_at=iso(s.committed_at_ns)
            )
        else:
            row.update(state="vanilla", world_size=None, committed_at=None)
        rows.append(row)
    for name in tier.backend.list_names():
        parsed = layout.parse_hidden_dir(name)
        if parsed and parsed[2] == layout.TMP_SUFFIX:
            busy = tier.backend.exists(name, layout.LOCK_NAME) and tier.backend.is_locked(name)
            rows.append(
                {
                    "step": parsed[0],
                    "bytes": None,
                    "state": "in-progress" if busy else "abandoned",
                    "path": name,
                }
            )
        elif parsed and parsed[2] == layout.QUARANTINE_SUFFIX:
            rows.append({"step": parsed[0], "bytes": None, "state": "quarantined", "path": name})
    run.fields["steps"] = rows
    run.say(f"run: {record.run_id if record else '- (none recorded yet)'}")
    if not rows:
        run.say(f"no steps in {tier.root}")
        return OK
    width = max(len(r["step"]) for r in rows)
    for r in rows:
        size = "-" if r["bytes"] is None else human(r["bytes"])
        state = {
            "committed": f"committed  world={r.get('world_size')}  {r.get('committed_at')}",
            "vanilla": "vanilla DCP (no manifest: cannot be verified)",
            "unreadable": "UNREADABLE manifest (`dcp-tiered verify` says why)",
            "in-progress": "in progress",
            "abandoned": "abandoned (swept by the next writer)",
            "quarantined": f"quarantined as {r.get('path')} (a restore fell back past it; "
            "kept for inspection, delete it by hand)",
        }[r["state"]]
        run.say(f"{r['step']:<{width}}  {size:>10}  {state}{_whose(r)}")
    return OK


def _whose(row: dict[str, Any]) -> str:
    """What the listing says of a step that is not the run's own (it is never deleted,
    quarantined or restored by the run; `dcp-tiered adopt` makes it the run's)."""
    owner = row.get("owner")
    if owner == "foreign":
        run_id = row.get("run_id")
        return f"  [foreign: run {run_id}]" if run_id else "  [foreign: not the run's]"
    if owner == "unowned" and row.get("state") == "committed":
        return "  [unowned: saved before run ids; adopt to own]"
    return ""


def cmd_verify(run: Run) -> int:
    tier, step = run.tier, run.args.step
    steps = [catalog.resolve(tier, None, step).name] if step else [s.name for s in tier.steps()]
    verified = {s.name: s.verified_format for s in tier.steps()}
    results = []
    for name in steps:
        if not verified[name]:
            problems = ["vanilla DCP checkpoint without a manifest, cannot be verified"]
            run.say(f"{name}: {problems[0]}")
        else:
            try:
                problems = _verify_step(run, name)
            except (ManifestError, OSError) as e:  # this step only: the others are verified
                problems = [f"{type(e).__name__}: {e}"]
            run.say(f"{name}: " + ("OK" if not problems else "CORRUPT\n  " + "\n  ".join(problems)))
        results.append({"step": name, "ok": not problems, "problems": problems})
    run.fields["steps"] = results
    return PROBLEM if any(not r["ok"] for r in results) else OK


def _verify_step(run: Run, step: str) -> list[str]:
    tier = run.tier
    m = tier.read_manifest(step)
    total = sum(int(f["size"]) for f in m.files.values())
    problems = []
    with progress(total, step, run) as bar:
        for name, info in sorted(m.files.items()):
            if not tier.backend.exists(step, name):
                problems.append(f"{name}: missing")
                continue
            size = tier.backend.file_size(step, name)
            if size != int(info["size"]):
                problems.append(f"{name}: {size} bytes, manifest says {info['size']}")
                continue
            crc = tier.backend.file_checksum(step, name, progress=bar.update)
            if crc != info["checksum"]:
                problems.append(
                    f"{name}: {integrity.ALGORITHM} {crc} != manifest {info['checksum']}"
                )
    return problems


def _in_progress(tier: LocalTier) -> set[str]:
    return {
        p[0]
        for n in tier.backend.list_names()
        if (p := layout.parse_hidden_dir(n)) and p[2] == layout.TMP_SUFFIX
    }


def cmd_status(run: Run) -> int:
    """Every step of every tier, and how durable it is. A tier that cannot be read is named
    (stderr, and ``unreadable`` in JSON) and the exit status is 3: its steps are unknown."""
    tier = run.tier
    memory = run.args.memory or run.recorded().get("memory")
    remote = run.remote()
    rows: dict[str, dict] = {}
    for name in memory_tier.list_steps(memory) if memory else {}:
        rows.setdefault(name, {})["memory"] = True
    for name, ranks in replica.list_copies(memory).items() if memory else ():
        rows.setdefault(name, {})["copies_of_ranks"] = ranks  # peer replication
    unreadable: dict[str, str] = {}
    try:
        listed = catalog.list_steps(tier, remote, strict=True)
    except TierUnavailableError as e:
        unreadable["remote"] = str(e)
        run.error(e)
        listed = catalog.list_steps(tier, None)
    record = tier.record()
    run.fields["run_id"] = record.run_id if record else None
    for s in listed:
        row = rows.setdefault(s.name, {})
        row["local"], row["remote"] = s.local, None if unreadable else s.remote
        row["owner"] = (
            record.owner(s.run_id, s.name, s.save_id)
            if record is not None
            else (Owner.UNOWNED if s.run_id is None else Owner.FOREIGN)
        ).value
        if s.local and not s.remote and s.verified_format and remote is not None:
            try:
                row["promote"] = tier.read_manifest(s.name).promote
            except (ManifestError, OSError):
                row["promote"] = False
    for name in _in_progress(tier):
        rows.setdefault(name, {})["saving"] = True
    quarantined = [{"step": n, "save_id": sid, "tier": "local"} for n, sid in tier.quarantined()]
    if remote is not None and not unreadable:
        try:
            quarantined += [
                {"step": n, "save_id": sid, "tier": "remote"}
                for n, sid in remote_tier.quarantined(remote)
            ]
        except TierError as e:
            unreadable["remote"] = str(e)
            run.error(e)
    run.fields["quarantined"] = quarantined
    for row in rows.values():
        row["durability"] = (
            "durable-remote"
            if row.get("remote")
            else "committed-local"
            if row.get("local")
            else "memory"
            if row.get("memory")
            else "copies"
            if row.get("copies_of_ranks")
            else "staged"
        )
        if row.get("promote"):
            row["durability"] += " (remote unreadable)" if unreadable else " (upload pending)"
    ordered = sorted(rows.items(), key=lambda kv: (layout.step_number(kv[0]) or -1, kv[0]))
    status = UNREADABLE if unreadable else OK
    run.fields.update(
        memory=memory, unreadable=unreadable, steps=[{"step": k, **v} for k, v in ordered]
    )
    run.say(
        f"local:  {tier.root}\nmemory: {memory or '-'}\n"
        f"remote: {remote.config.url if remote else '-'}"
        + (" (CANNOT BE READ: its steps are unknown)" if unreadable else "")
    )
    if not ordered:
        run.say("no steps")
        return status
    width = max(len(k) for k, _ in ordered)
    run.say(f"{'step':<{width}}  memory  copies  local  remote  durability")
    mark = {True: "yes", False: "-", None: "?" if unreadable else "-"}
    for name, row in ordered:
        run.say(
            f"{name:<{width}}  {mark[row.get('memory')]:<6}  "
            f"{','.join(map(str, row.get('copies_of_ranks', []))) or '-':<6}  "
            f"{mark[row.get('local')]:<5}  "
            f"{mark[row.get('remote')]:<6}  {row['durability']}{_whose(row)}"
        )
    for q in quarantined:
        run.say(
            f"{q['step']:<{width}}  quarantined on the {q['tier']} tier (save {q['save_id']}; "
            f"`dcp-tiered quarantine {tier.root} {q['step']} --release"
            f"{' --remote' if q['tier'] == 'remote' else ''}` undoes it)"
        )
    return status


def read_step_manifest(run: Run, step: str) -> tuple[manifest.Manifest, str]:
    """The manifest of ``step`` ('latest' resolved on both tiers), from the local tier if it
    holds the step, else from the remote; and which tier it came from."""
    remote = run.remote()
    name = catalog.resolve(run.tier, remote, step).name
    if run.tier.has_step(name):
        if not run.tier.backend.exists(name, layout.MANIFEST_NAME):
            raise ManifestError(
                f"{run.tier.root}/{name} is a vanilla DCP checkpoint without a "
                "manifest: it cannot be inspected without reading its data"
            )
        m = run.tier.read_manifest(name)
        keys = remote_tier.keys_of_step(remote, name) if remote and not m.complete else None
        if keys is not None and keys.save_id == m.save_id:
            # A node's directory holds its own section: the others are on the remote.
            assert remote is not None
            return remote_tier.merge_sections(remote, keys, m, m.sections), "local+remote"
        return m, "local"
    assert remote is not None  # resolve found it on some tier
    return read_remote_manifest(remote, name)[0], "remote"


def read_remote_manifest(
    remote: RemoteBackend, step: str
) -> tuple[manifest.Manifest, layout.RemoteKeys]:
    """The manifest of the save committed as ``step`` on ``remote``, and its keys."""
    keys = remote_tier.keys_of_step(remote, step)
    if keys is None:
        raise CheckpointNotFoundError(
            f"step {step!r} is not committed on {remote.config.url}; "
            f"`dcp-tiered status ROOT --remote {remote.config.url}` lists the steps there"
        )
    return remote_tier.read_manifest(remote, keys), keys


def cmd_inspect(run: Run) -> int:
    """What a step holds, from its manifest alone: no data file is read."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    m, source = read_step_manifest(run, run.args.step)
    ranks: dict[int, dict[str, int]] = {}
    for info in m.files.values():
        r = ranks.setdefault(int(info["rank"]), {"files": 0, "bytes": 0, "items": 0})
        r["files"] += 1
        r["bytes"] += int(info["size"])
    tensors: list[dict[str, Any]] = []
    objects: list[dict[str, Any]] = []
    for fqn, md in sorted(m.metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            chunks = []
            for c in md.chunks:
                loc = m.locations.get(MetadataIndex(fqn, c.offsets))
                chunks.append(
                    {
                        "offsets": list(c.offsets),
                        "sizes": list(c.sizes),
                        "rank": loc.rank if loc else None,
                        "stored_bytes": loc.length if loc else None,
                    }
                )
                if loc:
                    ranks[loc.rank]["items"] += 1
            numel = 1
            for d in md.size:
                numel *= d
            tensors.append(
                {
                    "fqn": fqn,
                    "dtype": str(md.properties.dtype).removeprefix("torch."),
                    "shape": list(md.size),
                    "bytes": numel * md.properties.dtype.itemsize,
                    "chunks": chunks,
                }
            )
        else:
            locs = [loc for idx, loc in m.locations.items() if idx.fqn == fqn]
            for loc in locs:
                ranks[loc.rank]["items"] += 1
            objects.append(
                {
                    "fqn": fqn,
                    "ranks": sorted({loc.rank for loc in locs}),
                    "stored_bytes": sum(loc.length for loc in locs),
                }
            )
    run.fields.update(
        step=m.step,
        source=source,
        # False: a node's directory without a remote to complete it from; only that node's
        # files and items are listed (the other nodes' sections are in their directories).
        complete=m.complete,
        save_id=m.save_id,
        world_size=m.world_size,
        committed_at=iso(m.committed_at_ns),
        bytes=sum(int(f["size"]) for f in m.files.values()),
        ranks=[{"rank": k, **v} for k, v in sorted(ranks.items())],
        tensors=tensors,
        objects=objects,
    )
    f = run.fields
    run.say(
        f"{m.step} ({source})  world={m.world_size}  save={m.save_id}  {f['committed_at']}  "
        f"{len(m.files)} files, {human(f['bytes'])}"
    )
    if not m.complete:
        run.say(
            f"  (this node's part only: sections of nodes {m.missing(m.sections)} are elsewhere)"
        )
    run.say(f"{'rank':>4}  {'files':>5}  {'items':>5}  {'bytes':>10}")
    for r in f["ranks"]:
        run.say(f"{r['rank']:>4}  {r['files']:>5}  {r['items']:>5}  {human(r['bytes']):>10}")
    width = max([len(t["fqn"]) for t in tensors + objects] + [6])
    run.say(f"{'tensor':<{width}}  {'dtype':<9}  {'shape':<16}  {'bytes':>10}  ranks")
    for t in tensors:
        owners = sorted({c["rank"] for c in t["chunks"] if c["rank"] is not None})
        run.say(
            f"{t['fqn']:<{width}}  {t['dtype']:<9}  {'x'.join(map(str, t['shape'])) or '()':<16}"
            f"  {human(t['bytes']):>10}  {','.join(map(str, owners))}"
        )
    for o in objects:
        run.say(
            f"{o['fqn']:<{width}}  {'object':<9}  {'':<16}  {human(o['stored_bytes']):>10}  "
            f"{','.join(map(str, o['ranks']))}"
        )
    return OK
