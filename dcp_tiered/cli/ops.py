"""The CLI's commands that change a tier: ``pull``, ``rm``, ``prune``. Each goes through the
tiers' own functions (hydration's atomic commit, ``LocalTier.delete_step``,
``RemoteTier.delete``, the retention pass the manager runs), so it keeps their guarantees;
every delete is logged by the backend (the CLI shows those logs on stderr) and listed in the
output."""

from __future__ import annotations

import time

from ..errors import CheckpointExistsError, CheckpointNotFoundError, TierError
from ..policy import layout
from ..policy.retention import RetentionPolicy
from ..tiers import catalog, housekeeping, ownership, pull
from ..tiers.remote import RemoteTier
from ._base import OK, UNREADABLE, USAGE, human
from ._context import Run, progress


def cmd_pull(run: Run) -> int:
    """Copy a durable remote step into the local tier, each file checked against the
    manifest as it arrives, committed like a save (temporary directory, rename): an
    interrupted pull leaves no local step that looks committed but misses files."""
    tier, remote = run.tier, run.need_remote()
    step = run.args.step
    if step == layout.LATEST:
        step = catalog.remote_latest_step(remote)
    layout.validate_step_name(step)
    keys = RemoteTier(remote).keys_of(step)
    if keys is None:
        raise CheckpointNotFoundError(
            f"step {step!r} is not committed on {remote.config.url}; "
            f"`dcp-tiered status {tier.root}` lists the steps there"
        )
    m = RemoteTier(remote).read_manifest(keys)
    if tier.has_step(step):
        here = tier.read_manifest(step)
        if here.save_id != m.save_id:
            raise CheckpointExistsError(
                f"{tier.root}/{step} is another save ({here.save_id}) than the remote one "
                f"({m.save_id}); they are never mixed. Remove the local one first "
                f"(dcp-tiered rm {tier.root} {step}) if the remote one is wanted"
            )
    names = sorted(n for n in m.files if not tier.backend.exists(step, n))
    total = sum(int(m.files[n]["size"]) for n in names)
    started = time.monotonic()
    if names:
        with progress(total, f"pull {step}", run) as bar:
            pull.hydrate_step(tier, remote, step, m, names, keys, progress=bar.update)
    seconds = time.monotonic() - started
    joined = _join_remote_run(run, m.run_id)
    run.fields.update(
        run_id=joined,
        step=step,
        save_id=m.save_id,
        world_size=m.world_size,
        files=len(names),
        bytes=total,
        seconds=round(seconds, 3),
        already_local=not names,
    )
    run.say(
        f"{step}: already complete in {tier.root}"
        if not names
        else f"{step}: {len(names)} files, {human(total)} from {remote.config.url} to "
        f"{tier.root}/{step} in {seconds:.1f} s, every file verified"
    )
    return OK


def _join_remote_run(run: Run, step_run: str | None) -> str | None:
    """A root that records no run yet (a fresh node's) takes the remote's, when the pulled
    step is that run's: the step is then the root's own (``ls`` shows it so, and a manager
    started there continues the run). Any other root keeps its record. The root's run id."""
    tier, remote = run.tier, run.need_remote()
    found = tier.record()
    if found is not None or step_run is None:
        return None if found is None else found.run_id
    there = ownership.read_remote(remote)
    if there is None or there.run_id != step_run:
        return None
    return ownership.record_local(tier.backend, step_run).run_id


def cmd_rm(run: Run) -> int:
    tier, args = run.tier, run.args
    step = layout.validate_step_name(args.step)
    on_remote = args.remote is not None
    remote = run.remote(args.remote or None)  # rm's --remote: "" = the recorded URL
    if on_remote and remote is None:
        run.need_remote()
    other = None  # where another whole copy of this save is, if anywhere
    record = tier.record()
    run_id = record.run_id if record is not None else None
    try:
        other = catalog.another_copy(tier, remote, step, on_remote=on_remote, run_id=run_id)
    except TierError as e:
        if not args.force:
            run.error(
                TierError(
                    f"cannot tell whether {step} has another durable copy ({e}); "
                    "nothing was deleted. Use --force to delete it anyway"
                )
            )
            return UNREADABLE
    where = remote.config.url if on_remote and remote is not None else tier.root
    if other is None and not args.force:
        run.error(
            CheckpointExistsError(
                f"{where}/{step} is the only durable copy of {step}: nothing was deleted. "
                "Pull or upload it elsewhere first, or give --force to delete it anyway"
            )
        )
        return USAGE
    reason = "dcp-tiered rm" + (" --force (the only durable copy)" if other is None else "")
    if on_remote:
        assert remote is not None
        RemoteTier(remote).delete(step, reason=reason, run_id=run_id)
    else:
        tier.delete_step(step, reason=reason)
    run.fields.update(
        step=step,
        deleted=[{"tier": "remote" if on_remote else "local", "step": step, "where": where}],
        other_copy=other,
    )
    run.say(f"deleted {step} from {where}" + (f" (a copy remains on {other})" if other else ""))
    return OK


def cmd_prune(run: Run) -> int:
    """Retention by hand on the local tier. Never deletes the newest step, a milestone
    (``--keep-every``), or a step not yet durable on the remote (or when the remote cannot
    tell); a root without a remote has no lower tier, so its steps go by the policy alone."""
    tier, args = run.tier, run.args
    policy = RetentionPolicy(keep_latest=args.keep_latest, keep_every=args.keep_every)
    remote = run.remote()
    if remote is not None:
        try:
            RemoteTier(remote).steps()
        except TierError as e:
            run.error(
                TierError(
                    f"cannot read the remote tier {remote.config.url} to tell which "
                    f"steps are durable there ({e}); nothing was deleted"
                )
            )
            return UNREADABLE
    pruned = housekeeping.local_pass(tier, policy, remote, label="local", dry_run=args.dry_run)
    deleted, kept, held = pruned.deleted, pruned.kept, pruned.held
    run.fields.update(dry_run=args.dry_run, deleted=deleted, kept=kept, kept_not_durable=held)
    verb = "would delete" if args.dry_run else "deleted"
    for name in deleted:
        run.say(f"{verb} {tier.root}/{name}")
    for name in held:
        run.say(f"kept {name}: not durable on {remote.config.url if remote else '-'} yet")
    run.say(f"{len(deleted)} {verb.split()[-1]}, {len(kept)} kept")
    return OK
