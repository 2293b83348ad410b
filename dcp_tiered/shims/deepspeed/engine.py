"""DeepSpeed's checkpoint-engine protocol on the lifecycle: :class:`TieredCheckpointEngine`
(see :mod:`dcp_tiered.shims.deepspeed` for how the protocol maps onto DCP steps)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...config import RemoteConfig
from ...errors import CheckpointNotFoundError, ConfigError
from ...lifecycle import Conventions, Lifecycle
from ...lifecycle.roots import local_tier, validate_step_name
from .. import skeleton
from .files import SIDECARS, adopt, bytes_tensor, deepspeed_classes, is_stub, publish, read_file

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
        CheckpointCommitInfo,
        CheckpointEngine,
    )
except ImportError as e:  # pragma: no cover - exercised only without DeepSpeed
    raise ImportError(
        "dcp_tiered.shims.deepspeed needs DeepSpeed: pip install 'dcp-tiered[deepspeed]'"
    ) from e


MODES = ("sync", "async", "decoupled")


@dataclass
class Options:
    """What :func:`~dcp_tiered.shims.deepspeed.install` and
    :func:`~dcp_tiered.shims.deepspeed.attach` configure (see the former)."""

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
        if os.path.exists(path) and not is_stub(path):
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
            local_tier(load_dir).undo_interrupted_overwrites()
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
        rank's) inside the step (:func:`~dcp_tiered.shims.deepspeed.write_sidecars` writes them back from any tier);
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
            state[SIDECARS] = {name: bytes_tensor(data) for name, data in sidecars.items()}
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


def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.abspath(path), os.path.abspath(directory)
    return path == directory or path.startswith(directory + os.sep)
