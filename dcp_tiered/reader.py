"""TieredStorageReader: loads committed steps from the nearest tier holding a valid copy.

Every byte is checked against the manifest's checksums. Per file, the local copy is used when
it is there; a missing local file, or an item whose local bytes fail their checksum (with a
warning), is read from the remote tier with ranged GETs of just the needed bytes.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from . import catalog, integrity, layout, manifest
from .backends.local import LocalBackend
from .backends.remote import remote_backend
from .config import RemoteConfig
from .errors import (
    CheckpointNotFoundError,
    DcpTieredError,
    IntegrityError,
    ManifestError,
    MissingShardError,
)
from .local_tier import LocalTier
from .manifest import ItemLocation
from .safe_unpickle import load_dcp_metadata

logger = logging.getLogger(__name__)

_RANGE_MERGE_GAP_BYTES = 1 * 2**20  # fetch a small gap rather than issue another GET
_RANGE_MAX_BYTES = 64 * 2**20


class TieredStorageReader(StorageReader):
    """Reads a step saved by :class:`TieredStorageWriter` (or a vanilla DCP directory).

    Args:
        root: the local directory given to the writer (it may be empty or missing when
            ``remote`` is set). ``checkpoint_id`` passed to ``dcp.load`` is a step name or
            ``"latest"`` (the default), the newest committed step on any tier. ``root`` may also
            be a vanilla DCP checkpoint directory itself.
        remote: the writer's remote (URL or RemoteConfig), to read what the local tier lacks.
        storage_options: fsspec options for ``remote`` (ignored with a RemoteConfig).
        hydrate: copy the files fetched from the remote into the local tier for next time.
        allow_pickle: load non-tensor values with full pickle. Only for checkpoints you
            trust: a pickle can run arbitrary code. By default they load with
            ``torch.load(weights_only=True)``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        remote: str | RemoteConfig | None = None,
        storage_options: Mapping[str, Any] | None = None,
        hydrate: bool = False,
        allow_pickle: bool = False,
    ) -> None:
        super().__init__()
        self._tier = LocalTier(LocalBackend(root))
        self._remote = remote_backend(remote, storage_options)
        self.hydrate = hydrate
        self.allow_pickle = allow_pickle
        self._requested: str | os.PathLike[str] | None = None
        self._step: catalog.StepLocation | None = None
        self._dir: tuple[str, ...] = ()
        self._manifest: manifest.Manifest | None = None
        self._locations: dict[Any, ItemLocation] = {}
        self._deferred_error: DcpTieredError | None = None
        self._strategy: str | None = None  # the step's remote key layout, read from its marker
        self.files_read_remotely: set[str] = set()

    @property
    def root(self) -> str:
        return self._tier.root

    @property
    def checkpoint_id(self) -> str | None:
        return self._step.name if self._step else None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._requested = checkpoint_id
        self._step = None

    # ------------------------------------------------------------ metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP turns any exception raised here into a bare AssertionError ("metadata is None").
        # To hand the caller our typed error, it is raised from set_up_storage_reader instead,
        # which DCP reports per rank in CheckpointException.failures like any other failure.
        self._deferred_error = None
        try:
            return self._read_metadata()
        except DcpTieredError as e:
            self._deferred_error = e
            return Metadata(state_dict_metadata={})

    def _read_metadata(self) -> Metadata:
        self.files_read_remotely, self._strategy = set(), None
        if self._requested is None and self._tier.backend.exists(layout.DCP_METADATA_NAME):
            # The root itself is a vanilla DCP checkpoint directory.
            name = os.path.basename(self.root)
            self._step, self._dir = catalog.StepLocation(name, 0, True, False, False), ()
            return self._read_vanilla_metadata()
        self._step = catalog.resolve(self._tier, self._remote, self._requested)
        self._dir = (self._step.name,)
        if not self._step.verified_format:
            return self._read_vanilla_metadata()
        self._manifest = self._load_manifest(self._step)
        self._locations = dict(self._manifest.metadata.storage_data)
        return self._manifest.metadata

    def _load_manifest(self, step: catalog.StepLocation) -> manifest.Manifest:
        if step.local:
            try:
                return self._tier.read_manifest(step.name)
            except (ManifestError, OSError) as e:
                if not step.remote:
                    raise
                logger.warning("local manifest of %s is unusable (%s); using the remote one",
                               step.name, e)
        assert self._remote is not None
        where = self._remote.url(f"{step.name}/{layout.MANIFEST_NAME}")
        return manifest.parse(self._remote.get_bytes(f"{step.name}/{layout.MANIFEST_NAME}"),
                              where=where)

    def _read_vanilla_metadata(self) -> Metadata:
        where = os.path.join(self.root, *self._dir, layout.DCP_METADATA_NAME)
        logger.warning(
            "%s is a vanilla DCP checkpoint without a dcp_tiered manifest: its bytes cannot be "
            "verified. Its .metadata is read with a restricted unpickler.",
            where,
        )
        md = load_dcp_metadata(
            self._tier.backend.read_file(*self._dir, layout.DCP_METADATA_NAME), where=where
        )
        self._manifest = None
        self._locations = {
            idx: ItemLocation(info.relative_path, info.offset, info.length, "", -1, -1, "")
            for idx, info in md.storage_data.items()
        }
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._deferred_error is not None:
            raise self._deferred_error
        if self._step is None:  # DCP always reads metadata first; guard direct use
            raise CheckpointNotFoundError("read_metadata() must run before set_up_storage_reader")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # ------------------------------------------------------------ data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self._locations[item.storage_index].relative_path, []).append(item)
        for name, items in sorted(by_file.items()):
            items.sort(key=lambda i: self._locations[i.storage_index].offset)
            for item, payload in self._payloads(name, items):
                self._deliver(item, payload, planner)
        if self.hydrate and self.files_read_remotely:
            self._hydrate(sorted(self.files_read_remotely))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _payloads(self, name: str, items: list[ReadItem]) -> Iterator[tuple[ReadItem, bytes]]:
        """Each item's verified bytes, from the nearest tier holding a valid copy."""
        can_fetch = self._remote is not None and self._manifest is not None
        here = bool(self._step and self._step.local) and self._tier.backend.exists(*self._dir, name)
        if here:
            size = self._tier.backend.file_size(*self._dir, name)
            expected = int(self._manifest.files[name]["size"]) if self._manifest else size
            if size == expected:
                yield from self._local_payloads(name, items)
                return
            problem = f"local copy has {size} bytes, manifest says {expected}"
            if not can_fetch:
                raise IntegrityError(
                    f"corrupt data in step {self.checkpoint_id!r}: file {name!r} in {self.root}: "
                    f"{problem}. Restore it from another tier or load an earlier step."
                )
            logger.warning("%s of step %s: %s; reading it from %s", name, self.checkpoint_id,
                           problem, self._remote.config.url if self._remote else "")
        elif not can_fetch:
            raise MissingShardError(
                f"data file {name!r} of step {self.checkpoint_id!r} is missing from "
                f"{os.path.join(self.root, *self._dir)} and no remote tier holds the step; "
                "restore it from another tier or load an earlier step"
            )
        yield from self._remote_payloads(name, items)

    def _local_payloads(self, name: str, items: list[ReadItem]) -> Iterator[tuple[ReadItem, bytes]]:
        with self._tier.backend.open_read(*self._dir, name) as f:
            for index, group in _by_storage_index(items):
                loc = self._locations[index]
                f.seek(loc.offset)
                data = f.read(loc.length)
                problem = self._problem(loc, data)
                if problem and self._remote is not None and self._manifest is not None:
                    logger.warning(
                        "local copy of %s in step %s is corrupt (%s, item %s); reading it from %s",
                        name, self.checkpoint_id, problem, index.fqn, self._remote.config.url,
                    )
                    data = self._fetch(name, loc.offset, loc.offset + loc.length)
                    problem = self._problem(loc, data)
                if problem:
                    raise self._integrity_error(name, index.fqn, loc, problem)
                for item in group:
                    yield item, data

    def _remote_payloads(self, name: str, items: list[ReadItem]) -> Iterator[tuple[ReadItem, bytes]]:
        """Coalesced ranged GETs, a few in flight at once, delivered in file order."""
        assert self._remote is not None
        groups = list(_by_storage_index(items))
        ranges = _coalesce([self._locations[i] for i, _ in groups])
        window = self._remote.config.max_concurrency
        with ThreadPoolExecutor(window, thread_name_prefix="dcp-tiered-get") as pool:
            futures = [pool.submit(self._fetch, name, s, e) for s, e in ranges[:window]]
            g = 0
            for k, (start, end) in enumerate(ranges):
                blob = futures[k].result()
                futures[k] = None  # type: ignore[call-overload]  # free it once consumed
                if k + window < len(ranges):
                    futures.append(pool.submit(self._fetch, name, *ranges[k + window]))
                while g < len(groups) and self._locations[groups[g][0]].offset < end:
                    index, group = groups[g]
                    loc = self._locations[index]
                    data = blob[loc.offset - start : loc.offset - start + loc.length]
                    problem = self._problem(loc, data)
                    if problem:
                        raise self._integrity_error(name, index.fqn, loc, problem, remote=True)
                    for item in group:
                        yield item, data
                    g += 1

    def _fetch(self, name: str, start: int, end: int) -> bytes:
        assert self._remote is not None and self._step is not None
        self.files_read_remotely.add(name)
        key = layout.remote_file_key(self._step.name, name, self._prefix_strategy())
        return self._remote.get_range(key, start, end)

    def _prefix_strategy(self) -> str:
        assert self._remote is not None and self._step is not None
        if self._strategy is None:
            marker = json.loads(
                self._remote.get_bytes(f"{self._step.name}/{layout.REMOTE_MARKER}")
            )
            self._strategy = str(marker.get("prefix_strategy", "none"))
        return self._strategy

    @staticmethod
    def _problem(loc: ItemLocation, data: bytes) -> str | None:
        if len(data) != loc.length:
            return f"expected {loc.length} bytes at offset {loc.offset}, got {len(data)}"
        if loc.checksum:
            actual = integrity.format_checksum(integrity.checksum(data))
            if actual != loc.checksum:
                return f"{integrity.ALGORITHM} {actual} != manifest {loc.checksum}"
        return None

    def _integrity_error(
        self, name: str, fqn: str, loc: ItemLocation, problem: str, remote: bool = False
    ) -> IntegrityError:
        tier = self._remote.config.url if remote and self._remote else self.root
        return IntegrityError(
            f"corrupt data in step {self.checkpoint_id!r}, file {name!r} (rank {loc.rank}) on "
            f"{tier}, item {fqn!r}: {problem}. Nothing from this item was loaded; restore the "
            "file from another tier or load an earlier step."
        )

    # ------------------------------------------------------------ delivery

    def _deliver(self, item: ReadItem, data: bytes, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, self._vetted_bytes(data))
            return
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise IntegrityError(
                f"item {item.storage_index.fqn!r} of step {self.checkpoint_id!r}: saved chunk "
                f"{tuple(tensor.size())} does not fit the requested {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    def _vetted_bytes(self, data: bytes) -> io.BytesIO:
        """Non-tensor values: weights_only unless the caller trusts the checkpoint.

        The value is decoded with the restricted unpickler, then re-encoded, so the planner's
        own unrestricted ``torch.load`` only ever sees objects that passed the restriction.
        """
        if self.allow_pickle:
            return io.BytesIO(data)
        try:
            obj = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise IntegrityError(
                f"a non-tensor value in step {self.checkpoint_id!r} holds objects that "
                f"weights_only loading refuses ({e}). If you trust this checkpoint, construct "
                "TieredStorageReader(..., allow_pickle=True)."
            ) from e
        out = io.BytesIO()
        torch.save(obj, out)
        out.seek(0)
        return out

    # ------------------------------------------------------------ hydration

    def _hydrate(self, names: list[str]) -> None:
        """Copy whole files fetched from the remote into the local step, each atomically."""
        assert self._remote is not None and self._manifest is not None and self._step is not None
        step, backend = self._step.name, self._tier.backend
        backend.make_dir(step)
        for meta in (layout.MANIFEST_NAME, layout.DCP_METADATA_NAME):
            if not backend.exists(step, meta):
                backend.write_atomically(step, meta, self._remote.get_bytes(f"{step}/{meta}"))
        for name in names:
            size = int(self._manifest.files[name]["size"])
            data = self._fetch(name, 0, size)
            if integrity.format_checksum(integrity.checksum(data)) != self._manifest.files[name]["checksum"]:
                raise IntegrityError(f"remote copy of {name!r} in step {step!r} is corrupt")
            backend.write_atomically(step, name, data)
            logger.info("hydrated %s/%s from %s", step, name, self._remote.config.url)


def _by_storage_index(items: list[ReadItem]) -> Iterator[tuple[Any, list[ReadItem]]]:
    """Consecutive read items of one saved item share one read (resharding reads it k times)."""
    group: list[ReadItem] = []
    for item in items:
        if group and group[0].storage_index != item.storage_index:
            yield group[0].storage_index, group
            group = []
        group.append(item)
    if group:
        yield group[0].storage_index, group


def _coalesce(locs: list[ItemLocation]) -> list[tuple[int, int]]:
    """Merge the byte ranges of items (sorted by offset) into few, bounded GETs."""
    ranges: list[list[int]] = []
    for loc in locs:
        start, end = loc.offset, loc.offset + loc.length
        if ranges and start - ranges[-1][1] <= _RANGE_MERGE_GAP_BYTES and (
            end - ranges[-1][0] <= _RANGE_MAX_BYTES
        ):
            ranges[-1][1] = max(ranges[-1][1], end)
        else:
            ranges.append([start, end])
    return [(s, e) for s, e in ranges]
