"""Pulling a durable remote step onto the local tier: adoption (its manifest and ``.metadata``
alone) and hydration (its data files too).

Both commit on the *local* tier, like a save: a complete copy of the step is built in a
temporary directory and renamed into place (:func:`dcp_tiered.tiers.commit.build_and_publish`),
so no local step ever looks committed while it lacks files, whatever fails or crashes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import uuid
from collections.abc import Callable, Iterable

from ..backends import ranged_reads
from ..backends.remote import RemoteBackend
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    InsufficientSpaceError,
    IntegrityError,
    ManifestError,
)
from ..policy import integrity, layout
from ..policy.manifest import Manifest
from . import commit
from .local import LocalTier
from .remote import RemoteTier, chunk_bytes

logger = logging.getLogger(__name__)


def adopt_remote_step(tier: LocalTier, remote: RemoteBackend, step: str) -> None:
    """Commit a durable remote step on the local tier as its manifest and ``.metadata`` alone.

    Its data stays remote: readers fetch each file from there, verified, so a fresh node can
    restore a step through tools that look for it on local disk (DeepSpeed's loader) without
    first downloading all of it. Committed like a save: temporary directory, rename.
    """
    if tier.has_step(step):
        return
    source = RemoteTier(remote)
    keys = source.keys_of(step)
    if keys is None:
        raise CheckpointNotFoundError(f"step {step!r} is not committed on {remote.config.url}")
    m, files = source.read_manifest_files(keys)
    files = {layout.DCP_METADATA_NAME: remote.get_bytes(keys.metadata), **files}
    commit.build_and_publish(
        tier.backend, step, m.save_id, lambda tmp: None, files, what="adoption of the remote step"
    )  # a step committed here meanwhile (a save) is never replaced: CheckpointExistsError
    logger.info(
        "adopted step=%s from %s into %s (data stays remote)", step, remote.config.url, tier.root
    )


def hydrate_step(
    tier: LocalTier,
    remote: RemoteBackend,
    step: str,
    m: Manifest,
    names: list[str],
    keys: layout.RemoteKeys,
    progress: Callable[[int], object] | None = None,
) -> None:
    """Copy data files ``names`` of durable remote step ``step`` (manifest ``m``) into the
    local tier, so the next load reads them locally.

    Committed like a save: a complete copy of the step is built in a temporary directory (the
    local step's other files hard-linked, no bytes copied; the named files downloaded and
    checked against the manifest; manifest and .metadata last), then swapped in atomically for
    the local step, if there is one (e.g. adopted as manifest and .metadata alone). So no local
    step ever looks committed while it lacks files, whatever fails or crashes. The ranks of a
    node hydrate one at a time, each building on the copy the others published.
    ``progress(n)`` is called as each chunk of ``n`` bytes arrives (the CLI's progress bar).
    """
    backend = tier.backend
    need = sum(int(m.files[n]["size"]) for n in names)
    if need > (free := backend.free_bytes()):
        raise InsufficientSpaceError(
            errno.ENOSPC,
            (
                f"hydrating step {step!r} needs {need / 2**20:.1f} MiB but {tier.root} has "
                f"{free / 2**20:.1f} MiB free"
            ),
        )
    # The sections the reader merged, and those of the nodes whose files arrive here.
    sections = sorted(m.loaded | {m.node_of_rank(int(m.files[n]["rank"])) for n in names})
    lock = backend.lock_root_exclusive(layout.HYDRATE_LOCK_NAME)
    try:
        keep: list[str] = []
        replaces = None  # the local copy this completes, if any: nothing else is replaced
        if tier.has_step(step):
            here = tier.read_manifest(step)
            if here.save_id != m.save_id:
                raise ManifestError(
                    f"the local {step} in {tier.root} is another save ({here.save_id}) than the "
                    f"remote copy being read ({m.save_id}); they are never mixed"
                )
            replaces = here.save_id
            meta = {}
            for name in backend.list_files(step):
                if layout.is_step_metadata(name):
                    meta[name] = backend.read_file(step, name)
                    continue
                if name in names:
                    continue
                if not backend.is_regular_file(step, name):
                    raise ManifestError(
                        f"{backend.path_of(step, name)} is not a plain file: "
                        "the step is left as it is"
                    )
                keep.append(name)
        else:
            taken = backend.exists(step) and not tier.is_pending(step)
            if taken or backend.is_link(step):  # not a step, nor ours to replace
                raise CheckpointExistsError(
                    f"{backend.path_of(step)} exists and is not a committed step: nothing was "
                    f"copied and it was left as it is. Move it away, or copy {step} into "
                    "another root"
                )
            there, meta = RemoteTier(remote).read_manifest_files(keys, sections)
            if there.save_id != m.save_id:
                raise ManifestError(f"the remote {step} changed while it was being read")
            meta[layout.DCP_METADATA_NAME] = remote.get_bytes(keys.metadata)

        def fill(tmp: str) -> None:
            for name in keep:
                backend.link_file((step, name), (tmp, name))
            for name in names:
                _download(
                    tier,
                    remote,
                    keys.file(name),
                    (tmp, name),
                    int(m.files[name]["size"]),
                    str(m.files[name]["checksum"]),
                    progress,
                )

        commit.build_and_publish(
            backend,
            step,
            f"h{uuid.uuid4().hex[:11]}",
            fill,
            {**_sections_for(remote, keys, sections, meta), **meta},
            what="hydration",
            replaces=replaces,
        )
    finally:
        backend.unlock(lock)


def _sections_for(
    remote: RemoteBackend,
    keys: layout.RemoteKeys,
    nodes: Iterable[int],
    have: dict[str, bytes],
) -> dict[str, bytes]:
    """The sections of ``nodes`` that ``have`` lacks, from the remote (a hydrated step keeps
    the sections of every file it holds)."""
    out = {}
    for node in nodes:
        name = layout.manifest_section_name(node)
        if name not in have:
            out[name] = remote.get_bytes(keys.section(node))
    return out


def _download(
    tier: LocalTier,
    remote: RemoteBackend,
    key: str,
    dst: tuple[str, str],
    size: int,
    checksum: str,
    progress: Callable[[int], object] | None = None,
) -> None:
    """Stream one remote object into a local file in bounded chunks, checking its checksum."""
    crc = 0
    span = chunk_bytes(remote)
    ranges = [(start, min(size, start + span)) for start in range(0, size, span)]
    pieces = ranged_reads.read_ranges(
        [(key, ranges)], remote.get_range, span, remote.config.max_concurrency
    )
    with tier.backend.open_write(*dst) as f, contextlib.closing(pieces):
        for _, _, _, (chunk,) in pieces:  # ranges of one piece each
            crc = integrity.checksum(chunk, crc)
            f.write(chunk)
            if progress is not None:
                progress(len(chunk))
    if integrity.format_checksum(crc) != checksum:
        raise IntegrityError(
            f"{remote.url(key)} fails its checksum against the manifest; it "
            "was not copied to the local tier"
        )
