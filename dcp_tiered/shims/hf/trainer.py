"""HF Trainer without DeepSpeed: each save one DCP step ``checkpoint-N`` through the
lifecycle (see :mod:`dcp_tiered.shims.hf`), and Trainer's resume from any tier."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ... import RetentionPolicy
from ...config import RemoteConfig
from ...errors import CheckpointNotFoundError, ConfigError
from ...lifecycle import Conventions, Lifecycle, quiet_single_process
from ...lifecycle.roots import HF, local_tier, numbered_steps, remote_backend
from ...reader import TieredStorageReader
from .._common import capture_rng, restore_rng

try:
    from transformers import Trainer
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_callback import ExportableState
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("dcp_tiered.shims.hf needs transformers: pip install 'dcp-tiered[hf]'") from e

logger = logging.getLogger(__package__)  # one logger per adapter, as before its split

MODES = ("sync", "async")


def wrap(
    trainer: Trainer,
    *,
    remote: str | RemoteConfig | None = None,
    storage_options: Mapping[str, Any] | None = None,
    mode: str = "async",
    allow_pickle: bool = False,
    **writer_options: Any,
) -> Trainer:
    """Routes ``trainer``'s checkpoints through the tiers; returns the same trainer.

    Args:
        remote: a remote tier (fsspec URL or RemoteConfig) every step is promoted to.
        mode: ``"async"`` (``dcp.async_save``: training continues while the step is written)
            or ``"sync"``.
        allow_pickle: load non-tensor values (a scheduler's state, ...) with full pickle. Only
            for checkpoints you trust: a pickle can run arbitrary code. Without it, a save
            whose state holds a value ``weights_only`` loading refuses is refused with
            ConfigError, on every rank, before anything is written.
        writer_options: passed to :class:`TieredStorageWriter` (``thread_count``, ...;
            ``overwrite`` defaults to True, as Trainer overwrites a step it saves again).
    """
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
    # Trainer replays steps after resuming from an older checkpoint and, like stock Trainer,
    # saves them again: the new copy replaces the old one atomically.
    writer_options.setdefault("overwrite", True)
    if trainer.is_deepspeed_enabled:
        from .deepspeed import wrap_deepspeed

        return wrap_deepspeed(
            trainer,
            mode=mode,
            remote=remote,
            storage_options=storage_options,
            writer_options=writer_options,
            allow_pickle=allow_pickle,
        )
    if trainer.args.load_best_model_at_end:
        raise ConfigError(
            "load_best_model_at_end is not supported by dcp_tiered.shims.hf yet: "
            "load the best step with TieredStorageReader after training instead"
        )
    tiers = TrainerTiers(
        trainer, remote, storage_options, mode, writer_options, allow_pickle=allow_pickle
    )
    trainer._save_checkpoint = tiers.save_checkpoint  # type: ignore[method-assign]
    trainer._load_from_checkpoint = tiers.load_model  # type: ignore[method-assign]
    trainer._load_optimizer_and_scheduler = tiers.load_optimizer_and_scheduler  # type: ignore[method-assign]
    trainer._load_rng_state = tiers.load_rng_state  # type: ignore[method-assign]
    trainer.train = tiers.train  # type: ignore[method-assign]
    trainer.dcp_tiered = tiers  # type: ignore[attr-defined]
    return trainer


class TieredTrainer(Trainer):
    """``Trainer`` with :func:`wrap` applied; ``tiers`` holds :func:`wrap`'s keyword arguments."""

    def __init__(self, *args: Any, tiers: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        wrap(self, **dict(tiers or {}))


CONVENTIONS = Conventions(
    "HF Trainer",
    overwrite_hint="pass overwrite=True to wrap() to replace a step atomically",
    kept="the earlier checkpoint-N steps are intact",
)


class TrainerTiers:
    """The methods :func:`wrap` puts on a Trainer. The lifecycle around each save (one in
    flight, failures on every rank, ``trainer_state.json`` and ``save_total_limit`` once
    committed, durability at the end) is :class:`~dcp_tiered.lifecycle.Lifecycle`'s."""

    def __init__(
        self,
        trainer: Trainer,
        remote: str | RemoteConfig | None,
        storage_options: Mapping[str, Any] | None,
        mode: str,
        writer_options: dict[str, Any],
        *,
        allow_pickle: bool = False,
    ) -> None:
        self.trainer = trainer
        self.remote, self.storage_options = remote, storage_options
        self.mode = mode
        self.allow_pickle = allow_pickle
        self._train = trainer.train
        self.lifecycle = Lifecycle(
            CONVENTIONS,
            remote=remote,
            storage_options=storage_options,
            writer_options=writer_options,
            allow_pickle=allow_pickle,
        )

    @property
    def root(self) -> str:
        output_dir = self.trainer.args.output_dir
        assert output_dir is not None  # TrainingArguments sets a default
        return os.path.abspath(output_dir)

    # ------------------------------------------------------------ saving

    def save_checkpoint(self, model: Any, trial: Any) -> None:
        """Replaces ``Trainer._save_checkpoint``; called on every rank."""
        tr = self.trainer
        step = HF.build(tr.state.global_step)
        if tr.hp_search_backend is None and trial is None:
            tr.store_flos()
        run_dir = os.path.abspath(tr._get_output_dir(trial=trial))
        self.wait()  # one save in flight; its failure surfaces here
        best = tr.state.best_global_step
        if best and local_tier(run_dir).has_step(HF.build(best)):
            tr.state.best_model_checkpoint = os.path.join(run_dir, HF.build(best))
        _export_callback_state(tr)
        state = self._state()
        limit, best_dir = tr.args.save_total_limit, tr.state.best_model_checkpoint
        pinned = frozenset({os.path.basename(best_dir)} if best_dir else ())
        self.lifecycle.retention = (
            RetentionPolicy(keep_latest=limit, pinned=pinned) if limit else None
        )
        self.lifecycle.save(
            run_dir,
            step,
            state,
            sync=self.mode == "sync",
            on_commit=functools.partial(
                _write_trainer_state, run_dir, step, state["trainer_state"]
            ),
        )

    def _state(self) -> dict[str, Any]:
        tr, args = self.trainer, self.trainer.args
        state: dict[str, Any] = {"model": get_model_state_dict(_model(tr))}
        if not args.save_only_model:
            state["optim"] = get_optimizer_state_dict(_model(tr), _torch_optimizer(tr.optimizer))
            if tr.lr_scheduler is not None:
                state["scheduler"] = copy.deepcopy(tr.lr_scheduler.state_dict())
            state[_rng_key(args.process_index)] = capture_rng()
        state["trainer_state"] = (
            json.dumps(dataclasses.asdict(tr.state), indent=2, sort_keys=True) + "\n"
        )
        return state

    def wait(self) -> None:
        """Collective: finishes the save in flight (and its publication); raises
        SaveFailedError on every rank if it failed on any."""
        self.lifecycle.finish()

    def wait_durable(self, timeout_secs: float | None = None) -> None:
        """Collective: blocks until every step saved here is on the remote tier."""
        self.lifecycle.wait_durable(timeout_secs)

    # ------------------------------------------------------------ resuming

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` picks the newest committed step
        on any tier, a path or step name picks that step. Returns once the last step is
        committed and, with a remote tier, durable there (at most the remote's
        ``durable_timeout_secs``); raises SaveFailedError on every rank if it is not."""
        scratch = None
        # Recovery, explicitly: what a crash left in output_dir is finished or swept, and the
        # uploads a previous job left are resumed.
        self.lifecycle.start(self.root)
        if resume_from_checkpoint:
            step = self._resolve(resume_from_checkpoint)
            # Trainer reads trainer_state.json by path; give it the committed step's own copy.
            scratch = tempfile.mkdtemp(prefix="dcp-tiered-resume-")
            resume_from_checkpoint = os.path.join(scratch, step)
            os.makedirs(resume_from_checkpoint)
            state = self._load(step, {"trainer_state": ""})["trainer_state"]
            with open(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME), "w") as f:
                f.write(state)
        try:
            out = self._train(resume_from_checkpoint or None, *args, **kwargs)
            # The end of the job: the last step is committed, published and, with a remote
            # tier, durable there when train() returns (or it raises, on every rank).
            self.lifecycle.close()
            return out
        finally:
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)

    def committed(self, *, strict: bool = False) -> list[str]:
        """The committed ``checkpoint-N`` steps on any tier, oldest first. With ``strict``, a
        remote that cannot be read raises TierUnavailableError instead of being left out."""
        remote = remote_backend(self.remote, self.storage_options)
        return [s.name for _, s in numbered_steps(self.root, remote, HF, strict=strict)]

    def latest(self) -> str | None:
        """The step ``train(resume_from_checkpoint=True)`` resumes from, or None."""
        steps = self.committed()
        return steps[-1] if steps else None

    def _resolve(self, wanted: str | bool) -> str:
        steps = self.committed(strict=True)  # an unreadable remote is not "nothing to resume"
        where = self.root + (f" or {self.remote}" if self.remote else "")
        if wanted is True:
            if not steps:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint-N step in {where}: nothing to resume "
                    "from. Train without resume_from_checkpoint, or check output_dir/remote."
                )
            return steps[-1]
        name = os.path.basename(os.path.normpath(str(wanted)))
        if name not in steps:
            raise CheckpointNotFoundError(
                f"no committed step {name!r} in {where}. Committed: {', '.join(steps) or 'none'}."
            )
        return name

    def load_model(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Replaces ``Trainer._load_from_checkpoint``."""
        model = model if model is not None else _model(self.trainer)
        step = os.path.basename(resume_from_checkpoint)
        state = self._load(step, {"model": get_model_state_dict(model)})
        set_model_state_dict(model, state["model"])

    def load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Replaces ``Trainer._load_optimizer_and_scheduler``."""
        tr = self.trainer
        if checkpoint is None or tr.args.save_only_model:
            return
        opt = _torch_optimizer(tr.optimizer)
        wanted: dict[str, Any] = {"optim": get_optimizer_state_dict(_model(tr), opt)}
        if tr.lr_scheduler is not None:
            wanted["scheduler"] = tr.lr_scheduler.state_dict()
        state = self._load(os.path.basename(checkpoint), wanted)
        set_optimizer_state_dict(_model(tr), opt, state["optim"])
        if tr.lr_scheduler is not None:
            tr.lr_scheduler.load_state_dict(state["scheduler"])

    def load_rng_state(self, checkpoint: str | None) -> None:
        """Replaces ``Trainer._load_rng_state``: this rank's generators as saved."""
        if checkpoint is None:
            return
        key = _rng_key(self.trainer.args.process_index)
        state = self._load(os.path.basename(checkpoint), {key: capture_rng()}, partial=True)
        if state.get(key) is None:
            logger.info(
                "no RNG state for process %s in %s: resuming with different randomness "
                "(was the world size different?)",
                self.trainer.args.process_index,
                checkpoint,
            )
            return
        restore_rng(state[key])

    def _load(self, step: str, wanted: dict[str, Any], *, partial: bool = False) -> dict[str, Any]:
        """Reads ``wanted``'s keys of ``step`` on this rank alone, from the nearest valid tier."""
        reader = TieredStorageReader(
            self.root,
            remote=self.remote,
            storage_options=self.storage_options,
            allow_pickle=self.allow_pickle,
        )
        if partial:
            reader.reset(step)
            present = reader.read_metadata().state_dict_metadata
            wanted = {k: v for k, v in wanted.items() if any(f.split(".")[0] == k for f in present)}
        with quiet_single_process():
            dcp.load(
                wanted,
                checkpoint_id=step,
                storage_reader=reader,
                no_dist=True,
                planner=DefaultLoadPlanner(allow_partial_load=partial),
            )
        return wanted


# ------------------------------------------------------------------ helpers


def _model(tr: Trainer) -> torch.nn.Module:
    assert tr.model is not None  # Trainer(model_init=...) builds it before training starts
    return tr.model


def _torch_optimizer(opt: Any) -> torch.optim.Optimizer:
    return getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps it


def _export_callback_state(tr: Trainer) -> None:
    """What ``Trainer._save_checkpoint`` does for stateful callbacks (early stopping, ...)."""
    # TrainerState declares a list; its __post_init__ makes it the dict Trainer uses.
    stateful: dict[str, Any] = tr.state.stateful_callbacks  # type: ignore[assignment]
    for cb in [*tr.callback_handler.callbacks, tr.control]:
        if isinstance(cb, ExportableState):
            name = cb.__class__.__name__
            if isinstance(stateful.get(name), list):
                stateful[name].append(cb.state())
            else:
                stateful[name] = cb.state()


def _rng_key(process_index: int) -> str:
    # RankState's format (capture_rng); steps saved in the older format used "rng_N" and now
    # resume with different randomness (logged) instead of failing on the other layout.
    return f"rng_state_{process_index}"


def _write_trainer_state(run_dir: str, step: str, trainer_state: str) -> None:
    """Once committed: the plain ``trainer_state.json`` beside the data, for tools."""
    local_tier(run_dir).backend.write_atomically(step, TRAINER_STATE_NAME, trainer_state.encode())
