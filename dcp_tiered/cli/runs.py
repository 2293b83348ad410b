"""The CLI's commands about whose steps are whose: ``adopt`` and ``quarantine``.

``adopt`` hands steps to the run a root records (steps saved before run identities, or by
another run, which dcp_tiered otherwise only reads): from then on retention, ``rm``,
quarantine and uploads treat them as the run's own. ``quarantine`` moves one of the run's steps
aside by hand (what a restore does to a step proven bad), or with ``--release`` gives a
quarantined save its name back. Each act is logged and listed in the output."""

from __future__ import annotations

from ..backends.remote import RemoteBackend
from ..errors import CheckpointNotFoundError, ConfigError
from ..policy import identity, layout
from ..policy.identity import Owner
from ..tiers import ownership
from ..tiers.remote import RemoteTier
from ._base import OK
from ._context import Run


def cmd_adopt(run: Run) -> int:
    tier, args = run.tier, run.args
    record = tier.record()
    if record is None:
        run_id = identity.validate_run_id(args.run_id) if args.run_id else identity.new_run_id()
        record = ownership.record_local(tier.backend, run_id)
    elif args.run_id and args.run_id != record.run_id:
        raise ConfigError(
            f"{tier.root} belongs to {record.describe()}; adopt hands steps to that run only"
        )
    adopted: list[dict[str, str]] = []
    if args.remote is not None:
        remote = run.need_remote(args.remote or None)
        there = ownership.record_remote(remote, record.run_id, tier.root)
        saves = _remote_saves(run, remote, there, args.steps)
        if saves:
            ownership.save_remote(remote, there.adopting(saves))
        where = remote.config.url
    else:
        saves = _local_saves(run, record, args.steps)
        if saves:
            ownership.save_local(tier.backend, record.adopting(saves))
        where = tier.root
    for step, sid in saves:
        adopted.append({"step": step, "save_id": sid, "where": where})
        run.say(f"adopted {step} (save {sid}) in {where} into run {record.run_id}")
    if not saves:
        run.say(f"nothing to adopt in {where}: every step there is run {record.run_id}'s")
    run.fields.update(run_id=record.run_id, adopted=adopted)
    return OK


def _local_saves(run: Run, record: identity.RunRecord, names: list[str]) -> list[tuple[str, str]]:
    steps = {s.name: s for s in run.tier.steps()}
    for name in names:
        if name not in steps:
            raise CheckpointNotFoundError(f"step {name!r} is not committed in {run.tier.root}")
        if not steps[name].verified_format or not steps[name].save_id:
            raise ConfigError(
                f"{run.tier.root}/{name} has no readable dcp_tiered manifest: there is no save "
                "to adopt (a vanilla DCP directory stays as it is)"
            )
    chosen = [steps[n] for n in names] if names else list(steps.values())
    return sorted(
        (s.name, s.save_id)
        for s in chosen
        if s.verified_format and s.save_id and s.owner(record) != Owner.OURS
    )


def _remote_saves(
    run: Run, remote: RemoteBackend, record: identity.RunRecord, names: list[str]
) -> list[tuple[str, str]]:
    out = []
    on_remote = RemoteTier(remote)
    for name in names or on_remote.steps():
        marker = on_remote.marker(layout.validate_step_name(name))
        if marker is None:
            raise CheckpointNotFoundError(f"step {name!r} is not committed on {remote.config.url}")
        sid = str(marker.get("save_id"))
        if record.owner(layout.run_of(marker), name, sid) != Owner.OURS:
            out.append((name, sid))
    return sorted(out)


def cmd_quarantine(run: Run) -> int:
    tier, args = run.tier, run.args
    step = layout.validate_step_name(args.step)
    record = tier.record()
    if record is None:
        raise ConfigError(f"{tier.root} records no run: nothing there is a run's to quarantine")
    on_remote = args.remote is not None
    remote = run.need_remote(args.remote or None) if on_remote else None
    where = remote.config.url if remote is not None else tier.root
    if args.release:
        save_id = args.save_id or _only_quarantined(run, remote, step)
        if remote is not None:
            RemoteTier(remote).release(step, save_id, run_id=record.run_id)
        else:
            tier.release_quarantined(step, save_id, run_id=record.run_id)
        run.say(f"released {step} (save {save_id}) from quarantine in {where}")
        run.fields.update(step=step, save_id=save_id, released=True, where=where)
        return OK
    reason = args.reason or "dcp-tiered quarantine"
    if remote is not None:
        done = RemoteTier(remote).quarantine(step, reason=reason, run_id=record.run_id)
    else:
        done = tier.quarantine(step, reason=reason, run_id=record.run_id) is not None
    if not done:
        raise CheckpointNotFoundError(f"step {step!r} is not committed in {where}")
    run.say(f"quarantined {step} in {where}: `--release` undoes it")
    run.fields.update(step=step, released=False, where=where)
    return OK


def _only_quarantined(run: Run, remote: RemoteBackend | None, step: str) -> str:
    if remote is not None:
        saves = sorted(RemoteTier(remote).quarantined_saves(step))
    else:
        saves = [sid for name, sid in run.tier.quarantined() if name == step]
    if not saves:
        where = remote.config.url if remote is not None else run.tier.root
        raise CheckpointNotFoundError(
            f"{step} has no quarantined save in {where}: nothing to release (`dcp-tiered ls` "
            "lists what is quarantined)"
        )
    if len(saves) > 1:
        raise ConfigError(
            f"{len(saves)} quarantined saves of {step} ({', '.join(saves)}): name one with "
            "--save-id"
        )
    return saves[0]
