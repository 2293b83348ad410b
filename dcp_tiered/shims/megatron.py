"""Megatron: PAI EasyCkpt's three calls, on the tiers. Every rank calls them::

    from dcp_tiered.shims import megatron as ckpt
    ckpt.initialize(save_mem_interval=1, save_storage_interval=50, max_ckpt_num=3,
                    log_file_path="ckpt.log", save="/nvme/run1", remote="s3://bucket/run1")
    iteration = ckpt.load_checkpoint(model, optimizer, opt_param_scheduler)
    while iteration < train_iters:
        train_step(...); iteration += 1
        ckpt.save_checkpoint_if_needed(iteration, model, optimizer, opt_param_scheduler)
    ckpt.wait()

- **Memory** every ``save_mem_interval`` iterations: each rank copies its shards into host
  shared memory (:class:`~dcp_tiered.tiers.memory.MemoryTier`), which outlives the processes.
- **Storage** every ``save_storage_interval``: a ``torch_dist`` checkpoint ``SAVE/iter_XXXXXXX``
  written by :class:`TieredSaveShardedStrategy` (atomic, checksummed, copied to ``remote`` in
  the background). ``latest_checkpointed_iteration.txt`` moves, atomically, once the iteration
  is committed, so stock Megatron-LM resumes from it too.
- ``max_ckpt_num`` storage checkpoints are kept; a step not yet durable on the remote tier is
  never deleted. Every save, restore and delete is logged (to ``log_file_path`` as well), and
  nothing is written outside ``save``, the memory directory and that log.
- :func:`load_checkpoint` restores the newest iteration that verifies, from memory, local
  disk or the remote tier, falling back to older ones. An iteration found in memory only is
  written to storage straight away.
- ``replication=Replication(...)`` copies each memory snapshot to partner nodes' host memory
  (the :class:`~dcp_tiered.CheckpointManager`'s peer replication), so a node lost before its
  storage save loses nothing: a replacement node's ranks load their shards from a partner's
  copy, verified, and every rank restores the newest iteration every rank can get whole.

The state saved is Megatron-LM's (``generate_state_dict``): ``model`` (``model0``.. for virtual
pipeline chunks), ``optimizer`` (``optimizer.sharded_state_dict``), ``opt_param_scheduler``,
``iteration`` and ``checkpoint_version``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..backends.local import LocalBackend
from ..backends.remote import remote_backend
from ..distributed import is_node_leader
from ..errors import ConfigError
from ..events import EventLog
from ..lifecycle import Conventions, Lifecycle, attempt, failure, raise_failures, settled
from ..policy.replication import Replication
from ..policy.retention import RetentionPolicy
from ..policy.step_names import MEGATRON, order_number
from ..tiers import snapshots
from ..tiers.catalog import numbered_steps
from ..tiers.local import LocalTier
from ..tiers.memory import MemoryTier
from ..tiers.replica import Replicator
from .megatron_strategy import (  # raises a clear ImportError without megatron-core
    TieredSaveShardedStrategy,
    claim_step_dir,
    remove_sidecars,
    replace_file,
    write_sidecars,
)

# isort: split
from . import megatron_load

# isort: split
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import (
    dict_list_map_inplace,
    merge,
    nested_values,
)
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    apply_factory_merges,
)
from megatron.core.dist_checkpointing.state_dict_utils import (
    load_preprocess,
    save_preprocess,
)
from megatron.core.dist_checkpointing.utils import extract_sharded_base

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
CONVENTIONS = Conventions(
    "Megatron",
    overwrite_hint="save under another iteration or directory",
    kept=f"{TRACKER} still names the previous checkpoint, which is intact",
    local_tier="storage",
)


def iteration_dir(iteration: int) -> str:
    """Megatron-LM's directory name for an iteration."""
    return MEGATRON.build(iteration)


class EasyCkpt:
    """What :func:`initialize` builds; the module functions call the one built last. The
    lifecycle around each save and restore is :class:`~dcp_tiered.lifecycle.Lifecycle`'s;
    this class translates Megatron's state and names."""

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
            LocalTier(LocalBackend(self.save_dir)).sweep_pending()
        self.memory = None
        self._memory_checked = allow_pickle
        if mem_root is not None:
            self.memory = MemoryTier(
                mem_root,
                self.rank,
                allow_pickle=allow_pickle,
                run_id=self.lifecycle.run_id,
                world_size=dist.get_world_size() if dist.is_initialized() else 1,
            )
        # Replication's events (replicated, restored_from_partner, lost) go to the
        # dcp_tiered.events logger, and so to log_file_path.
        self.events = EventLog(None)
        self.replica = (
            Replicator(
                self.memory,
                replication,
                timeout_secs=collective_timeout_secs,
                emit=self.events.emit,
            )
            if replication is not None and self.memory is not None
            else None
        )
        # Storage saves are checked for restorability by the strategy, memory saves by the
        # lifecycle (save_memory).
        self.strategy = TieredSaveShardedStrategy(
            remote=remote,
            storage_options=storage_options,
            writers=self.lifecycle.writers,
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
        if self.storage_every and iteration % self.storage_every == 0:
            self.save_storage(iteration, model, optimizer, opt_param_scheduler)
            return "storage"
        if self.memory is not None and iteration % self.mem_every == 0:
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
        replace_file(os.path.join(self.save_dir, TRACKER), str(iteration).encode())
        logger.info(
            "easyckpt: iteration %d committed in %s; %s now names it",
            iteration,
            self.save_dir,
            TRACKER,
        )

    def _discard(self, step: str) -> None:
        """After a failed save: the directory made for mcore's common.pt goes."""
        tier = self.lifecycle.writers.get(self.save_dir).local_tier
        if self.rank == 0 and not tier.has_step(step):
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
        tensors, objects = _local_parts(sharded)
        if not self._memory_checked:  # as the manager: at the first save (every iteration)
            self.lifecycle.require_restorable(
                iteration_dir(iteration), {"objects": objects, "common": common}
            )
            self._memory_checked = True
        _, problem = attempt(
            lambda: self.memory.save(  # type: ignore[union-attr]
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
        if self.replica is not None:  # to the partners in the background; committed already
            self.replica.offer(iteration, iteration_dir(iteration), settled())
        logger.info("easyckpt: saved iteration %d to memory (%s)", iteration, self.memory.root)

    def poll(self) -> None:
        """Finishes the storage save in flight if every rank's write is done (collective)."""
        if self.lifecycle.in_flight is not None and self.lifecycle.written():
            self.lifecycle.finish()

    def wait(self) -> None:
        """Finishes the storage save in flight and, with replication, waits until the newest
        memory snapshot is on the partners (collective): call on every rank at the end."""
        self.lifecycle.finish()
        if self.replica is not None:
            self.replica.drain()

    # ------------------------------------------------------------ loading

    def load_checkpoint(
        self,
        model: Any,
        optimizer: Any,
        opt_param_scheduler: Any,
        load_arg: str = "load",
        strict: bool = True,
        concat: bool = False,
        on_unreadable_tier: str = "raise",
    ) -> int:
        """Restores the newest iteration that verifies; returns it (0: every tier was read and
        holds none). A remote tier that cannot be read raises TierUnavailableError on every rank
        (``on_unreadable_tier="skip"``: restore from the other tiers, with an ERROR log)."""
        if concat:
            raise ConfigError("concat=True is not supported: checkpoints reshard on load")
        root = {"load": self.load_dir, "save": self.save_dir}.get(load_arg)
        if root is None:
            raise ConfigError(f"load_arg must be 'load' or 'save', got {load_arg!r}")
        loaded: dict[tuple[int, str], Any] = {}
        if self.replica is not None:  # what every rank holds, for _candidates and the loads
            self.replica.survey()

        def load(candidate: tuple[int, str]) -> str | None:
            iteration, tier = candidate
            if tier == "memory":
                state, problem = self._load_memory(iteration, model, optimizer, opt_param_scheduler)
            else:
                state, problem = self._load_storage(
                    root, iteration, model, optimizer, opt_param_scheduler
                )
            loaded[candidate] = state
            return problem

        chosen = self.lifecycle.restore(
            lambda with_remote: self._candidates(root, with_remote),
            load,
            on_unreadable_tier=on_unreadable_tier,
            retry="load_checkpoint",
            name=lambda c: f"{iteration_dir(c[0])} from {c[1]}",
            abandon=lambda proven, chosen: self.lifecycle.quarantine(
                root,
                sorted(
                    {
                        iteration_dir(i)
                        for i, t in proven
                        if t == "storage" and i > chosen[0] and root == self.save_dir
                    }
                ),
                reason=f"a restore fell back past it to {iteration_dir(chosen[0])}",
            ),
        )
        if chosen is None:
            self._report_lost(-1, None)
            logger.info("easyckpt: nothing to restore in %s", root)
            return 0
        iteration, tier = chosen
        self._report_lost(iteration, f"{iteration_dir(iteration)} from {tier}")
        apply_state(loaded[chosen], model, optimizer, opt_param_scheduler, strict=strict)
        logger.info("easyckpt: restored iteration %d from %s", iteration, tier)
        if tier == "memory" and self.storage_every:
            self.save_storage(iteration, model, optimizer, opt_param_scheduler)
        return iteration

    def _candidates(self, root: str, with_remote: bool) -> list[tuple[int, str]]:
        """(iteration, tier): newest first, memory before storage for the same iteration."""
        found = {
            (n, "memory")
            for n in map(order_number, snapshots.candidates(self.memory, self.replica))
            if n is not None
        }
        # Listing only: a writer on the load directory would sweep it and resume its uploads.
        remote = remote_backend(self.remote, self.storage_options) if with_remote else None
        for n, _ in numbered_steps(LocalTier(LocalBackend(root)), remote, MEGATRON, strict=True):
            found.add((n, "storage"))
        return sorted(found, key=lambda c: (-c[0], c[1] != "memory"))

    def _load_memory(
        self, iteration: int, model: Any, optimizer: Any, scheduler: Any
    ) -> tuple[Any, str | None]:
        """This rank's snapshot of ``iteration`` as Megatron's state, or (None, why not). With
        replication it is collective, and a rank without a valid copy of its own loads a
        partner's."""
        assert self.memory is not None

        def prepare() -> tuple[Any, Any, Any, dict[str, Any]]:
            sharded, nonpersistent, factories = load_preprocess(
                state_dict(iteration, model, optimizer, scheduler, is_loading=True)
            )
            sharded, common = extract_sharded_base(sharded)
            tensors, objects = _local_parts(sharded)
            template = {
                "tensors": {k: t.clone() for k, t in tensors.items()},
                "objects": dict(objects),
                "common": common,
            }
            return sharded, nonpersistent, factories, template

        prepared, problem = attempt(prepare)
        if self.replica is not None and self.lifecycle.agree.any(problem is not None):
            return None, problem or "failed on another rank"  # before the collective load
        if problem is not None:
            return None, problem
        sharded, nonpersistent, factories, template = prepared
        # Anything else raised here is a failure like the tier's own: ranks agree and move on.
        why, problem = attempt(
            snapshots.load, self.memory, self.replica, iteration_dir(iteration), template
        )
        if (problem or why) is not None:
            return None, problem or why

        def value(sh: Any) -> Any:
            if isinstance(sh, ShardedTensor):
                return template["tensors"][_uid(sh)]
            if isinstance(sh, ShardedObject):
                return template["objects"][sh.unique_key]
            return sh

        def assemble() -> Any:
            dict_list_map_inplace(value, sharded)
            merge(template["common"], nonpersistent)  # what the save left out (param ids)
            merge(template["common"], sharded)
            return apply_factory_merges(template["common"], factories)

        return attempt(assemble)

    def _load_storage(
        self, root: str, iteration: int, model: Any, optimizer: Any, scheduler: Any
    ) -> tuple[Any, str | None]:
        """Collective. The state is read through the tiers (:func:`megatron_load.load`, common
        state included); ``metadata.json`` and ``common.pt`` are written into the directory
        from the step's verified data first, one writer a node, so that stock mcore and
        Megatron-LM can load a committed step too."""
        step = iteration_dir(iteration)
        agree = self.lifecycle.agree
        leader = is_node_leader()
        _, problem = (
            attempt(
                write_sidecars,
                root,
                step,
                remote=self.remote,
                storage_options=self.storage_options,
                allow_pickle=self.allow_pickle,
            )
            if leader
            else (None, None)
        )
        if not agree.all(problem is None):
            return None, problem or "failed on another rank"
        loaded, problem = attempt(
            megatron_load.load,
            state_dict(iteration, model, optimizer, scheduler, is_loading=True),
            os.path.join(root, step),
            remote=self.remote,
            storage_options=self.storage_options,
            allow_pickle=self.allow_pickle,
        )
        agree.barrier()
        if leader and not LocalTier(LocalBackend(root)).has_step(step):
            remove_sidecars(root, step)
        return loaded, problem

    def _report_lost(self, restored: int, what: str | None) -> None:
        snapshots.report_lost(self.replica, restored, what, rank=self.rank, emit=self.events.emit)

    def wait_durable(self, timeout_secs: float | None = None) -> None:
        """Finishes the storage save in flight, then blocks until the newest storage
        checkpoint is on the remote tier; raises on every rank if it cannot get there."""
        self.lifecycle.wait_durable(timeout_secs)

    def close(self, timeout_secs: float | None = None) -> None:
        """Call on every rank at the end: finishes the last storage save and, with a remote
        tier, waits until every checkpoint is durable there (uploads run in this process's
        threads); raises on every rank if one is not."""
        try:
            if self.replica is not None:  # every rank ends after the same rounds
                self.replica.drain(timeout_secs)
            self.lifecycle.close(timeout_secs)
        finally:
            if self.replica is not None:
                self.replica.close(0)
            if self.memory is not None:
                self.memory.close()
            if self.log_handler is not None:
                logging.getLogger("dcp_tiered").removeHandler(self.log_handler)
                self.log_handler.close()


# ------------------------------------------------------------------ the state Megatron-LM saves


def state_dict(
    iteration: int,
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    *,
    is_loading: bool = False,
) -> dict[str, Any]:
    """Megatron-LM's ``generate_state_dict`` layout, as a sharded state dict."""
    chunks = list(model) if isinstance(model, Sequence) else [model]
    state: dict[str, Any] = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    if len(chunks) == 1:
        state["model"] = chunks[0].sharded_state_dict()
    else:
        for i, chunk in enumerate(chunks):
            state[f"model{i}"] = chunk.sharded_state_dict()
    if optimizer is not None:
        model_state = {k: v for k, v in state.items() if k.startswith("model")}
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading)
    if opt_param_scheduler is not None:
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    return state


def apply_state(
    loaded: dict[str, Any],
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    *,
    strict: bool = True,
) -> None:
    chunks = list(model) if isinstance(model, Sequence) else [model]
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"], strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if opt_param_scheduler is not None and "opt_param_scheduler" in loaded:
        opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])


def _uid(sh: ShardedTensor) -> str:
    return f"{sh.key}/{sh.global_offset}/{sh.flattened_range}"


def _local_parts(sharded: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors and objects, by a key naming the shard (same on save and load)."""
    tensors, objects = {}, {}
    for sh in nested_values(sharded):
        if isinstance(sh, ShardedTensor):
            tensors[_uid(sh)] = sh.data
        elif isinstance(sh, ShardedObject):
            objects[sh.unique_key] = sh.data
    return tensors, objects


# ------------------------------------------------------------------ helpers


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


# ------------------------------------------------------------------ EasyCkpt's module API

_current: EasyCkpt | None = None


def initialize(
    save_mem_interval: int | None,
    save_storage_interval: int | None,
    max_ckpt_num: int,
    log_file_path: str | os.PathLike[str] | None = None,
    **options: Any,
) -> EasyCkpt:
    """EasyCkpt's ``initialize_easyckpt``; ``options`` go to :class:`EasyCkpt` (``save=`` is
    required unless Megatron-LM's ``get_args()`` provides it). ``allow_pickle=True`` loads
    objects (mcore's common state, ShardedObjects) with full pickle, for checkpoints you trust;
    without it a save holding an object ``weights_only`` loading refuses raises ConfigError on
    every rank before anything is written."""
    global _current
    if _current is not None:
        _current.close()
    if "save" not in options:
        options["save"] = _megatron_arg("save")
        options.setdefault("load", _megatron_arg("load", required=False))
    _current = EasyCkpt(
        save_mem_interval, save_storage_interval, max_ckpt_num, log_file_path, **options
    )
    return _current


initialize_easyckpt = initialize


def save_checkpoint_if_needed(
    iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any
) -> str | None:
    return _instance().save_checkpoint_if_needed(iteration, model, optimizer, opt_param_scheduler)


def load_checkpoint(
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    load_arg: str = "load",
    strict: bool = True,
    concat: bool = False,
) -> int:
    return _instance().load_checkpoint(
        model, optimizer, opt_param_scheduler, load_arg=load_arg, strict=strict, concat=concat
    )


def wait() -> None:
    _instance().wait()


def wait_durable(timeout_secs: float | None = None) -> None:
    _instance().wait_durable(timeout_secs)


def close(timeout_secs: float | None = None) -> None:
    global _current
    if _current is not None:
        current, _current = _current, None
        current.close(timeout_secs)


def _instance() -> EasyCkpt:
    if _current is None:
        raise ConfigError("call dcp_tiered.shims.megatron.initialize(...) first")
    return _current


def _megatron_arg(name: str, required: bool = True) -> Any:
    try:
        from megatron.training import get_args  # Megatron-LM, not megatron-core

        value = getattr(get_args(), name, None)
    except (ImportError, AssertionError):
        value = None
    if value is None and required:
        raise ConfigError(f"pass {name}=DIR to initialize() (no Megatron-LM args to take it from)")
    return value
