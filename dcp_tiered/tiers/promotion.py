"""Promotion: making one committed local step durable on the remote tier, and the proof of it.

Which steps are promoted, when and on which threads is :mod:`dcp_tiered.tiers.uploads`'s job;
what a remote step is, :mod:`dcp_tiered.tiers.remote`'s. A step is committed on the remote so
that partial uploads are never visible, and a marker never claims what the store does not hold:

1. before its first object of a save, each node writes a claim ``STEP/<sid>/_claims/node-K.json``
   naming the run (only a claimed save is ever swept as an orphan by that run);
2. every node uploads its own data files, each verified on the store (read back, CRC32C), and
   writes its completion record ``STEP/<sid>/_nodes/node-K.json`` with each object's size and
   the version tag the store gave the bytes it verified;
3. the coordinator's node waits for every node's record, then lists the save on the store:
   every file of the manifest must be there with its size and the tag its node verified. Only
   then does it write the sections, ``.metadata``, the manifest's index, move the root's
   ``latest`` pointer forward and, last, create the marker ``STEP/_COMMITTED.json`` exclusively.

Local records of earlier uploads (the early uploads' ``.done`` files) only ever save this
process work it did itself: after a restart every file is checked on the store again. Each
file's upload is :func:`dcp_tiered.tiers.file_upload.upload_locked`, the early upload's too.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from .._daemon_pool import DaemonPool
from ..backends.remote import RemoteBackend
from ..errors import ManifestError, UploadFailedError
from ..policy import layout, records
from ..policy.identity import Owner
from ..policy.manifest import Manifest
from . import ownership
from .file_upload import upload_locked
from .local import LocalTier
from .remote import RemoteTier

logger = logging.getLogger(__name__)

CLAIMED = "claimed"  # in a save's upload area: this node's claim is written


def claim_body(keys: layout.RemoteKeys, node: int, run_id: str) -> bytes:
    return json.dumps(
        {
            "format": "dcp-tiered-claim",
            "run_id": run_id,
            "step": keys.step,
            "save_id": keys.save_id,
            "node": node,
            **keys.strategy.record(),
            "created_at_ns": time.time_ns(),
        }
    ).encode()


def node_of_local_files(m: Manifest, present: set[str]) -> int:
    """Which node's shards this local step directory holds (the lowest, if several)."""
    ranks = {int(info["rank"]) for name, info in m.files.items() if name in present}
    for node, node_ranks in enumerate(m.nodes):
        if ranks & set(node_ranks):
            return node
    return 0


class Promotion:
    """Uploads one node's part of one committed step; the coordinator's node also commits."""

    def __init__(
        self,
        tier: LocalTier,
        remote: RemoteBackend,
        step: str,
        files_pool: DaemonPool,
        remote_run: Any = None,
    ) -> None:
        self.tier, self.remote, self.step, self._pool = tier, remote, step, files_pool
        self.target = RemoteTier(remote)
        # ``remote_run(run_id)``: the prefix recorded as that run's (once per process)
        self._remote_run = remote_run or (
            lambda run_id: ownership.record_remote(remote, run_id, tier.root)
        )

    def run(self) -> None:
        m = self.tier.read_manifest(self.step)
        run_id = self._run_of(m)
        marker = self.target.marker(self.step)
        backend, area = self.tier.backend, layout.upload_area_name(self.step, m.save_id)
        if marker is not None:
            if marker.get("save_id") == m.save_id:  # already durable
                if backend.is_dir(area):
                    backend.remove_tree(area, reason="upload records of a durable step")
                return
            # Remote steps are immutable: the step is another save's. Leave that copy whole.
            raise UploadFailedError(
                f"step {self.step!r} is already committed on {self.remote.config.url} by another "
                f"save ({marker.get('save_id')}, not this one's {m.save_id}): two jobs save "
                "into this prefix, or the step was saved again after it became durable. Remote "
                "steps are never overwritten: give each job its own remote prefix, or save "
                "under a new step name."
            )
        self._remote_run(run_id)
        keys = self.target.keys(self.step, m.save_id)
        present = set(backend.list_files(self.step)) & set(m.files)
        node = node_of_local_files(m, present)
        mine = sorted(n for n in present if int(m.files[n]["rank"]) in m.nodes[node])
        if not (backend.is_dir(area) and backend.exists(area, CLAIMED)):
            self.remote.put_bytes(keys.claim(node), claim_body(keys, node, run_id))
        # What an earlier attempt already uploaded: each file's own check (no listing of the
        # whole save, whose pages grow with every node's objects).
        jobs = {n: self._pool.submit(self._upload, m, n, keys, True) for n in mine}
        tags = {n: fut.result() for n, fut in jobs.items()}
        record = {
            "save_id": m.save_id,
            "run_id": run_id,
            "files": {n: {**m.files[n], "tag": tags[n]} for n in mine},
        }
        self.remote.put_bytes(keys.node_record(node), json.dumps(record).encode())
        if backend.is_dir(area):
            backend.remove_tree(area, reason="upload records of a node copy now uploaded")
        logger.info(
            "uploaded step=%s node=%d files=%d to %s",
            self.step,
            node,
            len(mine),
            self.remote.config.url,
        )
        if node == 0:
            self._commit(m, keys, run_id, tags)

    def _run_of(self, m: Manifest) -> str:
        """The run the step is promoted for: the root's, when the step is that run's."""
        record = self.tier.record()
        info = self.tier.info(self.step)
        if record is None or info is None or info.owner(record) != Owner.OURS:
            raise UploadFailedError(
                f"{self.tier.backend.path_of(self.step)} is not this root's run's step (saved "
                "before run identities, by another run, or a copy under another name): it is "
                f"not uploaded. If it is yours: `dcp-tiered adopt {self.tier.root} {self.step}`"
            )
        return record.run_id

    def _upload(
        self, m: Manifest, name: str, keys: layout.RemoteKeys, trust_records: bool
    ) -> str | None:
        """Make sure the store holds ``name`` as the manifest says; the tag of the object it
        verified."""
        size, checksum = int(m.files[name]["size"]), str(m.files[name]["checksum"])
        return upload_locked(
            self.tier, self.remote, keys, name, checksum, trust_records=trust_records, size=size
        )

    def _commit(
        self, m: Manifest, keys: layout.RemoteKeys, run_id: str, tags: dict[str, str | None]
    ) -> None:
        self._await_nodes(m, keys)
        if not m.complete:
            raise UploadFailedError(
                f"step {self.step!r} in {self.tier.root} lacks manifest sections "
                f"{m.missing(m.sections)}, so it cannot be committed on the remote; it stays "
                "committed locally"
            )
        self._confirm(m, keys, tags)
        backend = self.tier.backend
        for node in m.sections:
            name = layout.manifest_section_name(node)
            self.remote.put_bytes(keys.section(node), backend.read_file(self.step, name))
        self.remote.put_bytes(keys.metadata, backend.read_file(self.step, layout.DCP_METADATA_NAME))
        self.remote.put_bytes(keys.manifest, backend.read_file(self.step, layout.MANIFEST_NAME))
        marker = layout.marker_body(
            self.step, m.save_id, m.committed_at_ns, self.target.strategy, run_id
        )
        self.target.commit(keys, marker)
        self.target.remove_orphan_saves(self.step, run_id, keep={m.save_id})
        logger.info("durable-remote step=%s url=%s", self.step, self.remote.config.url)

    def _await_nodes(self, m: Manifest, keys: layout.RemoteKeys) -> None:
        deadline = time.monotonic() + self.remote.config.durable_timeout_secs
        pending = set(range(1, len(m.nodes)))
        delay = 0.05
        while pending:
            # One listing per round (a page per 1,000 nodes), not a GET per node: the records
            # sit under this save's own prefix STEP/<save id>/, so one there is this save's.
            listed = set(self.remote.sizes(keys.node_records_prefix))
            pending -= {n for n in pending if keys.node_record(n) in listed}
            if pending:
                if time.monotonic() > deadline:
                    raise UploadFailedError(
                        f"step {self.step!r}: nodes {sorted(pending)} did not finish uploading "
                        f"within {self.remote.config.durable_timeout_secs:.0f} s; the step stays "
                        "committed locally and is retried at the next start"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _confirm(self, m: Manifest, keys: layout.RemoteKeys, tags: dict[str, str | None]) -> None:
        """The store's own word, before the marker: every file of the save is there with its
        size and the tag its node verified (another node's tags from its record). This node's
        files it does not show are uploaded again; another node's make the promotion fail (its
        record is removed, so its next attempt checks its files on the store again)."""
        expected = {**self._recorded_tags(m, keys), **tags}
        missing = unconfirmed(self.remote, keys, m, expected)
        mine = [n for n in missing if n in tags]
        for name in mine:
            logger.warning(
                "%s is not on the store as verified: uploading it again",
                self.remote.url(keys.file(name)),
            )
            expected[name] = self._upload(m, name, keys, False)
        if mine:
            missing = unconfirmed(self.remote, keys, m, expected)
        if missing:
            for node in {m.node_of_rank(int(m.files[n]["rank"])) for n in missing} - {0}:
                self.remote.remove(keys.node_record(node), reason="its objects are not all there")
            raise UploadFailedError(
                f"step {self.step!r}: the store does not hold {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''} as uploaded (missing, resized or replaced "
                f"since), so the step was not committed on {self.remote.config.url}. It stays "
                "committed locally; its upload is retried at the next start"
            )

    def _recorded_tags(self, m: Manifest, keys: layout.RemoteKeys) -> dict[str, str | None]:
        """The tags other nodes recorded for their files (none for a record that cannot be read:
        those files are then checked by size alone)."""
        out: dict[str, str | None] = {}
        for node in range(1, len(m.nodes)):
            key = keys.node_record(node)
            try:
                body = records.node_record(
                    self.remote.get_bytes(key), where=self.remote.url(key), save_id_=keys.save_id
                )
                out.update({str(n): f.get("tag") for n, f in body["files"].items()})
            except (FileNotFoundError, ManifestError) as e:
                logger.warning("node %d's record of %s is unreadable: %s", node, self.step, e)
        return out


def unconfirmed(
    remote: RemoteBackend,
    keys: layout.RemoteKeys,
    m: Manifest,
    tags: dict[str, str | None] | None = None,
) -> list[str]:
    """The files of ``m`` the store does not show whole, by one listing of each prefix that holds
    them: missing, of another size, or another object than the one verified (``tags``)."""
    tags = tags or {}
    wanted = {name: keys.file(name) for name in m.files}
    listed: dict[str, tuple[int, str | None]] = {}
    for prefix in sorted({key.rpartition("/")[0] + "/" for key in wanted.values()}):
        listed.update(remote.listing(prefix))
    missing = []
    for name, key in sorted(wanted.items()):
        got = listed.get(key)
        tag = tags.get(name)
        if (
            got is None
            or got[0] != int(m.files[name]["size"])
            or (tag is not None and got[1] is not None and got[1] != tag)
        ):
            missing.append(name)
    return missing
