"""HF Trainer: checkpoints through DCP ``async_save`` into the tiers, in the spirit of EasyCkpt.

One line around an existing Trainer::

    from dcp_tiered.shims.hf import wrap
    trainer = wrap(Trainer(model, args, ...), remote="s3://bucket/run-1")
    trainer.train(resume_from_checkpoint=True)   # newest committed step, local or remote

or ``TieredTrainer(model, args, ..., tiers={"remote": ...})`` for subclass users.

Trainer decides when to save (``save_strategy``, ``save_steps``); the wrapper decides how. Each
save is one DCP step ``OUTPUT_DIR/checkpoint-N``, committed atomically by
:class:`TieredStorageWriter` (an interrupted save leaves no ``checkpoint-N`` behind), holding
the model, the optimizer (``torch.distributed.checkpoint.state_dict`` format, so FSDP2 DTensors
are sharded), the scheduler, every rank's RNG state and ``trainer_state.json``'s content, which
carries the data position (epoch, step). Once committed, ``trainer_state.json`` is also written
beside the data for tools that read it.

``save_total_limit`` goes through the tiers' retention: older steps are deleted only once they
are durable on the remote tier (when there is one); the best model's step is pinned.

With DeepSpeed enabled, Trainer saves through ``engine.save_checkpoint``; the wrapper installs
:mod:`dcp_tiered.shims.deepspeed` and keeps Trainer's own layout, with Trainer's files carried
inside the DeepSpeed step (:mod:`dcp_tiered.shims.hf.deepspeed`).
"""

from __future__ import annotations

from .trainer import (  # transformers' ImportError
    CONVENTIONS,
    MODES,
    TieredTrainer,
    TrainerTiers,
    wrap,
)

__all__ = ["CONVENTIONS", "MODES", "TieredTrainer", "TrainerTiers", "wrap"]
