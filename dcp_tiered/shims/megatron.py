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
  shared memory (:class:`~dcp_tiered.memory_tier.MemoryTier`), which outlives the processes.
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

from .. import layout
from ..agreement import Agreement
from ..backends.local import LocalBackend
from ..backends.remote import remote_backend
from ..catalog import list_steps
from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    DcpTieredError,
    SaveFailedError,
    TierUnavailableError,
    describe,
)
from ..housekeeping import prune_local, prune_remote
from ..local_tier import LocalTier
from ..memory_tier import MemoryTier
from ..retention import RetentionPolicy
from .megatron_strategy import (  # raises a clear ImportError without megatron-core
    TieredLoadShardedStrategy,
    TieredSaveShardedStrategy,
    claim_step_dir,
    remove_sidecars,
    replace_file,
    write_sidecars,
)

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


def iteration_dir(iteration: int) -> str:
    """Megatron-LM's directory name for an iteration."""
    return f"iter_{iteration:07d}"


class EasyCkpt:
    """What :func:`initialize` builds; the module functions call the one built last."""

    def __init__(self, save_mem_interval: int | None, save_storage_interval: int | None,
                 max_ckpt_num: int, log_file_path: str | os.PathLike[str] | None = None, *,
                 save: str | os.PathLike[str], load: str | os.PathLike[str] | None = None,
                 memory: str | os.PathLike[str] | None = None, remote: Any = None,
                 storage_options: dict[str, Any] | None = None, async_save: bool = True,
                 keep_every: int | None = None, remote_max_ckpt_num: int | None = None,
                 **writer_options: Any) -> None:
        for name, value in (("save_mem_interval", save_mem_interval),
                            ("save_storage_interval", save_storage_interval)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ConfigError(f"{name} must be a non-negative int or None, got {value!r}")
        self.mem_every, self.storage_every = save_mem_interval or 0, save_storage_interval or 0
        self.retention = RetentionPolicy(keep_latest=max_ckpt_num, keep_every=keep_every)
        # As everywhere: the remote keeps every checkpoint unless told otherwise.
        self.remote_retention = (None if remote_max_ckpt_num is None else
                                 RetentionPolicy(keep_latest=remote_max_ckpt_num,
                                                 keep_every=keep_every))
        self.save_dir = os.path.abspath(save)
        self.load_dir = os.path.abspath(load) if load is not None else self.save_dir
        self.remote, self.storage_options = remote, storage_options
        self.async_save = async_save
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._agree = Agreement()  # every vote: on a gloo group of ours, never the training one
        os.makedirs(self.save_dir, exist_ok=True)
        self.log_handler = _log_to(log_file_path, self.rank) if log_file_path else None
        if int(os.environ.get("LOCAL_RANK", self.rank)) == 0:  # one process per node root
            LocalTier(LocalBackend(self.save_dir)).sweep_pending()  # a crashed save's leftovers
        self.memory = None
        if self.mem_every:
            root = os.path.abspath(memory) if memory else _default_memory_root(self.save_dir)
            self.memory = MemoryTier(root, self.rank)
        self.strategy = TieredSaveShardedStrategy(remote=remote, storage_options=storage_options,
                                                  **writer_options)
        self._pending: tuple[int, Any] | None = None  # (iteration, mcore AsyncRequest)
        logger.info("easyckpt: memory every %s (%s), storage every %s in %s (remote %s), "
                    "keeping %d", self.mem_every or "never",
                    self.memory.root if self.memory else "-", self.storage_every or "never",
                    self.save_dir, remote, max_ckpt_num)

    # ------------------------------------------------------------ saving

    def save_checkpoint_if_needed(self, iteration: int, model: Any, optimizer: Any,
                                  opt_param_scheduler: Any) -> str | None:
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

    def save_storage(self, iteration: int, model: Any, optimizer: Any,
                     opt_param_scheduler: Any) -> None:
        self.wait()  # one storage save in flight
        step_dir = os.path.join(self.save_dir, iteration_dir(iteration))
        if self.rank == 0:  # mcore writes common.pt there first; marked so a crash is swept
            claim_step_dir(self.save_dir, iteration_dir(iteration))
        state = state_dict(iteration, model, optimizer, opt_param_scheduler)
        request, problem = _attempt(dist_checkpointing.save, state, step_dir,
                                    sharded_strategy=self.strategy,
                                    async_sharded_save=self.async_save)
        self._check_saved(iteration, problem)
        logger.info("easyckpt: saving iteration %d to %s%s", iteration, step_dir,
                    " (in the background)" if self.async_save else "")
        self._pending = (iteration, request)
        if not self.async_save:
            self._finish()

    def save_memory(self, iteration: int, model: Any, optimizer: Any,
                    opt_param_scheduler: Any) -> None:
        assert self.memory is not None
        sharded, common = save_preprocess(
            state_dict(iteration, model, optimizer, opt_param_scheduler),
            validate_access_integrity=False)
        tensors, objects = _local_parts(sharded)
        try:  # this rank's own snapshot: a failure here must not stop training or the others
            self.memory.save(iteration_dir(iteration),
                             {"tensors": tensors, "objects": objects, "common": common}).result()
        except (DcpTieredError, OSError) as e:
            logger.warning("easyckpt: iteration %d was not saved to memory (%s): %s; the "
                           "previous snapshot is intact", iteration, self.memory.root, e)
            return
        logger.info("easyckpt: saved iteration %d to memory (%s)", iteration, self.memory.root)

    def poll(self) -> None:
        """Finishes the storage save in flight if every rank's write is done (collective)."""
        if self._pending is None:
            return
        future = self.strategy.in_flight
        if self._agree.all(future is None or future.done()):
            self._finish()

    def wait(self) -> None:
        """Finishes the storage save in flight (collective): call on every rank at the end."""
        if self._pending is not None:
            self._finish()

    def _finish(self) -> None:
        assert self._pending is not None
        (iteration, request), self._pending = self._pending, None
        if request is not None:  # async: the strategy's publish, then mcore's metadata.json
            _, problem = _attempt(lambda: [fn() for fn in request.finalize_fns])
            self._check_saved(iteration, problem)
        if self.rank == 0:
            replace_file(os.path.join(self.save_dir, TRACKER), str(iteration).encode())
            logger.info("easyckpt: iteration %d committed in %s; %s now names it", iteration,
                        self.save_dir, TRACKER)
        if int(os.environ.get("LOCAL_RANK", self.rank)) == 0:  # every node prunes its own root
            self._prune()

    def _check_saved(self, iteration: int, problem: str | None) -> None:
        """Raises SaveFailedError for a failed storage save (DCP fails every rank alike)."""
        if problem is not None:
            step = iteration_dir(iteration)
            if self.rank == 0 and not self.strategy.writer(self.save_dir).local_tier.has_step(step):
                remove_sidecars(self.save_dir, step)  # the directory made for mcore's common.pt
            raise SaveFailedError(
                f"iteration {iteration} was not saved to {self.save_dir}: {problem.rstrip('.')}. "
                f"{TRACKER} still names the previous checkpoint, which is intact.",
                [{"rank": self.rank, "step": step, "tier": "local",
                  "where": self.save_dir, "error": problem}])

    def _prune(self) -> None:
        writer = self.strategy.writer(self.save_dir)
        remote = writer.remote_backend
        try:
            prune_local(writer.local_tier, self.retention, remote, label="storage")
            if remote is not None and self.remote_retention is not None and self.rank == 0:
                prune_remote(remote, self.remote_retention)
        except (DcpTieredError, OSError) as e:
            logger.warning("easyckpt: retention pass failed (retried after the next save): %s", e)

    # ------------------------------------------------------------ loading

    def load_checkpoint(self, model: Any, optimizer: Any, opt_param_scheduler: Any,
                        load_arg: str = "load", strict: bool = True, concat: bool = False,
                        on_unreadable_tier: str = "raise") -> int:
        """Restores the newest iteration that verifies; returns it (0: every tier was read and
        holds none). A remote tier that cannot be read raises TierUnavailableError on every rank
        (``on_unreadable_tier="skip"``: restore from the other tiers, with an ERROR log)."""
        if concat:
            raise ConfigError("concat=True is not supported: checkpoints reshard on load")
        root = {"load": self.load_dir, "save": self.save_dir}.get(load_arg)
        if root is None:
            raise ConfigError(f"load_arg must be 'load' or 'save', got {load_arg!r}")
        if on_unreadable_tier not in ("raise", "skip"):
            raise ConfigError(f"on_unreadable_tier must be 'raise' or 'skip', "
                              f"not {on_unreadable_tier!r}")
        reasons = []
        for iteration, tier in self._agree.from_rank0(
                lambda: self._candidates(root, skip_unreadable=on_unreadable_tier == "skip")):
            if tier == "memory":
                loaded, problem = _attempt(self._load_memory, iteration, model, optimizer,
                                           opt_param_scheduler)
                if not self._agree.all(problem is None):  # each rank has its own snapshot
                    problem = problem or "failed on another rank"
            else:
                loaded, problem = self._load_storage(root, iteration, model, optimizer,
                                                     opt_param_scheduler)
            if problem is not None:
                reasons.append(f"{iteration_dir(iteration)} ({tier}): {problem}")
                logger.warning("easyckpt: cannot restore %s from %s, trying an older one: %s",
                               iteration_dir(iteration), tier, problem)
                continue
            apply_state(loaded, model, optimizer, opt_param_scheduler, strict=strict)
            logger.info("easyckpt: restored iteration %d from %s", iteration, tier)
            if tier == "memory" and self.storage_every:
                self.save_storage(iteration, model, optimizer, opt_param_scheduler)
            return iteration
        if reasons:
            raise CheckpointNotFoundError(
                "no iteration could be restored; every candidate failed:\n  "
                + "\n  ".join(reasons))
        logger.info("easyckpt: nothing to restore in %s", root)
        return 0

    def _candidates(self, root: str, *, skip_unreadable: bool) -> list[tuple[int, str]]:
        """(iteration, tier): newest first, memory before storage for the same iteration."""
        found = set()
        if self.memory is not None:
            found |= {(n, "memory") for n in map(layout.step_number, self.memory.steps())
                      if n is not None}
        # Listing only: a writer on the load directory would sweep it and resume its uploads.
        tier, remote = LocalTier(LocalBackend(root)), remote_backend(self.remote,
                                                                     self.storage_options)
        try:
            steps = list_steps(tier, remote, strict=True)
        except TierUnavailableError as e:
            if not skip_unreadable:
                raise TierUnavailableError(
                    f"{e}. To restore from the other tiers instead, call "
                    "load_checkpoint(..., on_unreadable_tier='skip').") from e
            logger.error("easyckpt: %s; restoring from the other tiers", e)
            steps = list_steps(tier, None)
        for s in steps:
            if s.name.startswith("iter_") and (n := layout.step_number(s.name)) is not None:
                found.add((n, "storage"))
        return sorted(found, key=lambda c: (-c[0], c[1] != "memory"))

    def _load_memory(self, iteration: int, model: Any, optimizer: Any,
                     scheduler: Any) -> dict[str, Any]:
        assert self.memory is not None
        sharded, nonpersistent, factories = load_preprocess(
            state_dict(iteration, model, optimizer, scheduler, is_loading=True))
        sharded, common = extract_sharded_base(sharded)
        tensors, objects = _local_parts(sharded)
        template = {"tensors": {k: t.clone() for k, t in tensors.items()},
                    "objects": dict(objects), "common": common}
        self.memory.load(iteration_dir(iteration), template)

        def value(sh: Any) -> Any:
            if isinstance(sh, ShardedTensor):
                return template["tensors"][_uid(sh)]
            if isinstance(sh, ShardedObject):
                return template["objects"][sh.unique_key]
            return sh

        dict_list_map_inplace(value, sharded)
        merge(template["common"], nonpersistent)  # what the save left out (param ids)
        merge(template["common"], sharded)
        return apply_factory_merges(template["common"], factories)

    def _load_storage(self, root: str, iteration: int, model: Any, optimizer: Any,
                      scheduler: Any) -> tuple[Any, str | None]:
        """Collective. mcore's loader reads ``metadata.json`` and ``common.pt`` from the
        directory: they are written from the step's verified data first, one writer a node."""
        step = iteration_dir(iteration)
        leader = int(os.environ.get("LOCAL_RANK", self.rank)) == 0
        _, problem = (_attempt(write_sidecars, root, step, remote=self.remote,
                               storage_options=self.storage_options)
                      if leader else (None, None))
        if not self._agree.all(problem is None):
            return None, problem or "failed on another rank"
        strategy = TieredLoadShardedStrategy(remote=self.remote,
                                             storage_options=self.storage_options)
        loaded, problem = _attempt(
            dist_checkpointing.load,
            state_dict(iteration, model, optimizer, scheduler, is_loading=True),
            os.path.join(root, step), sharded_strategy=strategy)
        self._agree.barrier()
        if leader and not LocalTier(LocalBackend(root)).has_step(step):
            remove_sidecars(root, step)
        if not self._agree.all(problem is None):
            return None, problem or "failed on another rank"
        return loaded, None

    def wait_durable(self, timeout_secs: float | None = None) -> None:
        """Finishes the storage save in flight, then blocks until the newest storage
        checkpoint is on the remote tier; raises UploadFailedError if it cannot get there."""
        self.wait()
        self.strategy.writer(self.save_dir).wait_durable(timeout_secs=timeout_secs)

    def close(self) -> None:
        """Call on every rank at the end: finishes the last storage save and, with a remote
        tier, waits until it is durable there (uploads run in this process's threads)."""
        try:
            if self.remote is not None and self.strategy.writer(self.save_dir).local_tier.steps():
                self.wait_durable()
            else:
                self.wait()
        finally:
            self._release()

    def _release(self) -> None:
        self.strategy.close()
        if self.memory is not None:
            self.memory.close()
        if self.log_handler is not None:
            logging.getLogger("dcp_tiered").removeHandler(self.log_handler)
            self.log_handler.close()


# ------------------------------------------------------------------ the state Megatron-LM saves


def state_dict(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any, *,
               is_loading: bool = False) -> dict[str, Any]:
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


def apply_state(loaded: dict[str, Any], model: Any, optimizer: Any, opt_param_scheduler: Any,
                *, strict: bool = True) -> None:
    chunks = list(model) if isinstance(model, Sequence) else [model]
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"],
                              strict=strict)
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


def _attempt(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
    """``(fn(...), None)``, or ``(None, why)`` if it raised: ranks then agree on moving on."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        return fn(*args, **kwargs), None
    # Reported, then every rank tries an older step. DCP's exception is a BaseException.
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        return None, describe(e) if isinstance(e, CheckpointException) else \
            f"rank {rank}: {describe(e)}"




def _default_memory_root(save_dir: str) -> str:
    return os.path.join("/dev/shm", "dcp_tiered-megatron",
                        hashlib.sha256(save_dir.encode()).hexdigest()[:16])


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


def initialize(save_mem_interval: int | None, save_storage_interval: int | None,
               max_ckpt_num: int, log_file_path: str | os.PathLike[str] | None = None,
               **options: Any) -> EasyCkpt:
    """EasyCkpt's ``initialize_easyckpt``; ``options`` go to :class:`EasyCkpt` (``save=`` is
    required unless Megatron-LM's ``get_args()`` provides it)."""
    global _current
    if _current is not None:
        _current.close()
    if "save" not in options:
        options["save"] = _megatron_arg("save")
        options.setdefault("load", _megatron_arg("load", required=False))
    _current = EasyCkpt(save_mem_interval, save_storage_interval, max_ckpt_num, log_file_path,
                        **options)
    return _current


initialize_easyckpt = initialize


def save_checkpoint_if_needed(iteration: int, model: Any, optimizer: Any,
                              opt_param_scheduler: Any) -> str | None:
    return _instance().save_checkpoint_if_needed(iteration, model, optimizer,
                                                 opt_param_scheduler)


def load_checkpoint(model: Any, optimizer: Any, opt_param_scheduler: Any,
                    load_arg: str = "load", strict: bool = True, concat: bool = False) -> int:
    return _instance().load_checkpoint(model, optimizer, opt_param_scheduler,
                                       load_arg=load_arg, strict=strict, concat=concat)


def wait() -> None:
    _instance().wait()


def wait_durable(timeout_secs: float | None = None) -> None:
    _instance().wait_durable(timeout_secs)


def close() -> None:
    global _current
    if _current is not None:
        current, _current = _current, None
        current.close()


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
