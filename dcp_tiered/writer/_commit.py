"""The local commit of a save: what it may replace (checked before any rank writes), then the
coordinator writes the step's files and publishes its node's directory (with several nodes,
through :class:`~dcp_tiered.tiers.commit.Handshake`, once every node has prepared its own) while
each other node's leader follows in the background. A published step of a save that promotes is
then handed to the uploads."""

from __future__ import annotations

from .. import _torch_compat
from ..backends.local import LocalBackend
from ..errors import CheckpointExistsError, ConfigError, ForeignPathError
from ..policy import layout, manifest, manifest_build
from ..tiers import commit
from ..tiers.local import LocalTier
from ..tiers.root import SaveReport, Tiers
from ._config import WriterConfig
from ._plan import SaveInfo


def other_nodes(save: SaveInfo) -> list[int]:
    """The nodes besides the coordinator's (the coordinator's layout knows every rank's)."""
    node_of = save.layout.node_of
    return sorted(set(node_of) - {node_of[0]})


def check_target(tier: LocalTier, step: str, *, overwrite: bool, run_id: str | None) -> None:
    """Refuse, before any rank writes, a step the commit must not replace: one committed
    already (unless ``overwrite``, and then only one of this run), or a path under the step's
    name that is no step at all."""
    if tier.has_step(step) and not overwrite:
        raise CheckpointExistsError(
            f"step {step!r} is already committed in {tier.root}; choose a new step name "
            "or construct the writer with overwrite=True"
        )
    if tier.has_step(step):
        tier.require_ours(step, run_id)
    if tier.backend.exists(step) and not tier.has_step(step) and not tier.is_pending(step):
        raise ForeignPathError(
            f"{tier.backend.path_of(step)} exists and is not a checkpoint step (no "
            "manifest or DCP .metadata); it was left untouched. Move it away, or save "
            "under another step name."
        )


def publish(tier: LocalTier, save: SaveInfo, overwrite: bool) -> None:
    """This node's temporary directory of the save becomes the step. What an overwrite may
    replace is a step of this run, as :func:`check_target` checked; checked again on what the
    commit actually displaced."""
    commit.publish_step(
        tier.backend,
        save.step,
        save.save_id,
        save.tmp,
        overwrite=overwrite,
        may_replace=lambda old: tier.holds_ours(old, save.step, save.run_id),
    )


def promote(tiers: Tiers, save: SaveInfo, report: SaveReport) -> None:
    """A published step of a save that promotes goes to the uploads; its report follows them."""
    if tiers.remote is not None and save.promote:
        report.upload = tiers.promote(save.step)


def coordinate(
    tier: LocalTier,
    save: SaveInfo,
    built: manifest_build.Built,
    metadata_bytes: bytes,
    config: WriterConfig,
) -> None:
    """The coordinator's part: write the step's files, then publish its node's directory (with
    other nodes, once every node has prepared its own). Raises what failed; the caller still
    holds the node's lock."""
    backend = tier.backend
    others = other_nodes(save)

    def publish_own() -> None:
        publish(tier, save, config.overwrite)

    # The coordinator's node keeps every section and DCP's .metadata (the remote
    # copy is made from it); the other nodes get the index and their own section.
    files = {layout.DCP_METADATA_NAME: metadata_bytes, **built.files_for(None)}
    commit.write_step_files(backend, save.tmp, files, sync=config.sync_files)
    if others:
        store = _torch_compat.default_store()
        timeout_secs = config.commit_timeout_secs
        handshake = commit.Handshake(store, save.save_id, timeout_secs, nodes=len(others) + 1)
        handshake.coordinate(others, built.index, built.sections, publish_own)
    else:
        publish_own()


def follow(
    tiers: Tiers, save: SaveInfo, report: SaveReport, lock: int, config: WriterConfig
) -> None:
    """A leader of another node than the coordinator's: in the background, write the manifest
    parts the coordinator sends, publish when it says so (then release ``lock`` and promote),
    or discard the temporary directory when the save is abandoned."""
    tier = tiers.local
    backend = tier.backend
    store = _torch_compat.default_store()
    if store is None:
        LocalBackend.unlock(lock)
        raise ConfigError("ranks on several local roots need torch.distributed initialised")

    def prepare(index: bytes, shared: bytes, own: bytes) -> None:
        files = {
            layout.manifest_section_name(manifest.SHARED): shared,
            layout.manifest_section_name(save.node): own,
            layout.MANIFEST_NAME: index,  # last, as the coordinator writes it
        }
        commit.write_step_files(backend, save.tmp, files, sync=config.sync_files)

    def publish_own() -> None:
        try:
            publish(tier, save, config.overwrite)
        finally:
            LocalBackend.unlock(lock)
        promote(tiers, save, report)

    def abandon(reason: str) -> None:
        LocalBackend.unlock(lock)
        commit.discard_tmp(backend, save.tmp, reason=reason)

    # A follower waits at least as long as the coordinator does for all nodes.
    timeout_secs = config.commit_timeout_secs
    handshake = commit.Handshake(store, save.save_id, timeout_secs, nodes=save.world_size)
    handshake.follow_in_background(save.node, prepare, publish_own, abandon)
