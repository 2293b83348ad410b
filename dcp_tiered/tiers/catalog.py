"""Which steps exist, on which tier, and what 'latest' means across tiers; where a step's
manifest comes from, how durable each step is, which saves are still being written."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from ..backends.remote import RemoteBackend
from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    ManifestError,
    TierError,
    TierUnavailableError,
)
from ..policy import layout, step_names
from ..policy.identity import Owner
from ..policy.manifest import Manifest
from ..policy.step_names import StepNames
from .local import LocalTier
from .remote import Durability, RemoteTier
from .step_record import CommittedStep, remote_only

logger = logging.getLogger(__name__)


def list_steps(
    tier: LocalTier, remote: RemoteBackend | None, *, strict: bool = False
) -> list[CommittedStep]:
    """Committed steps on both tiers, oldest first. An unreadable remote raises
    TierUnavailableError with ``strict``; otherwise it is logged and left out."""
    found = {s.name: s for s in tier.steps()}
    listed: list[tuple[str, int, str | None, str | None]] = []
    if remote is not None:
        try:
            listed = remote_steps(remote)
        except TierUnavailableError as e:
            if strict:
                raise
            logger.warning("looking at %s only: %s", tier.root, e)
    for name, committed_at, run_id, save_id in listed:
        _add_remote(found, name, committed_at, run_id, save_id)
    return sorted(found.values(), key=lambda s: s.committed_at_ns)


def numbered_steps(
    tier: LocalTier, remote: RemoteBackend | None, names: StepNames, *, strict: bool = False
) -> list[tuple[int, CommittedStep]]:
    """A framework's committed steps on both tiers (those named exactly as ``names`` builds
    them; any other directory is not its step and is left out), with their numbers, oldest
    first. ``strict`` as for :func:`list_steps`."""
    found = list_steps(tier, remote, strict=strict)
    return sorted(
        ((n, s) for s in found if (n := names.parse(s.name)) is not None), key=lambda ns: ns[0]
    )


def _add_remote(
    found: dict[str, CommittedStep],
    name: str,
    committed_at: int,
    run_id: str | None = None,
    save_id: str | None = None,
) -> None:
    local = found.get(name)
    found[name] = (
        local.also_remote(committed_at, save_id)
        if local
        else remote_only(name, committed_at, run_id)
    )


def _unavailable(remote: RemoteBackend, e: Exception) -> TierUnavailableError:
    return TierUnavailableError(
        f"cannot read the remote tier {remote.config.url}: {e}. Which steps exist "
        "there is unknown, so nothing was restored: fix the remote's address, "
        "credentials or reachability (the cause above) and restore again"
    )


def remote_steps(remote: RemoteBackend) -> list[tuple[str, int, str | None, str | None]]:
    """``(step, committed_at_ns, run_id, save_id)`` of every step committed on the remote: one listing of the
    root (and one per step prefix, as s3fs globs) and a GET per marker. TierUnavailableError
    if the remote cannot be read."""
    try:
        names = RemoteTier(remote).steps()
    except TierError as e:
        raise _unavailable(remote, e) from e
    out = []
    for name in names:
        try:
            marker = RemoteTier(remote).marker(name)
        except ManifestError as e:  # that step is unreadable; the others are listed
            logger.warning("ignoring remote step %s: %s", name, e)
            continue
        except TierError as e:
            raise _unavailable(remote, e) from e
        if marker is not None:
            save_id = marker.get("save_id")
            out.append(
                (
                    name,
                    int(marker["committed_at_ns"]),
                    layout.run_of(marker),
                    save_id if isinstance(save_id, str) else None,
                )
            )
    return out


def remote_latest(remote: RemoteBackend) -> tuple[str, int] | None:
    """The newest committed step on the remote as ``(step, committed_at_ns)``, or None.

    Two GETs: the root's ``latest`` pointer and the marker of the step it names. Only when
    the pointer is missing (a root written before it existed), unreadable, or stale (its step
    has no marker of the save it names: quarantined, deleted, or a save that never committed)
    is the root listed, as :func:`remote_steps` does. TierUnavailableError if the remote
    cannot be read. The result is plain data, so one rank can resolve it for all."""
    try:
        got = RemoteTier(remote).read_latest()
        if got is not None and got[0] is not None:
            name, named = str(got[0]["step"]), got[0]["marker"]
            marker = RemoteTier(remote).marker(name)
            if marker is not None and marker.get("save_id") == named.get("save_id"):
                return name, int(marker["committed_at_ns"])
            logger.info("the latest pointer of %s is stale (%s): listing", remote, name)
    except ManifestError as e:
        logger.warning("unreadable marker behind the latest pointer of %s: %s", remote, e)
    except TierError as e:
        raise _unavailable(remote, e) from e
    listed = [(name, at) for name, at, _, _ in remote_steps(remote)]
    newest = step_names.newest(listed)
    return None if newest is None else next(s for s in listed if s[0] == newest)


def resolve(
    tier: LocalTier,
    remote: RemoteBackend | None,
    checkpoint_id: str | os.PathLike[str] | None,
) -> CommittedStep:
    """Map 'latest' (or None) or a step name to a committed step on some tier, or raise.

    On the remote, 'latest' costs two GETs (:func:`remote_latest`), a step name one (its
    marker); the root is listed only for a root without a valid ``latest`` pointer, or to
    name the committed steps when the one asked for is missing."""
    where = tier.root + (f" or {remote.config.url}" if remote is not None else "")
    latest = checkpoint_id is None or checkpoint_id == layout.LATEST
    if not latest and not isinstance(checkpoint_id, str):
        raise ConfigError(
            f"checkpoint_id must be a step name or 'latest', got {checkpoint_id!r}; "
            "the directory is given to the reader's constructor"
        )
    if not latest:
        layout.validate_step_name(checkpoint_id)
    if latest:
        found = {s.name: s for s in list_steps(tier, None)}
    else:  # the one step asked for: a root of many steps is not listed to find it
        assert isinstance(checkpoint_id, str)
        info = tier.info(checkpoint_id)
        found = {} if info is None else {info.name: info}
    if remote is not None:
        try:
            if latest:
                top = remote_latest(remote)
                if top is not None:
                    _add_remote(found, *top)
            else:
                assert isinstance(checkpoint_id, str)
                marker = _marker(remote, checkpoint_id)
                if marker is not None:
                    _add_remote(found, checkpoint_id, marker)
        except ManifestError as e:  # the remote copy of that step is unreadable
            if checkpoint_id not in found:
                raise
            logger.warning("using the local %s of %s only: %s", checkpoint_id, tier.root, e)
        except TierUnavailableError as e:
            if not found:  # "no checkpoint" would be a guess: say what is wrong instead
                raise
            logger.warning(
                "remote tier unavailable (%s); resolving %r among the local steps of %s",
                e,
                checkpoint_id or layout.LATEST,
                tier.root,
            )
    steps = sorted(found.values(), key=lambda s: s.committed_at_ns)
    if latest:
        # The root's own newest: another run's step (copied in) is loaded only by name.
        try:
            record = tier.record()
        except ManifestError as e:  # reading never depends on it
            logger.warning("%s", e)
            record = None
        if record is not None:
            steps = [s for s in steps if record.owner(s.run_id, s.name, s.save_id) != Owner.FOREIGN]
        name = step_names.newest((s.name, s.committed_at_ns) for s in steps)
        if name is None:
            raise CheckpointNotFoundError(
                f"no committed step in {where}: nothing to load for 'latest'. Check the paths, "
                "or save a checkpoint first."
            )
        return found[name]
    assert isinstance(checkpoint_id, str)
    if checkpoint_id in found:
        return found[checkpoint_id]
    try:  # the error names what there is: one listing, on this path only
        steps = list_steps(tier, remote)
    except TierError:
        pass
    existing = ", ".join(s.name for s in steps) or "none"
    raise CheckpointNotFoundError(
        f"step {checkpoint_id!r} not found in {where}. Committed steps: {existing}."
    )


def _marker(remote: RemoteBackend, name: str) -> int | None:
    """The commit time of remote step ``name`` from its marker (one GET), None if it has none;
    ManifestError (logged) if its marker is not one dcp_tiered wrote."""
    try:
        marker = RemoteTier(remote).marker(name)
    except TierError as e:
        raise _unavailable(remote, e) from e
    except ManifestError as e:
        logger.warning("remote step %s is unreadable: %s", name, e)
        raise
    return None if marker is None else int(marker["committed_at_ns"])


def remote_latest_step(remote: RemoteBackend) -> str:
    """The name of the newest committed step on the remote (:func:`remote_latest`: the
    ``latest`` pointer, else a listing); CheckpointNotFoundError if there is none."""
    top = remote_latest(remote)
    if top is None:
        raise CheckpointNotFoundError(f"no committed step on {remote.config.url}")
    return top[0]


def remote_manifest(remote: RemoteBackend, step: str) -> tuple[Manifest, layout.RemoteKeys]:
    """The manifest of the save committed as ``step`` on ``remote``, and its keys."""
    keys = RemoteTier(remote).keys_of(step)
    if keys is None:
        raise CheckpointNotFoundError(
            f"step {step!r} is not committed on {remote.config.url}; "
            f"`dcp-tiered status ROOT --remote {remote.config.url}` lists the steps there"
        )
    return RemoteTier(remote).read_manifest(keys), keys


def step_manifest(tier: LocalTier, remote: RemoteBackend | None, step: str) -> tuple[Manifest, str]:
    """The manifest of ``step`` ('latest' resolved on both tiers), from the local tier if it
    holds the step (with the other nodes' sections merged in from the remote, for a node's
    directory that holds its own only), else from the remote; and which tier it came from:
    ``local``, ``local+remote`` or ``remote``. ManifestError for a vanilla DCP directory."""
    name = resolve(tier, remote, step).name
    if tier.has_step(name):
        if not tier.backend.exists(name, layout.MANIFEST_NAME):
            raise ManifestError(
                f"{tier.root}/{name} is a vanilla DCP checkpoint without a "
                "manifest: it cannot be inspected without reading its data"
            )
        m = tier.read_manifest(name)
        keys = RemoteTier(remote).keys_of(name) if remote and not m.complete else None
        if keys is not None and keys.save_id == m.save_id:
            # A node's directory holds its own section: the others are on the remote.
            assert remote is not None
            return RemoteTier(remote).merge_sections(keys, m, m.sections), "local+remote"
        return m, "local"
    assert remote is not None  # resolve found it on some tier
    return remote_manifest(remote, name)[0], "remote"


@dataclass(frozen=True)
class HiddenStep:
    """A step directory that is not a committed step: a save being written (``in-progress``),
    one whose writer died (``abandoned``, swept by the next writer), or a ``quarantined`` save."""

    step: str
    path: str  # the directory's name under the root
    state: str


def hidden_steps(tier: LocalTier) -> list[HiddenStep]:
    """The local tier's saves in progress, abandoned and quarantined, in listing order."""
    out = []
    for name in tier.backend.list_names():
        parsed = layout.parse_hidden_dir(name)
        if parsed and parsed[2] == layout.TMP_SUFFIX:
            busy = tier.backend.exists(name, layout.LOCK_NAME) and tier.backend.is_locked(name)
            out.append(HiddenStep(parsed[0], name, "in-progress" if busy else "abandoned"))
        elif parsed and parsed[2] == layout.QUARANTINE_SUFFIX:
            out.append(HiddenStep(parsed[0], name, "quarantined"))
    return out


def in_progress(tier: LocalTier) -> set[str]:
    """Steps with a save directory on the local tier that has not committed (yet): being
    written, or abandoned by a writer that died."""
    return layout.unfinished_steps(tier.backend.list_names())


def durability_of(*, local: bool, remote: bool, memory: bool, copies: bool) -> Durability:
    """How durable a step is from where it was found: the remote tier, a committed local
    directory, this node's memory tier, partners' copies (peer replication), else only a save
    in progress."""
    if remote:
        return Durability.DURABLE_REMOTE
    if local:
        return Durability.COMMITTED_LOCAL
    if memory:
        return Durability.MEMORY
    return Durability.PEER_COPIES if copies else Durability.STAGED


def local_holds_whole(tier: LocalTier, step: str, save_id: str) -> bool:
    """The local tier holds save ``save_id`` of ``step`` whole (not only an adopted manifest)."""
    if not tier.has_step(step) or not tier.backend.exists(step, layout.MANIFEST_NAME):
        return False
    try:
        m = tier.read_manifest(step)
    except (ManifestError, OSError):
        return False
    return m.save_id == save_id and all(tier.backend.exists(step, n) for n in m.files)


def another_copy(
    tier: LocalTier,
    remote: RemoteBackend | None,
    step: str,
    *,
    on_remote: bool,
    run_id: str | None,
) -> str | None:
    """Where another whole copy of ``step`` is (the local root or the remote URL), besides
    the tier it would be deleted from (the remote with ``on_remote``, else the local tier), or
    None. Deleting a local step requires it to be run ``run_id``'s (ForeignPathError
    otherwise). TierError if a tier cannot tell: the step may be the only durable copy."""
    if on_remote:
        assert remote is not None
        keys = RemoteTier(remote).keys_of(step)
        if keys is None:
            raise CheckpointNotFoundError(f"step {step!r} is not committed on {remote.config.url}")
        if keys.save_id and local_holds_whole(tier, step, keys.save_id):
            return tier.root
        return None
    tier.require_ours(step, run_id)  # never another run's, a copy, or a vanilla dir
    if remote is not None and RemoteTier(remote).holds_whole(tier.read_manifest(step)):
        return remote.config.url
    return None
