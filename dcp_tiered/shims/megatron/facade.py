"""The Megatron facade's saves: :class:`EasyCkpt` (see :mod:`dcp_tiered.shims.megatron`).
Storage saves go through the lifecycle with :class:`TieredSaveShardedStrategy`; memory saves
to the lifecycle's :class:`~dcp_tiered.lifecycle.memory.MemorySnapshots`."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from torch.distributed.checkpoint.api import CheckpointException

from ... import Every, Replication, RetentionPolicy, SavePolicy
from ...errors import ConfigError
from ...lifecycle import Conventions, Lifecycle, attempt, failure, raise_failures, settled
from ...lifecycle.cadence import Cadence
from ...lifecycle.memory import MemorySnapshots
from ...lifecycle.roots import local_tier, write_file_atomically
from .._common import is_node_leader
from .restore import Restoring
from .sidecars import claim_step_dir, remove_sidecars
from .state import TRACKER, iteration_dir, local_parts, state_dict
from .strategy import TieredSaveShardedStrategy

logger = logging.getLogger(__package__)  # one logger per adapter, as before its split

CONVENTIONS = Conventions(
    "Megatron",
    overwrite_hint="save under another iteration or directory",
    kept=f"{TRACKER} still names the previous checkpoint, which is intact",
    local_tier="storage",
)


class EasyCkpt(Restoring):
    """What :func:`~dcp_tiered.shims.megatron.initialize` builds; the module functions call the
    one built last. The lifecycle around each save and restore is
    :class:`~dcp_tiered.lifecycle.Lifecycle`'s, the cadence the manager's rule, the memory tier
    and its replication :class:`~dcp_tiered.lifecycle.memory.MemorySnapshots`; this class
    translates Megatron's state and names."""

    def __init__(
        self,
        save_mem_interval: int | None,
        save_storage_interval: int | None,
        max_ckpt_num: int,
        log_file_path: str | os.PathLike[str] | None = None,
        *,
        save: str | os.PathLike[str],
        load: str | os.PathLike[str] | None = None,
        memory: str | os.PathLike[str] | None = None,
        remote: Any = None,
        storage_options: dict[str, Any] | None = None,
        async_save: bool = True,
        keep_every: int | None = None,
        remote_max_ckpt_num: int | None = None,
        allow_pickle: bool = False,
        replication: Replication | None = None,
        collective_timeout_secs: float = 1800.0,
        **writer_options: Any,
    ) -> None:
        for name, value in (
            ("save_mem_interval", save_mem_interval),
            ("save_storage_interval", save_storage_interval),
        ):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ConfigError(f"{name} must be a non-negative int or None, got {value!r}")
        self.mem_every, self.storage_every = save_mem_interval or 0, save_storage_interval or 0
        if replication is not None and not self.mem_every:
            raise ConfigError(
                "replication copies memory snapshots: it needs save_mem_interval >= 1"
            )
        self.save_dir = os.path.abspath(save)
        self.load_dir = os.path.abspath(load) if load is not None else self.save_dir
        self.remote, self.storage_options = remote, storage_options
        self.async_save = async_save
        # Objects (mcore's common state, ShardedObjects) load with full pickle: trusted
        # checkpoints only. Without it, a save that could not be restored is refused.
        self.allow_pickle = allow_pickle
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        os.makedirs(self.save_dir, exist_ok=True)
        self.log_handler = _log_to(log_file_path, self.rank) if log_file_path else None
        self.lifecycle = Lifecycle(
            CONVENTIONS,
            remote=remote,
            storage_options=storage_options,
            retention=RetentionPolicy(keep_latest=max_ckpt_num, keep_every=keep_every),
            # As everywhere: the remote keeps every checkpoint unless told otherwise.
            remote_retention=(
                None
                if remote_max_ckpt_num is None
                else RetentionPolicy(keep_latest=remote_max_ckpt_num, keep_every=keep_every)
            ),
            publish_early=False,
            writer_options={"overwrite": True, **writer_options},
            collective_timeout_secs=collective_timeout_secs,
            allow_pickle=allow_pickle,
        )
        # Recovery, explicitly: what a crash left in the save directory is finished or swept
        # (mcore's pending directories too), and uploads a previous job left are resumed.
        mem_root = None
        if self.mem_every:
            mem_root = os.path.abspath(memory) if memory else _default_memory_root(self.save_dir)
        self.lifecycle.start(self.save_dir, memory=mem_root)
        if is_node_leader():  # one process per node root
            local_tier(self.save_dir).sweep_pending()
        self._memory_checked = allow_pickle
        # Replication's events (replicated, restored_from_partner, lost) go to the
        # dcp_tiered.events logger, and so to log_file_path.
        self.memory = (
            MemorySnapshots(
                mem_root,
                self.rank,
                world_size=dist.get_world_size() if dist.is_initialized() else 1,
                run_id=self.lifecycle.run_id,
                allow_pickle=allow_pickle,
                replication=replication,
                timeout_secs=collective_timeout_secs,
            )
            if mem_root is not None
            else None
        )
        # The manager's cadence: a storage save replaces the memory save due at the same step.
        self.cadence = Cadence(
            SavePolicy(
                memory=Every(steps=self.mem_every) if self.mem_every else None,
                local=Every(steps=self.storage_every) if self.storage_every else None,
                remote=None,  # promotion follows every storage save
            ),
            has_memory=self.memory is not None,
            has_remote=False,
        )
        # Storage saves are checked for restorability by the strategy, memory saves by the
        # lifecycle (save_memory).
        self.strategy = TieredSaveShardedStrategy(
            remote=remote,
            storage_options=storage_options,
            writers=self.lifecycle.writers,
            agree=self.lifecycle.agree,
            allow_pickle=allow_pickle,
        )
        logger.info(
            "easyckpt: memory every %s (%s), storage every %s in %s (remote %s), keeping %d",
            self.mem_every or "never",
            self.memory.root if self.memory else "-",
            self.storage_every or "never",
            self.save_dir,
            remote,
            max_ckpt_num,
        )

    # ------------------------------------------------------------ saving

    def save_checkpoint_if_needed(
        self, iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any
    ) -> str | None:
        """Saves ``iteration`` to the tier due; returns ``"storage"``, ``"memory"`` or None.

        Returns once the state is copied (storage saves write in the background). A storage
        save still in flight is finished first; an earlier failure is raised here.
        """
        self.poll()
        due = self.cadence.due(iteration)
        if due.local:
            self.save_storage(iteration, model, optimizer, opt_param_scheduler)
            return "storage"
        if due.memory:
            self.save_memory(iteration, model, optimizer, opt_param_scheduler)
            return "memory"
        return None

    def save_storage(
        self, iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any
    ) -> None:
        self.lifecycle.finish()  # one storage save in flight
        step = iteration_dir(iteration)
        step_dir = os.path.join(self.save_dir, step)
        request, claimed = None, settled()
        if self.rank == 0:  # mcore writes common.pt there first; marked so a crash is swept
            try:
                claim_step_dir(self.save_dir, step)
            except Exception as e:  # noqa: BLE001 - e.g. a user's files there: every rank raises
                claimed = settled(error=e)
        if self.lifecycle.agree.any(claimed.exception() is not None):
            future = claimed  # nobody enters mcore's collectives; finish() raises everywhere
        else:
            state = state_dict(iteration, model, optimizer, opt_param_scheduler)
            try:
                request = dist_checkpointing.save(
                    state,
                    step_dir,
                    sharded_strategy=self.strategy,
                    async_sharded_save=self.async_save,
                )
                future = settled()
                if request is not None:  # async: the strategy's async_save set in_flight
                    assert self.strategy.in_flight is not None
                    future = self.strategy.in_flight
            except ConfigError:  # refused on every rank (a state that could not be restored)
                self._discard(step)
                raise
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - raised everywhere
                future = settled(error=e)
        self.lifecycle.track(
            self.save_dir,
            step,
            future,
            finalize=(lambda: [fn() for fn in request.finalize_fns]) if request else None,
            on_commit=lambda: self._committed(iteration),
            on_failure=lambda: self._discard(step),
        )
        logger.info(
            "easyckpt: saving iteration %d to %s%s",
            iteration,
            step_dir,
            " (in the background)" if request else "",
        )
        if request is None:
            self.lifecycle.finish()

    def _committed(self, iteration: int) -> None:
        write_file_atomically(os.path.join(self.save_dir, TRACKER), str(iteration).encode())
        logger.info(
            "easyckpt: iteration %d committed in %s; %s now names it",
            iteration,
            self.save_dir,
            TRACKER,
        )

    def _discard(self, step: str) -> None:
        """After a failed save: the directory made for mcore's common.pt goes."""
        if self.rank == 0 and not local_tier(self.save_dir).has_step(step):
            remove_sidecars(self.save_dir, step)

    def save_memory(
        self, iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any
    ) -> None:
        """Each rank's own snapshot; a failure on any rank raises SaveFailedError on every
        rank (the previous snapshot is intact, and the next save works)."""
        assert self.memory is not None
        sharded, common = save_preprocess(
            state_dict(iteration, model, optimizer, opt_param_scheduler),
            validate_access_integrity=False,
        )
        tensors, objects = local_parts(sharded)
        if not self._memory_checked:  # as the manager: at the first save (every iteration)
            self.lifecycle.require_restorable(
                iteration_dir(iteration), {"objects": objects, "common": common}
            )
            self._memory_checked = True
        memory = self.memory
        _, problem = attempt(
            lambda: memory.save(
                iteration_dir(iteration), {"tensors": tensors, "objects": objects, "common": common}
            ).result()
        )
        if self.lifecycle.agree.any(problem is not None):
            raise_failures(
                self.lifecycle.agree,
                [failure(self.rank, iteration_dir(iteration), "memory", self.memory.root, problem)]
                if problem
                else [],
                f"iteration {iteration} was not saved to memory",
                "the previous snapshot is intact; fix the cause (room in "
                f"{self.memory.root}?) and training can go on",
            )
        memory.replicate(iteration, iteration_dir(iteration))  # committed already
        logger.info("easyckpt: saved iteration %d to memory (%s)", iteration, self.memory.root)

    def poll(self) -> None:
        """Finishes the storage save in flight if every rank's write is done (collective)."""
        if self.lifecycle.in_flight is not None and self.lifecycle.written():
            self.lifecycle.finish()

    def wait(self) -> None:
        """Finishes the storage save in flight and, with replication, waits until the newest
        memory snapshot is on the partners (collective): call on every rank at the end."""
        self.lifecycle.finish()
        if self.memory is not None:
            self.memory.drain()

    def wait_durable(self, timeout_secs: float | None = None) -> None:
        """Finishes the storage save in flight, then blocks until the newest storage
        checkpoint is on the remote tier; raises on every rank if it cannot get there."""
        self.lifecycle.wait_durable(timeout_secs)

    def close(self, timeout_secs: float | None = None) -> None:
        """Call on every rank at the end: finishes the last storage save and, with a remote
        tier, waits until every checkpoint is durable there (uploads run in this process's
        threads); raises on every rank if one is not."""
        try:
            if self.memory is not None:  # every rank ends after the same rounds
                self.memory.drain(timeout_secs)
            self.lifecycle.close(timeout_secs)
        finally:
            if self.memory is not None:
                self.memory.close()
            if self.log_handler is not None:
                logging.getLogger("dcp_tiered").removeHandler(self.log_handler)
                self.log_handler.close()


def _default_memory_root(save_dir: str) -> str:
    return os.path.join(
        "/dev/shm", "dcp_tiered-megatron", hashlib.sha256(save_dir.encode()).hexdigest()[:16]
    )


def _log_to(path: str | os.PathLike[str], rank: int) -> logging.Handler:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(name)s %(message)s"))
    root = logging.getLogger("dcp_tiered")
    root.addHandler(handler)
    if root.getEffectiveLevel() > logging.INFO:
        root.setLevel(logging.INFO)
    return handler
