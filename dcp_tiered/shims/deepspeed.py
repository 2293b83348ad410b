"""DeepSpeed: ``engine.save_checkpoint`` / ``load_checkpoint`` through DCP and the tiers.

One line before ``deepspeed.initialize`` (this also covers HF Trainer, which builds the engine
itself)::

    from dcp_tiered.shims import deepspeed as ds_tiers
    ds_tiers.install(mode="async", remote="s3://bucket/run-1")

or ``ds_tiers.attach(engine, ...)`` after it. Then, at the end of training, on every rank::

    ds_tiers.flush(engine)   # waits for the last save and publishes it

How it maps onto DeepSpeed's checkpoint-engine protocol (deepspeed/runtime/engine.py):

- ``save(state, path)``, once per DeepSpeed file, only records the file's state (tensors plus a
  skeleton, see :mod:`dcp_tiered.shims.skeleton`) under the file's name.
- ``commit`` (sync and async modes) writes every rank's files as one DCP step named after the
  tag, ``SAVE_DIR/TAG``, on a dedicated gloo group. ``decoupled`` mode launches the write when
  ``save_checkpoint`` returns and lets DeepSpeed's ``get_commit_info`` poll for completion at
  step boundaries, with a consensus on the checkpoint layer's own gloo group.
- DeepSpeed writes ``latest`` right after ``commit`` returns, with a plain ``open``: for an
  async save that is before the data exists. ``save_checkpoint`` is therefore wrapped to pass
  ``save_latest=False``, and rank 0 publishes ``latest`` itself, atomically, once the step is
  committed (the DCP coordinator finishes only after every rank's data is written).
- DeepSpeed's loader globs for its own file names, so small JSON stubs with those names are
  written into the committed step before ``latest`` moves. ``load(path)`` reads just that
  file's keys, non-collectively, as DeepSpeed expects.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import operator
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _torch_compat
from ..backends.local import LocalBackend, replace_file
from ..backends.remote import remote_backend
from ..config import RemoteConfig
from ..errors import CheckpointNotFoundError, ConfigError, ManifestError
from ..lifecycle import Conventions, Lifecycle
from ..policy.layout import is_step_name, validate_step_name
from ..reader import TieredStorageReader
from ..tiers import catalog, pull
from ..tiers.local import LocalTier
from . import skeleton

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
        CheckpointCommitInfo,
        CheckpointEngine,
    )
except ImportError as e:  # pragma: no cover - exercised only without DeepSpeed
    raise ImportError(
        "dcp_tiered.shims.deepspeed needs DeepSpeed: pip install 'dcp-tiered[deepspeed]'"
    ) from e

logger = logging.getLogger(__name__)

MODES = ("sync", "async", "decoupled")
STUB_FORMAT = "dcp_tiered.deepspeed-stub/1"
LATEST_NAME = "latest"
SIDECARS = "dcp_tiered.sidecars"  # files of the framework's own that travel inside the step


def deepspeed_classes() -> list[type]:
    """Plain-data classes DeepSpeed puts in its checkpoint files (beside tensors and dicts)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@dataclass
class Options:
    """What :func:`install` and :func:`attach` configure (see :func:`install`)."""

    mode: str = "async"
    remote: str | RemoteConfig | None = None
    storage_options: Mapping[str, Any] | None = None
    trusted_classes: tuple[type, ...] = ()
    writer_options: dict[str, Any] = field(default_factory=dict)
    allow_pickle: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")


CONVENTIONS = Conventions(
    "DeepSpeed",
    overwrite_hint=(
        "pass overwrite=True to ds_tiers.install()/attach() to replace an existing "
        "tag atomically, as stock DeepSpeed does"
    ),
    kept="'latest' still names the previous checkpoint",
)


class TieredCheckpointEngine(CheckpointEngine):
    """A DeepSpeed ``CheckpointEngine`` that saves each checkpoint as one tiered DCP step.

    Built on every rank (DeepSpeed builds it in ``initialize``): its lifecycle's gloo groups
    are created there, collectively. What happens around a save (one in flight, failures on
    every rank, ``latest`` once committed, durability at the end) is
    :class:`~dcp_tiered.lifecycle.Lifecycle`'s; this class translates DeepSpeed's protocol.
    """

    def __init__(self, options: Options | None = None, config_params: Any = None) -> None:
        super().__init__(config_params)
        self.name = "dcp_tiered"
        self.options = options or Options()
        self.lifecycle = Lifecycle(
            CONVENTIONS,
            remote=self.options.remote,
            storage_options=self.options.storage_options,
            writer_options=self.options.writer_options,
            # async: 'latest' moves once the step is committed; decoupled: when DeepSpeed
            # commits it; sync: before save_checkpoint returns.
            publish_early=self.options.mode == "async",
            # A save must load back as read_file loads it: weights_only, DeepSpeed's classes
            # and the caller's trusted ones allowed (or full pickle, with allow_pickle).
            allow_pickle=self.options.allow_pickle,
            trusted_classes=(*deepspeed_classes(), *self.options.trusted_classes),
        )
        self._files: dict[str, dict[str, Any]] = {}  # DeepSpeed file name -> split state
        # DeepSpeed file name -> the state as DeepSpeed gave it, checked before the write
        # (the split state holds it serialised); dropped once the write starts.
        self._originals: dict[str, Any] = {}
        self._info: CheckpointCommitInfo | None = None
        self._want_latest = True  # what the caller passed to save_checkpoint
        self._holding = False  # see holding()
        self._held: tuple[CheckpointCommitInfo, bool] | None = None

    # -------------------------------------------------------------- DeepSpeed protocol

    def create(self, info: CheckpointCommitInfo) -> None:
        self.wait()  # one save in flight at a time; an earlier failure surfaces here
        validate_step_name(info.tag)
        self._info, self._files, self._originals = info, {}, {}

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        # The tag directory appears with the DCP step's atomic rename, not before.
        if self._info is not None and _inside(path, self._tag_dir(self._info)):
            return
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        if self._info is None:
            raise ConfigError("save() called outside save_checkpoint (no create() first)")
        name = os.path.relpath(path, self._tag_dir(self._info))
        if name.startswith(os.pardir) or os.path.isabs(name):
            raise ConfigError(
                f"DeepSpeed asked to save {path!r} outside {self._tag_dir(self._info)}"
            )
        self._files[name] = skeleton.split(state_dict)
        self._originals[name] = state_dict

    def commit(self, info: CheckpointCommitInfo) -> bool:
        if self.options.mode == "decoupled":
            self.wait()  # DeepSpeed calls this once get_commit_info() said every rank is done
        else:
            self._launch(info, self.options.mode == "sync")
        return True

    def is_decoupled(self) -> bool:
        return self.options.mode == "decoupled"

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """Decoupled mode, at every step boundary: the info once every rank's write is done
        (collective: every rank has the same save in flight)."""
        if self.lifecycle.in_flight is None or self._info is None:
            return None
        return self._info if self.lifecycle.written() else None

    def cleanup(self) -> None:
        self.flush()

    def preserves_storage_sharing(self) -> bool:
        return False  # every tensor is written on its own; no need for DeepSpeed's clones

    def load(self, path: str, map_location: Any = None) -> Any:
        tag_dir = os.path.dirname(path)
        save_dir, tag = os.path.dirname(tag_dir), os.path.basename(tag_dir)
        if os.path.exists(path) and not _is_stub(path):
            return self._load_native(path)
        state = read_file(
            save_dir,
            tag,
            os.path.basename(path),
            remote=self.options.remote,
            storage_options=self.options.storage_options,
            trusted_classes=self.options.trusted_classes,
            allow_pickle=self.options.allow_pickle,
        )
        if map_location is not None and not callable(map_location):
            state = skeleton.map_leaves(
                state, lambda v: v.to(map_location) if isinstance(v, torch.Tensor) else v
            )
        return state

    # -------------------------------------------------------------- ours

    def prepare_load(self, load_dir: str, tag: str | None) -> None:
        """Before DeepSpeed's loader runs (every rank): a step whose overwrite a crash
        interrupted gets its name back and, with a remote tier, a step that is not
        on this node's disk (a fresh or replaced node) is adopted from the remote, with its
        stubs and, if none is there, ``latest``, so that DeepSpeed finds it. Its data is read
        from the remote, verified, when DeepSpeed loads the files. Collective."""

        def prepare() -> None:
            # DeepSpeed looks for the tag directory itself: a step whose overwrite a crash
            # interrupted gets its name back first.
            LocalTier(LocalBackend(load_dir)).undo_interrupted_overwrites()
            if self.options.remote is not None:
                adopt(load_dir, tag, self.options.remote, self.options.storage_options)

        self.lifecycle.agree.by_node_leaders(
            prepare, f"preparing {load_dir} for loading", error=CheckpointNotFoundError
        )

    def launch_decoupled(self) -> None:
        """Starts the write of the checkpoint just saved (decoupled mode)."""
        if self._info is not None and self.options.mode == "decoupled":
            self._launch(self._info, False)

    def wait(self) -> None:
        """Collective: finishes the save in flight and its publication; raises
        SaveFailedError on every rank if it failed on any. Nothing of a failed save is kept,
        so the next save starts clean."""
        self.lifecycle.finish()

    def flush(self, timeout_secs: float | None = None) -> None:
        """Call on every rank at the end of training: finishes and publishes the last save
        and, with a remote tier, waits until every step saved here is durable there (at most
        ``timeout_secs``, default the remote's ``durable_timeout_secs``). Raises on every rank
        if any rank's save or upload failed."""
        self.lifecycle.close(timeout_secs)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Within, a checkpoint's write waits for :meth:`release`: HF Trainer writes its own
        files of a checkpoint (``trainer_state.json``, RNG states) after DeepSpeed's, and they
        travel inside the step."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    def release(
        self, sidecars: Mapping[str, bytes], on_commit: Callable[[], Any] | None = None
    ) -> bool:
        """Starts the write held by :meth:`holding`, with ``sidecars`` (file name: bytes, this
        rank's) inside the step (:func:`write_sidecars` writes them back from any tier);
        ``on_commit`` runs on rank 0 once committed. False: nothing was held."""
        held, self._held = self._held, None
        if held is not None:
            self._launch(*held, sidecars=sidecars, then=on_commit)
        return held is not None

    def _launch(
        self,
        info: CheckpointCommitInfo,
        sync: bool,
        *,
        sidecars: Mapping[str, bytes] | None = None,
        then: Callable[[], Any] | None = None,
    ) -> None:
        if self._holding:
            self._held = (info, sync)
            return
        state: dict[str, Any] = self._files
        originals, self._files, self._originals = self._originals, {}, {}
        if sidecars:  # as bytes tensors: they load back without unpickling anything
            state[SIDECARS] = {name: _bytes_tensor(data) for name, data in sidecars.items()}
        latest = self._want_latest

        def publication() -> None:
            publish(info.save_dir, info.tag, latest=latest)
            if then is not None:
                then()

        self.lifecycle.save(
            info.save_dir, info.tag, state, sync=sync, on_commit=publication, values=originals
        )

    @staticmethod
    def _tag_dir(info: CheckpointCommitInfo) -> str:
        return os.path.join(info.save_dir, info.tag)

    def _load_native(self, path: str) -> Any:
        """A file DeepSpeed wrote itself: torch's weights_only loader, DeepSpeed's classes only."""
        with torch.serialization.safe_globals(
            [*deepspeed_classes(), *self.options.trusted_classes]
        ):
            return torch.load(path, map_location="cpu", weights_only=True)


# ------------------------------------------------------------------ reading and publishing


def read_file(
    save_dir: str,
    tag: str,
    name: str,
    *,
    remote: str | RemoteConfig | None = None,
    storage_options: Mapping[str, Any] | None = None,
    trusted_classes: Iterable[type] = (),
    allow_pickle: bool = False,
) -> Any:
    """DeepSpeed file ``name`` of step ``tag``, as DeepSpeed saved it. Not collective.

    Only that file's keys are read, from the nearest tier holding a valid copy.
    ``allow_pickle``: rebuild its structure with full pickle (checkpoints you trust only).
    """
    reader = TieredStorageReader(
        save_dir, remote=remote, storage_options=storage_options, allow_pickle=allow_pickle
    )
    reader.reset(tag)
    out: dict[str, Any] = {}
    _torch_compat.load_keys(out, {name}, reader)
    if name not in out:
        raise FileNotFoundError(f"step {tag!r} in {save_dir} holds no DeepSpeed file {name!r}")
    return skeleton.join(
        out[name],
        where=f"{os.path.join(save_dir, tag, name)} (step {tag!r})",
        trusted=[*deepspeed_classes(), *trusted_classes],
        allow_pickle=allow_pickle,
    )


def file_names(save_dir: str, tag: str) -> list[str]:
    """The DeepSpeed files a committed step holds, from its verified manifest."""
    planner_data = LocalTier(LocalBackend(save_dir)).read_manifest(tag).metadata.planner_data
    return sorted(
        {str(path[0]) for path in (planner_data or {}).values() if path and path[0] != SIDECARS}
    )


def write_sidecars(
    save_dir: str,
    tag: str,
    directory: str,
    *,
    remote: str | RemoteConfig | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Writes the files that travel inside step ``tag`` (see
    :meth:`TieredCheckpointEngine.release`) into ``directory``, from the nearest tier holding a
    valid copy; returns their names. Not collective."""
    reader = TieredStorageReader(save_dir, remote=remote, storage_options=storage_options)
    reader.reset(tag)
    out: dict[str, Any] = {}
    _torch_compat.load_keys(out, {SIDECARS}, reader)
    files = out.get(SIDECARS, {})
    backend = LocalBackend(directory)
    for name in files:
        if not is_step_name(name):  # a plain file name: nothing that climbs out of directory
            raise ManifestError(
                f"step {tag!r} in {save_dir} carries a file named {name!r}, "
                "which is not a plain file name; nothing was written"
            )
    for name, data in files.items():
        backend.replace_root_file(name, data.numpy().tobytes())
    return sorted(files)


def adopt(
    save_dir: str,
    tag: str | None,
    remote: str | RemoteConfig,
    storage_options: Mapping[str, Any] | None = None,
) -> str | None:
    """Make step ``tag`` (default: what ``latest`` names, else the newest step on either tier)
    loadable by DeepSpeed from ``save_dir``, adopting it from the remote if this disk lacks it.
    Returns the tag, or None when neither tier holds a step (a fresh start)."""
    tier, backend = LocalTier(LocalBackend(save_dir)), remote_backend(remote, storage_options)
    assert backend is not None
    latest_path = os.path.join(save_dir, LATEST_NAME)
    has_latest = os.path.isfile(latest_path)
    if tag is None and has_latest:
        with open(latest_path, encoding="utf-8") as f:
            tag = f.read().strip()
    if tag is None:
        try:
            tag = catalog.resolve(tier, backend, None).name
        except CheckpointNotFoundError:
            return None
    tag = validate_step_name(str(tag))
    if tier.has_step(tag) and has_latest:
        return tag
    pull.adopt_remote_step(tier, backend, tag)
    publish(save_dir, tag, latest=not has_latest)
    return tag


def publish(save_dir: str, tag: str, *, latest: bool) -> None:
    """Writes DeepSpeed's file stubs into the committed step, then (optionally) ``latest``.

    The stub names come from the committed step's own metadata, so they can be rebuilt from
    any copy of the step (for instance one restored from the remote tier).
    """
    step_dir = os.path.join(save_dir, tag)
    for name in file_names(save_dir, tag):
        replace_file(os.path.join(step_dir, name), _stub(step_dir, name))
    if latest:
        replace_file(os.path.join(save_dir, LATEST_NAME), tag.encode())
        logger.info("published %s as the latest DeepSpeed checkpoint in %s", tag, save_dir)


class _StubError:
    """Unpickles to ``{}[message]``: DeepSpeed's own tools (``zero_to_fp32``, ``ds_to_universal``)
    load the stub with a full unpickler and stop with this KeyError, which says what to run.
    Nothing else runs; dcp_tiered itself never unpickles a stub (see ``_is_stub``)."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return operator.getitem, ({}, self.message)


def _stub(step_dir: str, name: str) -> bytes:
    message = (
        f"{STUB_FORMAT}: {name} is a placeholder written by dcp_tiered; the data of "
        f"{os.path.basename(step_dir)} is in the DCP step in {step_dir}. DeepSpeed loads it "
        "with dcp_tiered.shims.deepspeed installed. For DeepSpeed's own tools, convert it "
        f"first: 'dcp-tiered convert deepspeed {step_dir} OUT' writes full fp32 weights and "
        "optimizer state as DCP; add --native to write DeepSpeed's own files (zero_to_fp32)."
    )
    buf = io.BytesIO()
    torch.save(_StubError(message), buf)  # a real torch file: zero_to_fp32 opens it with mmap
    return buf.getvalue()


# ------------------------------------------------------------------ installing


def install(
    *,
    mode: str = "async",
    remote: str | RemoteConfig | None = None,
    storage_options: Mapping[str, Any] | None = None,
    trusted_classes: Iterable[type] = (),
    allow_pickle: bool = False,
    **writer_options: Any,
) -> None:
    """Makes every DeepSpeed engine built from now on checkpoint through dcp_tiered.

    Call before ``deepspeed.initialize`` (or before ``Trainer.train`` for HF + DeepSpeed).

    Args:
        mode: ``"sync"`` (``save_checkpoint`` returns once committed), ``"async"`` (it returns
            once the state is staged; ``latest`` moves when the write is done) or
            ``"decoupled"`` (DeepSpeed's own async protocol: completion is polled at step
            boundaries).
        remote: a remote tier (fsspec URL or RemoteConfig) each step is promoted to.
        trusted_classes: extra classes your ``client_state`` holds, allowed when loading.
        allow_pickle: load the checkpoint's non-tensor values with full pickle. Only for
            checkpoints you trust: a pickle can run arbitrary code. Without it, a save whose
            state holds a value that would not load back (a class neither DeepSpeed's nor in
            ``trusted_classes``) is refused with ConfigError, on every rank, before anything
            is written.
        writer_options: passed to :class:`TieredStorageWriter` (``thread_count``, ...).
    """
    import deepspeed.runtime.engine as ds_engine

    options = Options(
        mode, remote, storage_options, tuple(trusted_classes), writer_options, allow_pickle
    )
    _patch_save_checkpoint(ds_engine.DeepSpeedEngine)
    _patch_load_checkpoint(ds_engine.DeepSpeedEngine)
    ds_engine.create_checkpoint_engine = functools.partial(_factory, options)


def uninstall() -> None:
    """Undoes :func:`install` for engines built from now on."""
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.runtime.checkpoint_engine import create_checkpoint_engine

    ds_engine.create_checkpoint_engine = create_checkpoint_engine


def attach(engine: Any, **kwargs: Any) -> TieredCheckpointEngine:
    """Switches an engine that ``deepspeed.initialize`` already built (same arguments as
    :func:`install`). Call on every rank."""
    trusted = tuple(kwargs.pop("trusted_classes", ()))
    allow_pickle = bool(kwargs.pop("allow_pickle", False))
    options = Options(
        kwargs.pop("mode", "async"),
        kwargs.pop("remote", None),
        kwargs.pop("storage_options", None),
        trusted,
        kwargs,
        allow_pickle,
    )
    _patch_save_checkpoint(type(engine))
    _patch_load_checkpoint(type(engine))
    engine.checkpoint_engine = TieredCheckpointEngine(options)
    return engine.checkpoint_engine


def flush(engine: Any, timeout_secs: float | None = None) -> None:
    """Call on every rank at the end of training: the last checkpoint is committed, ``latest``
    names it and, with a remote tier, every step saved is durable there when this returns
    (see :meth:`TieredCheckpointEngine.flush`)."""
    if isinstance(engine.checkpoint_engine, TieredCheckpointEngine):
        engine.checkpoint_engine.flush(timeout_secs)


def _factory(options: Options, config_params: Any = None, **_: Any) -> TieredCheckpointEngine:
    return TieredCheckpointEngine(options, config_params)


def _patch_load_checkpoint(cls: type[Any]) -> None:
    original = cls.load_checkpoint
    if getattr(original, "_dcp_tiered", False):
        return

    @functools.wraps(original)
    def load_checkpoint(
        self: Any, load_dir: str, tag: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        engine = getattr(self, "checkpoint_engine", None)
        if isinstance(engine, TieredCheckpointEngine):
            engine.prepare_load(load_dir, tag)
        return original(self, load_dir, tag, *args, **kwargs)

    load_checkpoint._dcp_tiered = True  # type: ignore[attr-defined]
    cls.load_checkpoint = load_checkpoint


def _patch_save_checkpoint(cls: type[Any]) -> None:
    original = cls.save_checkpoint
    if getattr(original, "_dcp_tiered", False):
        return

    @functools.wraps(original)
    def save_checkpoint(
        self: Any,
        save_dir: str,
        tag: Any = None,
        client_state: Any = None,
        save_latest: bool = True,
        **kwargs: Any,
    ) -> Any:
        engine = getattr(self, "checkpoint_engine", None)
        if not isinstance(engine, TieredCheckpointEngine):
            return original(self, save_dir, tag, client_state or {}, save_latest, **kwargs)
        engine._want_latest = save_latest  # we publish it, atomically, once committed
        done = original(self, save_dir, tag, client_state or {}, False, **kwargs)
        engine.launch_decoupled()
        return done

    save_checkpoint._dcp_tiered = True  # type: ignore[attr-defined]
    cls.save_checkpoint = save_checkpoint


# ------------------------------------------------------------------ helpers


def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.abspath(path), os.path.abspath(directory)
    return path == directory or path.startswith(directory + os.sep)


def _is_stub(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(1024)  # the message sits, uncompressed, near the start of the zip
    return STUB_FORMAT.encode() in head


def _bytes_tensor(data: bytes) -> torch.Tensor:
    """A copy of ``data`` as a uint8 tensor (torch.frombuffer refuses an empty buffer)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
