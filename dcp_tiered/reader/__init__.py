"""TieredStorageReader: loads committed steps from the nearest tier holding a valid copy.

Every byte is checked against the manifest's checksums. Per file, the local copy is used when
it is there; a missing local file, or an item whose local bytes fail their checksum (with a
warning), is read from the remote tier with ranged GETs of just the needed bytes.

This module holds DCP's call sequence and the choice of source; the work is the roles'
the reader inherits, one job each: ``_vanilla`` (vanilla DCP steps), ``_deliver`` (handing
verified bytes to the planner), ``_remote`` (ranged GETs, hydration) and ``_local`` (the local
read pipeline), over the state ``_state`` declares.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import _gc, reader_checks, whole_reads
from .._torch_compat import StorageReaderTransforms
from ..backends.local import LocalBackend
from ..backends.remote import remote_backend
from ..config import RemoteConfig
from ..errors import CheckpointNotFoundError, ConfigError, DcpTieredError, ManifestError
from ..policy import layout, manifest
from ..policy.manifest import ItemLocation
from ..tiers import catalog
from ..tiers.local import LocalTier
from ..tiers.remote import RemoteTier
from ..tiers.step_record import CommittedStep
from . import _prefetch
from ._columns import ColumnReads

logger = logging.getLogger(__name__)


class TieredStorageReader(ColumnReads, StorageReader):
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
        self._step: CommittedStep | None = None
        self._dir: tuple[str, ...] = ()
        self._manifest: manifest.Manifest | None = None
        self._index_is_local = False  # read sections from the local directory when they are there
        self._locations: dict[Any, ItemLocation] = {}
        self._own_keys: dict[Any, Any] = {}  # one key object per located item: _canonical
        # Stored chunk shape and dtype of each tensor item, for in-place views of raw bytes.
        self._chunks: dict[MetadataIndex, tuple[torch.Size, torch.dtype]] = {}
        # Two buffers reused for every local item (one being read, one being delivered).
        self._read_buffers = [bytearray(), bytearray()]
        self._deferred_error: DcpTieredError | None = None
        self._keys: layout.RemoteKeys | None = None  # the step's remote keys, from its marker
        self._offered: Metadata | None = None  # the metadata read_metadata returned last
        self._prefetching: _prefetch.Prefetch | None = None  # this load's reads ahead
        self.files_read_remotely: set[str] = set()
        self._remote_checked = False

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        _gc.hold_through_dcp_call()  # DCP's first call, where it is given a checkpoint_id
        self._requested = checkpoint_id
        self._step = None

    # ------------------------------------------------------------ metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP turns any exception raised here into a bare AssertionError ("metadata is None").
        # To hand the caller our typed error, it is raised from set_up_storage_reader instead,
        # which DCP reports per rank in CheckpointException.failures like any other failure.
        _gc.hold_through_dcp_call()  # the first hook of a load: see _gc
        self._deferred_error = None
        try:
            return self._read_metadata()
        except Exception as e:  # noqa: BLE001 - a hostile step may fail anything: typed below
            where = self.root + (f" or {self._remote.config.url}" if self._remote else "")
            step = self._step.name if self._step else str(self._requested or layout.LATEST)
            self._deferred_error = reader_checks.typed_metadata_error(e, step, where)
            return Metadata(state_dict_metadata={})

    def _read_metadata(self) -> Metadata:
        self.files_read_remotely, self._keys, self._offered = set(), None, None
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ConfigError(
                f"{self.root} is a file, not a checkpoint directory: point the reader at the "
                "directory the writer saved into"
            )
        if self._requested is None and self._tier.backend.exists(layout.DCP_METADATA_NAME):
            # The root itself is a vanilla DCP checkpoint directory.
            name = os.path.basename(self.root)
            self._step, self._dir = (
                CommittedStep(name, 0, verified_format=False, as_saved=False),
                (),
            )
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
        self._offered = self._manifest.metadata
        whole_reads.offer(self._offered, self)  # see whole_reads
        self._descriptors = {}
        self._locations = dict(self._manifest.metadata.storage_data)
        self._own_keys = {k: k for k in self._locations}
        self._chunks = {}
        return self._manifest.metadata

    def _load_manifest(self, step: CommittedStep) -> manifest.Manifest:
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
        # The data is then read from the keys of the save this manifest describes: one GET of
        # the marker, not another at the first read.
        self._keys = self._remote_keys_of(step.name)
        return RemoteTier(self._remote).read_manifest(self._keys, nodes=())

    def _locate(self, items: list[ReadItem]) -> None:
        """Merge the manifest sections that locate ``items`` (this node's own directory first,
        then the remote's)."""
        m = self._manifest
        if m is None:  # a vanilla step: every location is known already
            _canonical(items, self._locations)
            return
        indices = [item.storage_index for item in items]
        for node in manifest.needed_sections(m, indices):
            m = self._merge_section(m, node)
        self._manifest = m
        # the locations of these items only (a section's are made when looked up), each
        # kept under the first read item's own key object, which equal ones then share
        # (see _canonical)
        found, own, merged = self._locations, self._own_keys, m.locations
        for item in items:
            key = item.storage_index
            mine = own.get(key)
            if mine is None:
                try:
                    found[key] = merged[key]
                except KeyError:
                    chunk = f" (chunk at {list(key.offset or ())})"
                    raise self._unlocated(key.fqn, chunk) from None
                own[key] = key
            elif mine is not key:
                object.__setattr__(item, "storage_index", mine)  # a frozen dataclass

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        _gc.hold_through_dcp_call()  # begun in read_metadata, unless this rank did not read it
        if self._deferred_error is not None:
            raise self._deferred_error
        if self._step is None:  # DCP always reads metadata first; guard direct use
            raise CheckpointNotFoundError("read_metadata() must run before set_up_storage_reader")
        # A load (not a look at the metadata): read its files ahead while DCP plans it
        self._stop_prefetch()
        step = self._step
        if step.verified_format and step.local and self._index_is_local:  # data likely here
            self._prefetching = _prefetch.start(self._tier.backend, step.name)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # ------------------------------------------------------------ data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return self._read_data(plan, planner)
        finally:
            _gc.end_hold()  # this rank's last hook of the load

    @_gc.paused_during  # a few objects per item, none in cycles: see _gc
    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            # whole tensors the planner left to us first (their failures: read items)
            items = plan.items + self._read_by_columns(planner)
        finally:
            self._read_buffers = [bytearray(), bytearray()]
        self._locate(items)
        locations = self._locations
        by_file: dict[str, list[tuple[int, int, ReadItem]]] = {}
        for n, item in enumerate(items):  # n: a stable sort that never compares items
            loc = locations[item.storage_index]
            by_file.setdefault(loc.relative_path, []).append((loc.offset, n, item))
        local: list[tuple[str, list[ReadItem]]] = []
        remote: list[tuple[str, list[ReadItem]]] = []
        for name, placed in sorted(by_file.items()):
            placed.sort()
            items = [item for _, _, item in placed]
            (local if self._valid_locally(name) else remote).append((name, items))
        try:
            self._load_local(local, planner)
        finally:
            self._read_buffers = [bytearray(), bytearray()]  # as large as the largest item
            self._stop_prefetch()  # what it read ahead has been read
        if remote:
            for item, payload in self._remote_payloads(remote):
                self._deliver(item, payload, planner)
        if self.hydrate and self.files_read_remotely:
            self._hydrate(sorted(self.files_read_remotely))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _stop_prefetch(self) -> None:
        if self._prefetching is not None:
            self._prefetching.stop()
            self._prefetching = None

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


def _canonical(items: list[ReadItem], locations: dict[Any, ItemLocation]) -> list[Any]:
    """Each item's storage index as the located (equal) key object, which the item then
    holds: the reader looks every item up several times, and a dict finds its own key by
    identity, where an equal copy costs a field-by-field comparison (a third of a restore of
    20,000 tensors). The items' values do not change."""
    own = {k: k for k in locations}
    out = []
    for item in items:
        key = own.get(item.storage_index, item.storage_index)
        if key is not item.storage_index:
            object.__setattr__(item, "storage_index", key)  # a frozen dataclass: same value
        out.append(key)
    return out
