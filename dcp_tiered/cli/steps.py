"""The CLI's read-only commands: ``ls``, ``verify``, ``status``, ``inspect``. Imported by
:mod:`dcp_tiered.cli` only after the arguments are parsed (it imports torch). Each command fills
``run.fields`` (its part of the ``--json`` object, schema in docs/cli.md) and prints a table
unless ``--json``; what the tiers hold, and how durable, the catalog answers
(:mod:`dcp_tiered.tiers.catalog`)."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import ManifestError, TierError, TierUnavailableError
from ..policy import step_names
from ..policy.retention import StepState
from ..tiers import catalog, housekeeping, memory_slots, replica, verify
from ..tiers.remote import Durability, RemoteTier
from ._base import OK, PROBLEM, UNREADABLE, human, iso
from ._context import Run, progress

logger = logging.getLogger(__name__)


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
    for h in catalog.hidden_steps(tier):  # in progress, abandoned, quarantined
        rows.append({"step": h.step, "bytes": None, "state": h.state, "path": h.path})
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
            "quarantined": f"quarantined as {r.get('path')} (by a restore that fell back past "
            "it, or by hand; kept for inspection: `quarantine --release` puts it back, or "
            "delete it by hand)",
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
    m = run.tier.read_manifest(step)
    with progress(sum(int(f["size"]) for f in m.files.values()), step, run) as bar:
        return verify.local_files(run.tier, step, m, progress=bar.update)


def cmd_status(run: Run) -> int:
    """Every step of every tier, and how durable it is. A tier that cannot be read is named
    (stderr, and ``unreadable`` in JSON) and the exit status is 3: its steps are unknown."""
    tier = run.tier
    memory = run.args.memory or run.recorded().get("memory")
    remote = run.remote()
    rows: dict[str, dict] = {}
    for name in memory_slots.list_steps(memory) if memory else {}:
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
    policy = run.recorded().get("remote_retention")  # the manager's, if one recorded it
    dropped = None
    if remote is not None and policy is not None:
        dropped = housekeeping.RemoteRetention(remote, policy, record.run_id if record else None)
    for s in listed:
        row = rows.setdefault(s.name, {})
        row["local"], row["remote"] = s.local, None if unreadable else s.remote
        if s.remote_other and not unreadable:  # the remote's is another save of the name
            row["remote_save_differs"] = True
        row["owner"] = s.owner(record).value
        if s.local and not s.remote and s.verified_format and remote is not None:
            try:
                row["promote"] = tier.read_manifest(s.name).promote
            except (ManifestError, OSError):
                row["promote"] = False
            if row["promote"] and not unreadable and dropped is not None:
                row["remote_dropped"] = dropped.pruned(StepState(s.name, s.committed_at_ns))
    for name in catalog.in_progress(tier):
        rows.setdefault(name, {})["saving"] = True
    quarantined = [{"step": n, "save_id": sid, "tier": "local"} for n, sid in tier.quarantined()]
    if remote is not None and not unreadable:
        try:
            quarantined += [
                {"step": n, "save_id": sid, "tier": "remote"}
                for n, sid in RemoteTier(remote).quarantined()
            ]
        except TierError as e:
            unreadable["remote"] = str(e)
            run.error(e)
    run.fields["quarantined"] = quarantined
    for row in rows.values():
        row["durability"] = catalog.durability_of(
            local=bool(row.get("local")),
            remote=bool(row.get("remote")),
            memory=bool(row.get("memory")),
            copies=bool(row.get("copies_of_ranks")),
        ).value
        if row.get("remote_save_differs"):  # this save is not the one the remote holds
            row["durability"] = Durability.COMMITTED_LOCAL.value + (
                " (the remote holds another save of this step)"
            )
        elif row.get("remote_dropped"):
            row["durability"] += " (the remote's retention does not keep it: no upload)"
        elif row.get("promote"):
            row["durability"] += " (remote unreadable)" if unreadable else " (upload pending)"
    ordered = sorted(rows.items(), key=lambda kv: (step_names.order_number(kv[0]) or -1, kv[0]))
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


def cmd_inspect(run: Run) -> int:
    """What a step holds, from its manifest alone: no data file is read."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    m, source = catalog.step_manifest(run.tier, run.remote(), run.args.step)
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
