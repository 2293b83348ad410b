"""torchtitan: its checkpoint manager, saving and loading through the tiers.

One entry in the job's configuration, torchtitan's own override mechanism, replaces its
``CheckpointManager`` (``--checkpoint.*`` options keep their meaning)::

    --override.imports 'dcp_tiered.shims.torchtitan.tiered_checkpoint={"remote": "s3://b/run"}'

or, building the config in Python, ``checkpoint=TieredCheckpointManager.Config(enable=True,
tiers=TierOptions(remote="s3://b/run"), ...)``. torchft's ``TorchFTCheckpointManager`` is served
by :mod:`dcp_tiered.shims.torchtitan_ft` the same way: :class:`TieredCheckpointMixin` is a mixin.

What changes against stock torchtitan, in every ``async_mode``:

- every save of ``checkpoint.folder/step-N`` goes through :class:`TieredStorageWriter` on a gloo
  group of its own (atomic, checksummed, copied to ``tiers.remote`` in the background); a save
  that fails on any rank raises SaveFailedError on every rank, at the save or at the next one
  (async). ``async_with_pinned_mem`` stages through the writer's reused host buffers (pinned
  where CUDA is available) when the save is called, instead of torchtitan's ``DefaultStager``
  (which needs an accelerator: on a CPU-only machine it cannot be built) and a checkpoint process.
- ``load`` restores the newest committed step on the local folder or the remote tier (rank 0
  lists, every rank loads the same one), verified byte for byte, falling back to older steps
  and moving the skipped ones aside; a step held only by the remote tier loads on a fresh node.
  It never uses torchtitan's ``_find_load_step``, whose ``step-(\\d+)`` search also matches
  dcp_tiered's hidden ``.step-N.*`` directories (a crashed commit would block every restart).
  Without a step of ours, torchtitan's own initial load (``initial_load_path``, HF weights)
  runs as before.
- ``keep_latest_k`` is dcp_tiered's retention (a step is deleted only once the remote holds it;
  ``tiers.remote_keep_latest_k`` for the remote). torchtitan's purge never runs: it deletes
  anything named ``step-N``, quarantined steps included.
- ``close`` (the trainer's) waits until the last save is committed and every step is durable on
  the remote tier, and raises on every rank if one is not.
- Recovery at start: what a crash left in the folder is finished or swept, uploads resumed.

Not supported: a remote ``checkpoint.folder`` (use a local folder and ``tiers.remote``), and
``last_save_in_hf`` (export a step with ``dcp-tiered export --format safetensors``).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from .. import RetentionPolicy
from ..config import RemoteConfig
from ..errors import CheckpointNotFoundError, ConfigError
from ..lifecycle import Conventions, Lifecycle, attempt, settled
from ..lifecycle.roots import STEP, numbered_steps, remote_backend
from ..reader import TieredStorageReader

try:
    from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
    from torchtitan.config import override
    from torchtitan.config.override import derive
    from torchtitan.tools import filesystem
    from torchtitan.tools.utils import GarbageCollection
except ImportError as e:  # pragma: no cover - exercised only without torchtitan
    raise ImportError(
        "dcp_tiered.shims.torchtitan needs torchtitan: pip install 'dcp-tiered[torchtitan]'"
    ) from e

logger = logging.getLogger(__name__)

CONVENTIONS = Conventions(
    "torchtitan",
    overwrite_hint="save under another step or folder",
    kept="the earlier step-N checkpoints are intact",
)


@dataclass(kw_only=True, slots=True)
class TierOptions:
    """dcp_tiered's options (``--checkpoint.tiers.*``); ``keep_latest_k`` stays torchtitan's."""

    remote: str | RemoteConfig | None = None
    """fsspec URL of the remote tier every step is copied to (s3://bucket/run, file://...), or
    a :class:`~dcp_tiered.RemoteConfig` (retries, timeouts) from Python."""

    storage_options: dict[str, Any] | None = None
    """fsspec options of the remote (endpoint, credentials); None: the environment's."""

    remote_keep_latest_k: int = 0
    """Steps kept on the remote tier; 0 keeps every one."""

    allow_pickle: bool = False
    """Load non-tensor values with full pickle: only for checkpoints you trust. Without it, a
    save holding a value weights_only loading refuses is refused on every rank."""

    on_unreadable_tier: Literal["raise", "skip"] = "raise"
    """A remote that cannot be read at load: raise on every rank, or restore from the rest."""

    collective_timeout_secs: float = 1800.0
    """How long a rank waits for the others in dcp_tiered's collectives."""

    writer_options: dict[str, Any] = field(default_factory=dict)
    """More TieredStorageWriter arguments (thread_count, ...)."""


class _WriterStages:
    """Stands where torchtitan keeps its ``DefaultStager`` (which it builds on the first
    ``async_with_pinned_mem`` save and which needs an accelerator): the writer stages."""

    def close(self) -> None:
        pass


class TieredCheckpointMixin:
    """The tiers under a torchtitan checkpoint manager: put it first among the bases of a
    subclass of ``CheckpointManager`` (or of one of its subclasses), whose nested ``Config``
    has a ``tiers: TierOptions`` field. Construct on every rank, as torchtitan does."""

    lifecycle: Lifecycle
    # torchtitan's manager sets these (the class this is mixed into).
    folder: str
    states: dict[str, Any]
    save_future: Future[None] | None
    _closed = True  # until the lifecycle exists: nothing to close

    def __init__(self, config: Any, **kwargs: Any) -> None:
        if config.enable and config.last_save_in_hf:
            raise ConfigError(
                "checkpoint.last_save_in_hf is not supported with dcp_tiered's checkpoints: "
                "export a step with `dcp-tiered export --format safetensors` instead"
            )
        keep = config.keep_latest_k
        if config.enable and keep:  # no purge thread: retention is ours
            config = derive(config, type(config), keep_latest_k=0)
        super().__init__(config, **kwargs)  # type: ignore[call-arg]
        if not config.enable:
            return
        if filesystem.is_remote(self.folder):
            raise ConfigError(
                f"checkpoint.folder {self.folder!r} is remote: give a local folder (the node's "
                "disk) and the object store as checkpoint.tiers.remote"
            )
        tiers: TierOptions = config.tiers
        self.tiers = tiers
        self.root = os.path.abspath(self.folder)
        os.makedirs(self.root, exist_ok=True)
        self.keep_latest_k = keep
        self.lifecycle = Lifecycle(
            CONVENTIONS,
            remote=tiers.remote,
            storage_options=tiers.storage_options,
            retention=RetentionPolicy(keep_latest=keep) if keep else None,
            remote_retention=(
                RetentionPolicy(keep_latest=tiers.remote_keep_latest_k)
                if tiers.remote_keep_latest_k
                else None
            ),
            writer_options={"overwrite": True, **tiers.writer_options},
            collective_timeout_secs=tiers.collective_timeout_secs,
            allow_pickle=tiers.allow_pickle,
        )
        self._closed = False
        self.stager = _WriterStages()
        self._written: Future[None] | None = None  # the async save torchtitan waits for
        self.lifecycle.start(self.root)  # recovery, explicitly, on every rank

    # ------------------------------------------------------------ saving

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[None] | AsyncSaveResponse | None:
        """torchtitan's one entry for writing a checkpoint: ours for ``folder/step-N``;
        another folder (torchft's per-replica data-loader checkpoints) is torchtitan's."""
        root, step = os.path.split(os.path.abspath(checkpoint_id))
        if to_hf or root != self.root:
            return super().dcp_save(  # type: ignore[misc]
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        # DCP would call each Stateful's state_dict(); called once here, the restorability
        # check sees the values that are saved.
        state = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
        sync = async_mode == AsyncMode.DISABLED
        self.lifecycle.save(root, step, state, sync=sync)
        logger.info("torchtitan checkpoint %s %s", step, "committed" if sync else "being written")
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        if sync:
            return None
        self._written = Future()
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            return AsyncSaveResponse(staging_completion=settled(), upload_completion=self._written)
        return self._written

    def _wait_for_saving(self) -> None:
        """Collective (torchtitan calls it on every rank before the next save): the async save
        is committed, or SaveFailedError is raised on every rank."""
        written, self._written = self._written, None
        self.save_future = None
        try:
            self.lifecycle.finish()
        except BaseException as e:
            if written is not None:
                written.set_exception(e)
            raise
        if written is not None:
            written.set_result(None)

    def _purge_stale_checkpoints(self) -> None:
        """Never torchtitan's purge: retention runs after each commit (``keep_latest_k``)."""

    def _find_load_step(self, folder: str = "") -> int:
        """The newest committed step of ours; another folder (torchft's per-replica
        checkpoints) is torchtitan's to search."""
        if folder and os.path.abspath(folder) != self.root:
            return super()._find_load_step(folder)  # type: ignore[misc]
        steps = self.committed()
        return _number(steps[0]) if steps else -1

    def _close(self) -> None:
        """Collective, at the end of the job: the last save committed, every step durable on
        the remote tier; raises on every rank if one is not."""
        if self._closed:
            return
        self._closed = True
        try:
            self.lifecycle.close()
        finally:
            super()._close()  # type: ignore[misc]

    def __del__(self) -> None:
        # Garbage collection is no place for a collective: release without waiting.
        if not self._closed:
            self._closed = True
            logger.warning("torchtitan checkpointer collected without close(): not waiting")
            self.lifecycle.release()

    # ------------------------------------------------------------ loading

    def committed(self, *, with_remote: bool = True) -> list[str]:
        """The committed ``step-N`` steps on the local folder and the remote tier, newest
        first (an unreadable remote raises TierUnavailableError)."""
        remote = (
            remote_backend(self.tiers.remote, self.tiers.storage_options) if with_remote else None
        )
        found = numbered_steps(self.root, remote, STEP, strict=True)
        return [s.name for _, s in reversed(found)]

    def _load(self, step: int = -1) -> bool:
        """Collective: restores ``step`` (-1: the newest that loads) from the tiers; without a
        step of ours, torchtitan's initial load (``initial_load_path``, HF weights) runs."""
        wanted = None if step == -1 else STEP.build(step)

        def candidates(with_remote: bool) -> list[str]:
            steps = self.committed(with_remote=with_remote)
            if wanted:
                return [s for s in steps if s == wanted]
            if steps and _number(steps[0]) and not self._is_full(steps[0]):
                raise ConfigError(
                    f"{steps[0]} in {self.root} is the model-only checkpoint torchtitan saves at "
                    "the last step (checkpoint.last_save_model_only): this training finished, "
                    "and it cannot resume from it. Train on in another checkpoint.folder, or "
                    "set checkpoint.load_step to a full step (its last-step save is then made "
                    "again); checkpoint.last_save_model_only=False keeps the last step whole."
                )
            return steps

        chosen = self.lifecycle.restore(
            candidates,
            self._load_step,
            on_unreadable_tier=self.tiers.on_unreadable_tier,
            retry="TierOptions",
            abandon=self._abandon,
        )
        if chosen is not None:
            logger.info("torchtitan: restored %s", chosen)
            return True
        if wanted is not None:
            raise CheckpointNotFoundError(
                f"--checkpoint.load_step={step}: no committed {wanted} in {self.root}"
                + (f" nor on {self.tiers.remote}" if self.tiers.remote else "")
            )
        return super()._load(step)  # type: ignore[misc]

    def _abandon(self, proven: list[str], passed: list[str], chosen: str) -> None:
        """After a restore fell back to ``chosen``: the newer steps some rank proved bad
        quarantined, the others it passed over kept until saved again (see
        :meth:`~dcp_tiered.lifecycle.Lifecycle.pass_over`)."""
        reason = f"a restore fell back past it to {chosen}"
        self.lifecycle.quarantine(
            self.root, [s for s in proven if _number(s) > _number(chosen)], reason=reason
        )
        self.lifecycle.pass_over(self.root, [s for s in passed if _number(s) > _number(chosen)])

    def _load_step(self, step: str) -> str | None:
        """Collective: loads ``step`` into the live states; None, or why it could not."""
        reader = TieredStorageReader(
            self.root,
            remote=self.tiers.remote,
            storage_options=self.tiers.storage_options,
            allow_pickle=self.tiers.allow_pickle,
        )

        def prepare() -> dict[str, Any]:
            # As torchtitan: the seed checkpoint (step 0) restores the model alone, and so
            # does a model-only step asked for by number.
            full = _number(step) != 0 and self._is_full(step, reader)
            return self._states_to_load(not full)  # type: ignore[attr-defined]

        states, problem = attempt(prepare)
        if not self.lifecycle.agree.all(problem is None):
            return problem or "failed on another rank"
        _, problem = attempt(
            dcp.load,
            states,
            checkpoint_id=step,
            storage_reader=reader,
            process_group=self.lifecycle.group,
        )
        if problem is None and MODEL in self.states:
            # Model tensors are flattened into the state; torchtitan applies them the same way.
            _, problem = attempt(self.states[MODEL].load_state_dict, states)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        return problem

    def _is_full(self, step: str, reader: TieredStorageReader | None = None) -> bool:
        """Whether ``step`` holds more than the model (read from its metadata)."""
        if reader is None:
            reader = TieredStorageReader(
                self.root, remote=self.tiers.remote, storage_options=self.tiers.storage_options
            )
        reader.reset(step)
        others = set(self.states) - {MODEL}
        return any(k.split(".")[0] in others for k in reader.read_metadata().state_dict_metadata)


class TieredCheckpointManager(TieredCheckpointMixin, CheckpointManager):
    """torchtitan's ``CheckpointManager`` on the tiers (see the module's docs)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        tiers: TierOptions = field(default_factory=TierOptions)
        """dcp_tiered's options: the remote tier, trust, timeouts."""


@override(
    target=CheckpointManager.Config,
    exact=True,
    description="dcp_tiered: checkpoints through the local and remote tiers",
)
def tiered_checkpoint(config: CheckpointManager.Config, **tiers: Any) -> Any:
    """The override entry: ``--override.imports dcp_tiered.shims.torchtitan.tiered_checkpoint``
    (with ``={"remote": ...}`` for :class:`TierOptions`)."""
    return derive(config, TieredCheckpointManager.Config, tiers=TierOptions(**tiers))


def _number(step: str) -> int:
    number = STEP.parse(step)
    assert number is not None, step  # every step listed is named exactly as STEP builds
    return number


__all__ = [
    "TierOptions",
    "TieredCheckpointManager",
    "TieredCheckpointMixin",
    "tiered_checkpoint",
]
