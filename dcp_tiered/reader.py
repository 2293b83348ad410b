"""TieredStorageReader: loads committed steps from the nearest tier holding a valid copy.

Every byte is checked against the manifest's checksums. Per file, the local copy is used when
it is there; a missing local file, or an item whose local bytes fail their checksum (with a
warning), is read from the remote tier with ranged GETs of just the needed bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import math
import os
import types
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from . import _gc, reader_checks
from ._torch_compat import StorageReaderTransforms, ZStandard
from .backends import ranged_reads
from .backends.local import LocalBackend
from .backends.remote import remote_backend
from .config import RemoteConfig
from .errors import (
    CheckpointNotFoundError,
    DcpTieredError,
    IntegrityError,
    ManifestError,
    MissingShardError,
    TransientTierError,
    UnsupportedExtensionError,
)
from .policy import integrity, layout, manifest
from .policy.manifest import ItemLocation
from .safe_unpickle import load_dcp_metadata
from .tiers import catalog
from .tiers import remote as remote_tier
from .tiers.local import LocalTier

logger = logging.getLogger(__name__)

# Local reads: neighbouring items share one read of up to a block; a tensor of at least
# _IN_PLACE_MIN_BYTES is read alone, straight into its target where it can be.
_LOCAL_BLOCK_BYTES = 8 * 2**20
_LOCAL_GAP_BYTES = 64 * 2**10  # read across a gap this small rather than issue another read
_IN_PLACE_MIN_BYTES = 64 * 2**10  # above this, three reads cost less than a copy


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
        extension_registry: for vanilla DCP checkpoints written with stream extensions
            (``FileSystemWriter(_extensions=[...])``): the ``ExtensionRegistry`` holding their
            classes, as given to ``FileSystemReader(_extension_registry=...)``. The default
            registry knows DCP's ``ZStandard``. Our own steps never use extensions.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        remote: str | RemoteConfig | None = None,
        storage_options: Mapping[str, Any] | None = None,
        hydrate: bool = False,
        allow_pickle: bool = False,
        extension_registry: Any | None = None,
    ) -> None:
        super().__init__()
        self._tier = LocalTier(LocalBackend(root))
        self._remote = remote_backend(remote, storage_options)
        self.hydrate = hydrate
        self.allow_pickle = allow_pickle
        self._transforms = StorageReaderTransforms(extension_registry)
        # Vanilla steps only: the stream extensions each item was written through.
        self._descriptors: dict[MetadataIndex, tuple[str, ...]] = {}
        self._requested: str | os.PathLike[str] | None = None
        self._step: catalog.StepLocation | None = None
        self._dir: tuple[str, ...] = ()
        self._manifest: manifest.Manifest | None = None
        self._index_is_local = False  # read sections from the local directory when they are there
        self._locations: dict[Any, ItemLocation] = {}
        # Stored chunk shape and dtype of each tensor item, for in-place views of raw bytes.
        self._chunks: dict[MetadataIndex, tuple[torch.Size, torch.dtype]] = {}
        # Two buffers reused for every local item (one being read, one being delivered).
        self._read_buffers = [bytearray(), bytearray()]
        self._deferred_error: DcpTieredError | None = None
        self._keys: layout.RemoteKeys | None = None  # the step's remote keys, from its marker
        self.files_read_remotely: set[str] = set()
        self._remote_checked = False

    def _check_remote(self) -> None:
        """The first time this reader needs the remote: a wrong bucket, bad or missing
        credentials or denied access raise PermanentTierError saying what to fix. A store
        that cannot be reached now is left to the listing that follows (it retries, then says
        the tier cannot be read)."""
        assert self._remote is not None
        try:
            self._remote.probe()
        except TransientTierError:
            return
        self._remote_checked = True

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
        except Exception as e:  # noqa: BLE001 - a hostile step may fail anything: typed below
            where = self.root + (f" or {self._remote.config.url}" if self._remote else "")
            step = self._step.name if self._step else str(self._requested or layout.LATEST)
            self._deferred_error = reader_checks.typed_metadata_error(e, step, where)
            return Metadata(state_dict_metadata={})

    def _read_metadata(self) -> Metadata:
        self.files_read_remotely, self._keys = set(), None
        if self._requested is None and self._tier.backend.exists(layout.DCP_METADATA_NAME):
            # The root itself is a vanilla DCP checkpoint directory.
            name = os.path.basename(self.root)
            self._step, self._dir = catalog.StepLocation(name, 0, True, False, False), ()
            return self._read_vanilla_metadata()
        try:
            self._tier.undo_interrupted_overwrites()
        except OSError as e:  # a read-only root: what is committed under its name still loads
            logger.warning("cannot restore interrupted overwrites in %s: %s", self.root, e)
        if self._remote is not None and not self._remote_checked:
            self._check_remote()
        self._step = catalog.resolve(self._tier, self._remote, self._requested)
        self._dir = (self._step.name,)
        if not self._step.verified_format:
            return self._read_vanilla_metadata()
        self._manifest = self._load_manifest(self._step)
        self._descriptors = {}
        self._locations = dict(self._manifest.metadata.storage_data)
        self._chunks = {}
        return self._manifest.metadata

    def _load_manifest(self, step: catalog.StepLocation) -> manifest.Manifest:
        """The manifest's index alone: read_data merges the sections its items need."""
        self._index_is_local = False
        if step.local:
            try:
                m = self._tier.read_manifest(step.name, nodes=())
                self._index_is_local = True
                return m
            except (ManifestError, OSError) as e:
                if not step.remote:
                    raise
                logger.warning(
                    "local manifest of %s is unusable (%s); using the remote one", step.name, e
                )
        assert self._remote is not None
        self._keys = None
        return remote_tier.read_manifest(self._remote, self._remote_keys_of(step.name), nodes=())

    def _locate(self, items: list[ReadItem]) -> None:
        """Merge the manifest sections that locate ``items`` (this node's own directory first,
        then the remote's), and note each tensor chunk's shape for in-place reads."""
        m = self._manifest
        if m is None:  # a vanilla step: every location is known already
            _canonical(items, self._locations)
            return
        indices = [item.storage_index for item in items]
        for node in manifest.needed_sections(m, indices):
            m = self._merge_section(m, node)
        self._manifest = m
        self._locations.update(m.locations)
        indices = _canonical(items, self._locations)
        sdm = m.metadata.state_dict_metadata
        for index in indices:
            md = sdm.get(index.fqn)
            if isinstance(md, TensorStorageMetadata) and index not in self._chunks:
                chunk = md.chunks[manifest.chunk_ordinal(m.metadata, index)]
                self._chunks[index] = (chunk.sizes, md.properties.dtype)

    def _merge_section(self, m: manifest.Manifest, node: int) -> manifest.Manifest:
        assert self._step is not None
        name = layout.manifest_section_name(node)
        if self._index_is_local and self._tier.backend.is_regular_file(self._step.name, name):
            try:
                return self._tier.merge_sections(self._step.name, m, [node])
            except (ManifestError, OSError) as e:
                if self._remote is None:
                    raise
                logger.warning("%s of %s is unusable (%s); using the remote one", name, m.step, e)
        if self._remote is None or not self._step.remote:
            raise ManifestError(
                f"{os.path.join(self.root, self._step.name)} holds this node's part of step "
                f"{m.step!r}, but the items asked for were saved by node {node}, whose manifest "
                "section is only in that node's directory and there is no remote copy to read "
                "it from. Load on the same nodes, or configure the remote tier the step was "
                "promoted to."
            )
        return remote_tier.merge_sections(self._remote, self._remote_keys(), m, [node])

    def _remote_keys_of(self, step: str) -> layout.RemoteKeys:
        assert self._remote is not None
        keys = remote_tier.keys_of_step(self._remote, step)
        if keys is None:
            raise CheckpointNotFoundError(
                f"step {step!r} is not committed on {self._remote.config.url}"
            )
        return keys

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
        self._chunks = {}
        self._locations = {
            idx: ItemLocation(info.relative_path, info.offset, info.length, "", -1, -1, "")
            for idx, info in md.storage_data.items()
        }
        # Older writers have no transform_descriptors field at all.
        self._descriptors = {
            idx: tuple(descs)
            for idx, info in md.storage_data.items()
            if (descs := getattr(info, "transform_descriptors", None))
        }
        self._check_extensions(where)
        return md

    def _check_extensions(self, where: str) -> None:
        """Every stream extension a vanilla step uses resolves, before any byte is read."""
        checked: set[tuple[str, ...]] = set()
        for idx, descs in self._descriptors.items():
            if descs in checked:
                continue
            try:
                self._transforms.extension_registry.from_descriptor_list(descs)
            except Exception as e:  # ValueError today; an extension's own code may raise more
                name = self._locations[idx].relative_path
                if any(d.startswith(ZStandard.registry_name()) for d in descs) and (
                    not ZStandard.is_available()
                ):
                    fix = "install zstandard in this environment (pip install zstandard)"
                else:
                    fix = (
                        "register the extension's class in an ExtensionRegistry and pass it as "
                        "TieredStorageReader(..., extension_registry=registry), as you would "
                        "to FileSystemReader(..., _extension_registry=registry)"
                    )
                raise UnsupportedExtensionError(
                    f"{where}: item {idx.fqn!r} in data file {name!r} was written with the DCP "
                    f"stream extension(s) {list(descs)}, which this reader cannot apply ({e}). "
                    f"To read it, {fix}."
                ) from e
            checked.add(descs)

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

    @_gc.paused_during  # a few objects per item, none in cycles: see _gc
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._locate(plan.items)
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self._locations[item.storage_index].relative_path, []).append(item)
        local: list[tuple[str, list[ReadItem]]] = []
        remote: list[tuple[str, list[ReadItem]]] = []
        for name, items in sorted(by_file.items()):
            items.sort(key=lambda i: self._locations[i.storage_index].offset)
            (local if self._valid_locally(name) else remote).append((name, items))
        try:
            self._load_local(local, planner)
        finally:
            self._read_buffers = [bytearray(), bytearray()]  # as large as the largest item
        if remote:
            for item, payload in self._remote_payloads(remote):
                self._deliver(item, payload, planner)
        if self.hydrate and self.files_read_remotely:
            self._hydrate(sorted(self.files_read_remotely))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _valid_locally(self, name: str) -> bool:
        """Whether to read ``name`` from the local tier (present, with the manifest's size);
        False means the remote, and raises when there is none to fall back on."""
        can_fetch = self._remote is not None and self._manifest is not None
        here = bool(self._step and self._step.local) and self._tier.backend.is_regular_file(
            *self._dir, name
        )  # no links, FIFOs
        if here:
            size = self._tier.backend.file_size(*self._dir, name)
            expected = int(self._manifest.files[name]["size"]) if self._manifest else size
            if size == expected:
                return True
            problem = f"local copy has {size} bytes, manifest says {expected}"
            if not can_fetch:
                raise IntegrityError.proof(
                    f"corrupt data in step {self.checkpoint_id!r}: file {name!r} in {self.root}: "
                    f"{problem}. Restore it from another tier or load an earlier step."
                )
            logger.warning(
                "%s of step %s: %s; reading it from %s",
                name,
                self.checkpoint_id,
                problem,
                self._remote.config.url if self._remote else "",
            )
        elif not can_fetch:
            raise MissingShardError(
                f"data file {name!r} of step {self.checkpoint_id!r} is missing (or not a "
                f"plain file: links, FIFOs and devices are never read) from "
                f"{os.path.join(self.root, *self._dir)} and no remote tier holds the step; "
                "restore it from another tier or load an earlier step"
            )
        return False

    def _load_local(self, files: list[tuple[str, list[ReadItem]]], planner: LoadPlanner) -> None:
        """Loads items from the local tier, verifying each against its checksum.

        Neighbouring items are read together, one read per block of up to
        ``_LOCAL_BLOCK_BYTES``, and each is checked and delivered from the block: a state of
        many small tensors costs a few reads, not one (or a thread hand-off) per item. A helper
        thread reads the next block (across file boundaries) while this one is checksummed and
        delivered; both release the GIL. A large tensor whose raw bytes the manifest locates,
        and whose target is a plain CPU tensor of the stored shape, is read on its own straight
        into the target (no staging buffer, no copy). Blocks use one of two reused buffers.
        """
        reads = self._plan_reads(files)
        if not reads:
            return
        opened: dict[str, Any] = {}
        # The pool is left first, so a read still in flight finishes before any file closes.
        with (
            contextlib.ExitStack() as open_files,
            ThreadPoolExecutor(1, thread_name_prefix="dcp-tiered-read") as pool,
        ):

            def read(n: int) -> list[memoryview]:  # runs on the helper thread only
                r = reads[n]
                if r.name not in opened:
                    opened[r.name] = open_files.enter_context(
                        self._tier.backend.open_read(*self._dir, r.name)
                    )
                if r.direct:
                    parts = self._direct_parts(self._locations[r.groups[0][0]], r.target)
                else:
                    parts = [self._read_buffer(n % 2, r.end - r.start)]
                offset, filled = r.start, []
                for part in parts:
                    got = self._tier.backend.read_range_into(opened[r.name], offset, part)
                    filled.append(got)
                    offset += len(got)
                    if len(got) < len(part):
                        break
                return filled

            self._resolve_direct(reads[0], planner)
            pending = pool.submit(read, 0)
            for n, r in enumerate(reads):
                parts = pending.result()
                if n + 1 < len(reads):
                    self._resolve_direct(reads[n + 1], planner)
                    pending = pool.submit(read, n + 1)
                if r.direct:
                    index, group = r.groups[0]
                    parts = self._verified(r.name, index, parts)
                    if len(parts) == 3:  # still the target's own memory: nothing to copy
                        assert r.target is not None  # direct: _resolve_direct set it
                        reader_checks.check_storage_tail(
                            parts[2], r.target.nbytes, self._what(index)
                        )
                        planner.commit_tensor(group[0], r.target)
                        continue
                    self._deliver(group[0], parts[0], planner, r.target)
                    continue
                block = parts[0] if parts else memoryview(b"")
                for index, group in r.groups:
                    lo = self._locations[index].offset - r.start
                    (data,) = self._verified(
                        r.name, index, [block[lo : lo + self._locations[index].length]]
                    )
                    for item in group:
                        self._deliver(item, data, planner, r.target)

    def _verified(
        self, name: str, index: MetadataIndex, parts: list[memoryview]
    ) -> list[memoryview]:
        """The item's local bytes (``parts``) if they match the manifest; else, with a remote
        tier, its remote bytes (as one part) if those do; else IntegrityError."""
        loc = self._locations[index]
        problem = self._problem(loc, parts)
        if problem and self._remote is not None and self._manifest is not None:
            logger.warning(
                "local copy of %s in step %s is corrupt (%s, item %s); reading it from %s",
                name,
                self.checkpoint_id,
                problem,
                index.fqn,
                self._remote.config.url,
            )
            parts = [memoryview(self._fetch(name, loc.offset, loc.offset + loc.length))]
            problem = self._problem(loc, parts)
        if problem:
            raise self._integrity_error(name, index.fqn, loc, problem)
        return parts

    def _plan_reads(self, files: list[tuple[str, list[ReadItem]]]) -> list[_Read]:
        """The local reads for ``files`` (items sorted by offset): each large tensor that may
        be read in place on its own, every other run of neighbouring items in blocks."""
        reads: list[_Read] = []
        for name, items in files:
            block: _Read | None = None
            for index, group in _by_storage_index(items):
                loc = self._locations[index]
                start, end = loc.offset, loc.offset + loc.length
                if self._may_read_in_place(index, group):
                    reads.append(_Read(name, start, end, [(index, group)], in_place=True))
                    block = None
                elif (
                    block is not None
                    and block.end <= start <= block.end + _LOCAL_GAP_BYTES
                    and end - block.start <= _LOCAL_BLOCK_BYTES
                ):
                    block.end = end
                    block.groups.append((index, group))
                else:
                    block = _Read(name, start, end, [(index, group)])
                    reads.append(block)
        return reads

    def _may_read_in_place(self, index: MetadataIndex, group: list[ReadItem]) -> bool:
        """Whether the saved item is a large tensor wanted whole (its target not yet known)."""
        loc = self._locations[index]
        if loc.raw_offset is None or index not in self._chunks or len(group) != 1:
            return False
        item = group[0]
        sizes, dtype = self._chunks[index]
        return (
            item.type == LoadItemType.TENSOR
            and not any(item.storage_offsets)
            and tuple(item.lengths) == tuple(sizes)  # not part of the chunk (resharding)
            and math.prod(sizes) * dtype.itemsize >= _IN_PLACE_MIN_BYTES
        )

    def _resolve_direct(self, r: _Read, planner: LoadPlanner) -> None:
        """Sets ``r.target`` for a large tensor, and ``r.direct`` when it can be read straight
        into that target."""
        if not r.in_place:
            return
        index, (item,) = r.groups[0]
        loc = self._locations[index]
        sizes, dtype = self._chunks[index]
        target = planner.resolve_tensor(item).detach()
        r.target = target
        r.direct = (
            type(target) is torch.Tensor
            and target.device.type == "cpu"
            and target.dtype == dtype
            and target.size() == sizes
            and target.is_contiguous()
            and target.layout == torch.strided
            and loc.raw_offset is not None
            and loc.raw_offset + target.nbytes <= loc.length
        )

    @staticmethod
    def _direct_parts(loc: ItemLocation, target: torch.Tensor | None) -> list[memoryview]:
        """The item's bytes as [framing before, the target's own memory, framing after]."""
        assert loc.raw_offset is not None and target is not None
        body = memoryview((ctypes.c_char * target.nbytes).from_address(target.data_ptr())).cast("B")
        tail = loc.length - loc.raw_offset - target.nbytes
        return [memoryview(bytearray(loc.raw_offset)), body, memoryview(bytearray(tail))]

    def _remote_payloads(
        self, files: list[tuple[str, list[ReadItem]]]
    ) -> Iterator[tuple[ReadItem, memoryview]]:
        """Every item of ``files`` from the remote, delivered in file order: neighbours merged
        into ranges of about a part, parallel ranged GETs of a part each across all the files
        (:mod:`dcp_tiered.backends.ranged_reads`)."""
        assert self._remote is not None
        span = remote_tier.chunk_bytes(self._remote)
        plan = []
        for name, items in files:
            groups = list(_by_storage_index(items))
            locs = [self._locations[index] for index, _ in groups]
            spans = [(loc.offset, loc.offset + loc.length) for loc in locs]
            plan.append((name, groups, ranged_reads.coalesce(spans, span)))
        blobs = ranged_reads.read_ranges(
            [(name, ranges) for name, _, ranges in plan],
            self._fetch,
            span,
            self._remote.config.max_concurrency,
        )
        try:
            for name, groups, ranges in plan:
                g = 0
                for _ in ranges:
                    _, start, end, blob = next(blobs)
                    while g < len(groups) and self._locations[groups[g][0]].offset < end:
                        index, group = groups[g]
                        loc = self._locations[index]
                        # a view, not a copy: the range's bytes are handed out in place
                        data = memoryview(blob)[
                            loc.offset - start : loc.offset - start + loc.length
                        ]
                        problem = self._problem(loc, [data])
                        if problem:
                            raise self._integrity_error(name, index.fqn, loc, problem, remote=True)
                        for item in group:
                            yield item, data
                        g += 1
        finally:
            blobs.close()

    def _fetch(self, name: str, start: int, end: int) -> bytes:
        assert self._remote is not None and self._step is not None
        self.files_read_remotely.add(name)
        key = self._remote_keys().file(name)
        try:
            return self._remote.get_range(key, start, end)
        except FileNotFoundError:  # the store's own word: an object of a committed save is gone
            raise IntegrityError.proof(
                f"{self._remote.url(key)}, a data file of committed step "
                f"{self._step.name!r}, is not on the store; restore an earlier step"
            ) from None

    def _remote_keys(self) -> layout.RemoteKeys:
        assert self._remote is not None and self._step is not None
        if self._keys is None:
            keys = self._remote_keys_of(self._step.name)
            if self._manifest is not None and keys.save_id not in (None, self._manifest.save_id):
                raise IntegrityError(
                    f"the remote copy of step {self._step.name!r} on {self._remote.config.url} "
                    f"is another save ({keys.save_id}) than the local one "
                    f"({self._manifest.save_id}): two jobs saved this step name. Its files "
                    "cannot stand in for the local copy's; restore another step."
                )
            self._keys = keys
        return self._keys

    def _read_buffer(self, which: int, length: int) -> memoryview:
        if len(self._read_buffers[which]) < length:
            self._read_buffers[which] = bytearray(length)
        return memoryview(self._read_buffers[which])[:length]

    @staticmethod
    def _problem(loc: ItemLocation, parts: list[memoryview] | list[bytes]) -> str | None:
        """Why the item's bytes (consecutive ``parts``) do not match the manifest, or None."""
        got = sum(len(p) for p in parts)
        if got != loc.length:
            return f"expected {loc.length} bytes at offset {loc.offset}, got {got}"
        if loc.checksum:
            crc = 0
            for part in parts:
                crc = integrity.checksum(part, crc)
            actual = integrity.format_checksum(crc)
            if actual != loc.checksum:
                return f"{integrity.ALGORITHM} {actual} != manifest {loc.checksum}"
        return None

    def _integrity_error(
        self, name: str, fqn: str, loc: ItemLocation, problem: str, remote: bool = False
    ) -> IntegrityError:
        tier = self._remote.config.url if remote and self._remote else self.root
        return IntegrityError.proof(
            f"corrupt data in step {self.checkpoint_id!r}, file {name!r} (rank {loc.rank}) on "
            f"{tier}, item {fqn!r}: {problem}. The load failed and the state it was loading into is incomplete; restore "
            "the file from another tier or load an earlier step."
        )

    # ------------------------------------------------------------ delivery

    def _deliver(
        self,
        item: ReadItem,
        data: bytes | memoryview,
        planner: LoadPlanner,
        target: torch.Tensor | None = None,
    ) -> None:
        """Hands one item's verified bytes to the planner (``target``: already resolved)."""
        if item.storage_index in self._descriptors:
            data = self._untransformed(item, data)
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, self._vetted_bytes(data))
            return
        tensor = self._raw_view(item.storage_index, data)
        if tensor is None:
            tensor = self._loaded_tensor(item.storage_index, data)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        if target is None:
            target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise IntegrityError(
                f"item {item.storage_index.fqn!r} of step {self.checkpoint_id!r}: saved chunk "
                f"{tuple(tensor.size())} does not fit the requested {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    def _untransformed(self, item: ReadItem, data: bytes | memoryview) -> bytes:
        """A vanilla item's bytes with its stream extensions undone, as FileSystemReader does."""
        descs = self._descriptors[item.storage_index]
        try:
            return self._transforms.transform_load_stream(item, descs, io.BytesIO(data)).read(-1)
        except Exception as e:  # a corrupt stream, or the extension's own failure
            name = self._locations[item.storage_index].relative_path
            raise IntegrityError(
                f"item {item.storage_index.fqn!r} in data file {name!r} of "
                f"{os.path.join(self.root, *self._dir)}: undoing its DCP stream extension(s) "
                f"{list(descs)} failed ({type(e).__name__}: {e}). The data is corrupt, or the "
                "registered extension is not the one it was written with; restore the "
                "checkpoint from a trusted copy."
            ) from e

    def _raw_view(self, index: MetadataIndex, data: bytes | memoryview) -> torch.Tensor | None:
        """The stored chunk as a view of its verified raw bytes (no torch.load, no copy), when
        the manifest says where they are. The shape and dtype come from the manifest too."""
        loc = self._locations[index]
        if loc.raw_offset is None or index not in self._chunks:
            return None
        sizes, dtype = self._chunks[index]
        count = math.prod(sizes)
        if loc.raw_offset + count * dtype.itemsize > len(data):
            raise IntegrityError(
                f"item {index.fqn!r} of step {self.checkpoint_id!r}: the manifest places "
                f"{count} x {dtype} past the end of the item's {len(data)} bytes; the manifest "
                "does not match the data. Restore the step from another tier."
            )
        reader_checks.check_raw_storage(
            data, loc.raw_offset, count * dtype.itemsize, self._what(index)
        )
        with warnings.catch_warnings():  # bytes from a remote are read-only; we only read them
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            raw = torch.frombuffer(data, dtype=torch.uint8, count=count * dtype.itemsize,
                                   offset=loc.raw_offset)  # fmt: skip
        if raw.data_ptr() % min(dtype.itemsize, 16):
            # Items lie back to back in the file, so a tensor's bytes need not be aligned for
            # its dtype; some kernels (complex128 copies) crash on such a view. Copy them.
            raw = raw.clone()
        return raw.view(dtype).view(sizes)

    def stored_tensor(self, fqn: str) -> torch.Tensor | None:
        """The first chunk of tensor ``fqn`` of the step being loaded, as stored: read,
        checked against its checksum, loaded with ``weights_only``. For telling a manifest
        that misstates a shape from a state that differs from the checkpoint
        (:class:`~dcp_tiered.load_planner.TieredLoadPlanner`); not for loading. None for a
        vanilla DCP step (no manifest to misstate anything)."""
        m = self._manifest
        if m is None:
            return None
        md = m.metadata.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata) or not md.chunks:
            raise ManifestError(f"{fqn!r} is no tensor of step {self.checkpoint_id!r}")
        index = MetadataIndex(fqn, md.chunks[0].offsets, 0)
        self._locate([types.SimpleNamespace(storage_index=index)])  # type: ignore[list-item]
        loc = self._locations[index]
        name = loc.relative_path
        if self._valid_locally(name):
            with self._tier.backend.open_read(*self._dir, name) as f:
                f.seek(loc.offset)
                data = f.read(loc.length)
        else:
            data = self._fetch(name, loc.offset, loc.offset + loc.length)
        problem = self._problem(loc, [data])
        if problem:
            raise self._integrity_error(name, fqn, loc, problem)
        return self._loaded_tensor(MetadataIndex(fqn), data)

    def _what(self, index: MetadataIndex) -> str:
        return f"item {index.fqn!r} of step {self.checkpoint_id!r} in {self.root}"

    def _loaded_tensor(self, index: MetadataIndex, data: bytes | memoryview) -> torch.Tensor:
        """A tensor item read with torch.load (weights_only), checked against the manifest."""
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # verified bytes that are no tensor archive
            raise IntegrityError(
                f"{self._what(index)}: its stored bytes do not load as a tensor "
                f"({type(e).__name__}: {str(e)[:200]}); restore the step from another tier"
            ) from e
        if index in self._chunks:
            sizes, dtype = self._chunks[index]
            return reader_checks.check_loaded_tensor(tensor, sizes, dtype, self._what(index))
        return tensor

    def _vetted_bytes(self, data: bytes | memoryview) -> io.BytesIO:
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
        """Copy the whole files read from the remote into the local tier, committed like a
        save (see :func:`remote_tier.hydrate_step`). Caching is optional: when it cannot be
        done (a full or read-only disk, ...) the load, which has succeeded, is not failed."""
        assert self._remote is not None and self._manifest is not None and self._step is not None
        try:
            remote_tier.hydrate_step(
                self._tier,
                self._remote,
                self._step.name,
                self._manifest,
                names,
                self._remote_keys(),
            )
        except (DcpTieredError, OSError) as e:
            logger.warning(
                "hydration of step %s into %s skipped: %s: %s. The load itself "
                "succeeded (from %s); nothing was left on the local tier.",
                self._step.name,
                self.root,
                type(e).__name__,
                e,
                self._remote.config.url,
            )
            return
        logger.info(
            "hydrated %s (%s) from %s into %s",
            self._step.name,
            ", ".join(names),
            self._remote.config.url,
            self.root,
        )


@dataclass
class _Read:
    """One local read: a byte range of one file and the saved items in it (with the read
    items each serves)."""

    name: str
    start: int
    end: int
    groups: list[tuple[MetadataIndex, list[ReadItem]]]
    in_place: bool = False  # a single large tensor, resolved ahead of its read
    target: torch.Tensor | None = None
    direct: bool = False  # the read goes straight into ``target``


def _canonical(items: list[ReadItem], locations: dict[Any, ItemLocation]) -> list[Any]:
    """Each item's storage index as the manifest's own (equal) key object, which the item
    then holds: the reader looks every item up several times, and a dict finds its own key
    by identity, where an equal copy costs a field-by-field comparison (a third of a restore
    of 20,000 tensors). The items' values do not change."""
    own = {k: k for k in locations}
    out = []
    for item in items:
        key = own.get(item.storage_index, item.storage_index)
        if key is not item.storage_index:
            object.__setattr__(item, "storage_index", key)  # a frozen dataclass: same value
        out.append(key)
    return out


def _by_storage_index(items: list[ReadItem]) -> Iterator[tuple[Any, list[ReadItem]]]:
    """Consecutive read items of one saved item share one read (resharding reads it k times)."""
    group: list[ReadItem] = []
    for item in items:
        if group and group[0].storage_index is not item.storage_index:
            yield group[0].storage_index, group
            group = []
        group.append(item)
    if group:
        yield group[0].storage_index, group
