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

from .strategy import (  # first: the clear ImportError without megatron-core
    TieredLoadShardedStrategy,
    TieredSaveShardedStrategy,
)

# isort: split
from .easyckpt import (
    close,
    initialize,
    initialize_easyckpt,
    load_checkpoint,
    save_checkpoint_if_needed,
    wait,
    wait_durable,
)
from .facade import CONVENTIONS, EasyCkpt
from .state import CHECKPOINT_VERSION, TRACKER, apply_state, iteration_dir, state_dict

__all__ = [
    "CHECKPOINT_VERSION",
    "CONVENTIONS",
    "TRACKER",
    "EasyCkpt",
    "TieredLoadShardedStrategy",
    "TieredSaveShardedStrategy",
    "apply_state",
    "close",
    "initialize",
    "initialize_easyckpt",
    "iteration_dir",
    "load_checkpoint",
    "save_checkpoint_if_needed",
    "state_dict",
    "wait",
    "wait_durable",
]
