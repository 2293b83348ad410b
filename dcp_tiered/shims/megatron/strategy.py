"""megatron-core ``dist_checkpointing`` strategies that save and load through the tiers.

    from dcp_tiered.shims.megatron.strategy import TieredSaveShardedStrategy
    strategy = TieredSaveShardedStrategy(remote="s3://bucket/run-1")    # on every rank
    dist_checkpointing.save(sharded_state_dict, "ckpt/iter_0000100", sharded_strategy=strategy)

or, in Megatron-LM, ``checkpointing_context["save_strategy"] = strategy``.

The save reuses mcore's own ShardedTensor -> DCP translation and ``MCoreSavePlanner``, and
calls stock ``torch.distributed.checkpoint`` with :class:`TieredStorageWriter`: the directory
is published with an atomic rename once every rank's data is written, every byte is
checksummed, and the step is copied to the remote tier in the background. The backend name
stays ``torch_dist``, so stock ``dist_checkpointing.load`` reads the result, resharding
included; :class:`TieredLoadShardedStrategy` reads it from the nearest tier holding a valid
copy instead, verifying every byte.

mcore < 0.19 writes ``common.pt`` (rank 0) into the directory before the sharded save, and
every release writes ``metadata.json`` after it. The atomic rename replaces that directory, so
``common.pt`` is carried inside the DCP step as one more byte item (and so is checksummed and
uploaded; mcore >= 0.19 saves the common state as a ShardedObject in the step itself), and both
files are written back once the step is committed (:func:`write_sidecars`, which also rebuilds
them for a copy restored from the remote tier or held by another node's root: every release
reads a directory's ``common.pt`` first). Supported: megatron-core 0.16 to 0.19, whose
differences live in :mod:`~dcp_tiered.shims.megatron.compat`.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from ... import checkpoint_process_group
from ...lifecycle import Agreement, Writers
from ...lifecycle.restorable import refuse_unrestorable, unrestorable, unrestorable_file
from ...lifecycle.save_thread import SaveThread
from ...reader import TieredStorageReader
from ...writer import TieredStorageWriter
from .._common import upload_future

try:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        is_main_replica,
    )
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner,
        MCoreSavePlanner,
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
        _replace_sharded_keys_with_state_dict_keys,
        _replace_state_dict_keys_with_sharded_keys,
        _restore_dict_types,
        _unwrap_pyt_sharded_tensor,
        mcore_to_pyt_state_dict,
    )
except ImportError as e:  # pragma: no cover - exercised only without megatron-core
    raise ImportError(
        "dcp_tiered.shims.megatron needs megatron-core: pip install 'dcp-tiered[megatron]'"
    ) from e

from . import compat as _mcore_compat  # isort: skip - after megatron-core's own ImportError
from .sidecars import COMMON_NAME, claim_step_dir, write_sidecars  # isort: skip

# The thread every strategy's saves run on (one process saves one step at a time; megatron-core
# may make a strategy per save and never close it, so the thread is not a strategy's own).
_SAVES = SaveThread()


COMMON_KEY = _mcore_compat.CARRIED_COMMON_KEY


def split_dir(checkpoint_dir: str | os.PathLike[str]) -> tuple[str, str]:
    """``(root, step)`` of a checkpoint directory: the tiers' root and the step's name."""
    path = os.path.abspath(os.fspath(checkpoint_dir))
    return os.path.dirname(path), os.path.basename(path)


class _NoStaging(AsyncStager):
    """``async_stager`` for state already snapshotted: DCP's own stager cannot copy mcore's
    wrapper tensors (``CheckpointableShardedTensor`` refuses tensor operations)."""

    _synchronize_after_execute = False  # AsyncStager.should_synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class TieredSaveShardedStrategy(TorchDistSaveShardedStrategy):
    """``torch_dist`` saving through :class:`TieredStorageWriter`. Build it on every rank
    (it creates the gloo group DCP's collectives run on, collectively).

    Args:
        remote, storage_options: the remote tier (see :class:`TieredStorageWriter`).
        keep_only_main_replica: as in mcore: replicas are written once, by the main replica.
        allow_pickle: the checkpoint will be loaded with full pickle (checkpoints you trust,
            see :class:`TieredLoadShardedStrategy`). Without it, a save holding an object
            (a ShardedObject's data, or ``common.pt``'s content) that ``weights_only`` loading
            refuses raises ConfigError on every rank before anything is written.
        writer_options: more :class:`TieredStorageWriter` arguments.
    """

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        *,
        remote: Any = None,
        storage_options: dict[str, Any] | None = None,
        keep_only_main_replica: bool = True,
        writers: Writers | None = None,
        agree: Agreement | None = None,
        allow_pickle: bool = False,
        **writer_options: Any,
    ) -> None:
        super().__init__(backend, version, keep_only_main_replica=keep_only_main_replica)
        self.remote, self.storage_options = remote, storage_options
        self.allow_pickle = allow_pickle
        # One writer per root, kept (shared with the facade's lifecycle when it made us).
        self.writers = writers or Writers(
            remote, storage_options, **{"overwrite": True, **writer_options}
        )
        self._group = checkpoint_process_group()
        # The ranks' agreement on a save that could never be restored (the facade's
        # lifecycle's when it made us; else built at the first save).
        self.agree = agree
        self.in_flight: Future[Any] | None = None  # the newest async save's write

    def writer(self, root: str) -> TieredStorageWriter:
        return self.writers.get(root)

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        """Writes the step on the save thread while the caller waits (see
        :mod:`~dcp_tiered.lifecycle.save_thread`: the trainer's heap stays its own)."""
        _SAVES.run(self._save, sharded_state_dict, checkpoint_dir)

    def _save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        root, step = split_dir(checkpoint_dir)
        self._require_restorable(sharded_state_dict, checkpoint_dir)
        claim_step_dir(root, step)
        dcp.save(
            self._pyt_state_dict(sharded_state_dict, checkpoint_dir),
            checkpoint_id=step,
            storage_writer=self.writer(root),
            planner=self._planner(),
            process_group=self._group,
        )
        self._publish(root, step)

    def async_save(
        self,
        sharded_state_dict: Any,
        checkpoint_dir: str | Path,
        async_strategy: Any = None,
        **_: Any,
    ) -> AsyncRequest:
        """Snapshots this rank's shards to host memory now and writes them in the background.

        The request has no ``async_fn`` (the write runs on the writer's threads, not in mcore's
        forked worker); its first finalize step waits for the write and publishes the step.
        ``async_strategy`` (passed by megatron-core >= 0.17) names mcore's own writers and
        is ignored. Staged on the save thread while the caller waits, as :meth:`save`.
        """
        return _SAVES.run(self._async_save, sharded_state_dict, checkpoint_dir)

    def _async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> AsyncRequest:
        root, step = split_dir(checkpoint_dir)
        self._require_restorable(sharded_state_dict, checkpoint_dir)
        claim_step_dir(root, step)
        for sh in nested_values(sharded_state_dict):
            written = is_main_replica(sh.replica_id) or not self.keep_only_main_replica
            if isinstance(sh, ShardedTensor) and sh.data is not None and written:
                sh.data = sh.data.detach().to("cpu", copy=True)  # replicas are dropped unsaved
        future = upload_future(
            dcp.async_save(
                self._pyt_state_dict(sharded_state_dict, checkpoint_dir),
                checkpoint_id=step,
                storage_writer=self.writer(root),
                planner=self._planner(),
                process_group=self._group,
                async_stager=_NoStaging(),
            )
        )
        self.in_flight = future

        def finalize() -> None:
            future.result()
            self.in_flight = None
            self._publish(root, step)

        return AsyncRequest(None, (), [finalize])

    def close(self) -> None:
        self.writers.close()

    def _require_restorable(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        """Collective: unless ``allow_pickle``, ConfigError on every rank when an object of
        any rank's save would not load back with ``weights_only``."""
        if self.allow_pickle:
            return
        objects = {
            sh.unique_key: sh.data
            for sh in nested_values(sharded_state_dict)
            if isinstance(sh, ShardedObject)
        }
        # mcore >= 0.19 saves its common state as one of them; older ones as common.pt.
        common_state = objects.pop(_mcore_compat.COMMON_STATE_KEY, None)
        why = unrestorable(objects)
        if why is None and common_state is not None:
            problem = unrestorable({"common": common_state})
            why = f"in mcore's common state, {problem}" if problem is not None else None
        common = os.path.join(checkpoint_dir, COMMON_NAME)
        if why is None and _rank() == 0 and os.path.isfile(common):  # mcore's, just written
            with open(common, "rb") as f:
                problem = unrestorable_file(f.read())
            if problem is not None:
                why = (
                    f"mcore's common state ({COMMON_NAME}) would not load back with "
                    f"weights_only ({problem})"
                )
        if self.agree is None:  # built here, collectively: every rank saves
            self.agree = Agreement()
        refuse_unrestorable(self.agree, f"Megatron checkpoint {os.fspath(checkpoint_dir)!r}", why)

    def _planner(self) -> MCoreSavePlanner:
        return MCoreSavePlanner(
            dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
        )

    def _pyt_state_dict(
        self, sharded_state_dict: Any, checkpoint_dir: str | Path
    ) -> dict[str, Any]:
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        pyt = mcore_to_pyt_state_dict(flat, False)
        common = os.path.join(checkpoint_dir, COMMON_NAME)
        if _rank() == 0 and os.path.isfile(common):  # mcore's rank 0 has just written it
            with open(common, "rb") as f:
                pyt[COMMON_KEY] = io.BytesIO(f.read())
        return pyt

    def _publish(self, root: str, step: str) -> None:
        if _rank() == 0:
            # common.pt is rebuilt from the step's own copy, read as a restore will read it.
            write_sidecars(
                root,
                step,
                backend=self.backend,
                version=self.version,
                allow_pickle=self.allow_pickle,
            )


class TieredLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """``torch_dist`` loading from the nearest tier holding a valid copy, every byte verified
    (mcore's stock loader reads the local directory only, unverified). ``allow_pickle``:
    objects load with full pickle (checkpoints you trust only; pass
    :func:`common_load_strategy`'s to ``dist_checkpointing.load`` too)."""

    def __init__(
        self,
        *,
        remote: Any = None,
        storage_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
    ) -> None:
        super().__init__()
        self.remote, self.storage_options = remote, storage_options
        self.allow_pickle = allow_pickle
        self._group = checkpoint_process_group()  # DCP's collectives: never the training group

    def load(
        self,
        sharded_state_dict: Any,
        checkpoint_dir: str | Path,
        async_strategy: Any = None,
        **_: Any,
    ) -> Any:
        """``async_strategy`` (passed by megatron-core >= 0.17) names mcore's own readers and
        is ignored."""
        root, step = split_dir(checkpoint_dir)
        strict_shape = [
            sh
            for sh in nested_values(sharded_state_dict)
            if isinstance(sh, ShardedTensor) and not sh.allow_shape_mismatch
        ]
        loose_shape = {
            sh.key: sh
            for sh in nested_values(sharded_state_dict)
            if isinstance(sh, ShardedTensor) and sh.allow_shape_mismatch
        }
        original = sharded_state_dict
        flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        pyt = mcore_to_pyt_state_dict(flat, True)
        dcp.load(
            pyt,
            checkpoint_id=step,
            storage_reader=self._reader(root),
            process_group=self._group,
            planner=MCoreLoadPlanner(
                shapes_validation_sharded_tensors=strict_shape,
                allow_shape_mismatch_sharded_tensors=loose_shape,
            ),
        )
        loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt.items()}
        loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(loaded, original)
        return loaded

    def load_tensors_metadata(self, checkpoint_dir: str | Path, metadata: Any = None) -> Any:
        if metadata is None:
            root, step = split_dir(checkpoint_dir)
            metadata = self._reader(root, step).read_metadata()
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def _reader(self, root: str, step: str | None = None) -> TieredStorageReader:
        reader = TieredStorageReader(
            root,
            remote=self.remote,
            storage_options=self.storage_options,
            allow_pickle=self.allow_pickle,
        )
        if step is not None:
            reader.reset(step)
        return reader


def common_load_strategy(allow_pickle: bool) -> Any:
    """The ``common_strategy`` for ``dist_checkpointing.load`` on megatron-core < 0.17: mcore's
    default (None) unless the checkpoint is trusted (``allow_pickle``). From 0.17 on mcore takes
    none (pass nothing): None, or ConfigError with ``allow_pickle``, naming what loads trusted
    checkpoints there (:func:`dcp_tiered.shims.megatron.load.load`)."""
    return _mcore_compat.common_load_strategy(allow_pickle)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


__all__ = [
    "TieredLoadShardedStrategy",
    "TieredSaveShardedStrategy",
    "common_load_strategy",
    "split_dir",
]
