"""HF Trainer + DeepSpeed: Trainer's layout, with the whole checkpoint inside the DeepSpeed step.

Under DeepSpeed, Trainer saves ``OUTPUT_DIR/checkpoint-N`` itself: DeepSpeed's files go through
``engine.save_checkpoint`` (so through :mod:`dcp_tiered.shims.deepspeed`, as step
``checkpoint-N/global_stepN``), and Trainer then writes its own files beside them
(``trainer_state.json``, every rank's ``rng_state_R.pth``, the scheduler and config files).
:func:`wrap_deepspeed` (which :func:`dcp_tiered.shims.hf.wrap` calls) makes those files travel
inside the step, so that:

- a fresh node resumes from the remote tier alone: ``train(resume_from_checkpoint=True)`` finds
  the newest step on either tier and rebuilds ``checkpoint-N`` (the step, DeepSpeed's stubs and
  ``latest``, and Trainer's files) before Trainer looks for it;
- ``save_total_limit`` deletes a ``checkpoint-N`` only once its step is durable on the remote
  tier (Trainer's own rotation would delete a step still uploading);
- ``train()`` returns once the last step is committed and durable (``ds_tiers.flush``).

Model weight files Trainer writes for convenience (``model.safetensors``...) stay out of the
step: DeepSpeed's own state holds the weights, and the copy would double the bytes.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from ... import RetentionPolicy
from ...config import RemoteConfig
from ...errors import CheckpointNotFoundError, DcpTieredError, TierUnavailableError
from ...lifecycle.roots import (
    DEEPSPEED,
    HF,
    files_in,
    is_step_name,
    local_tier,
    remote_backend,
    remote_step_names,
)
from ...lifecycle.step_roots import join_run, prune_step_roots
from .. import deepspeed as ds_shim
from .._common import Agreement, is_node_leader

logger = logging.getLogger(__package__)  # one logger per adapter, as before its split

_RNG = re.compile(r"^rng_state(_\d+)?\.pth$")
_WEIGHTS = re.compile(
    r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)"
    r"(\.index\.json)?$"
)


def wrap_deepspeed(
    trainer: Any,
    *,
    mode: str,
    remote: str | RemoteConfig | None,
    storage_options: Mapping[str, Any] | None,
    writer_options: dict[str, Any],
    allow_pickle: bool = False,
) -> Any:
    """What :func:`dcp_tiered.shims.hf.wrap` does for a Trainer with DeepSpeed enabled."""
    ds_shim.install(
        mode=mode,
        remote=remote,
        storage_options=storage_options,
        allow_pickle=allow_pickle,
        **writer_options,
    )
    save, train = trainer._save_checkpoint, trainer.train

    @functools.wraps(save)
    def save_checkpoint(model: Any, trial: Any = None) -> None:
        engine = trainer.model_wrapped.checkpoint_engine
        args, limit = trainer.args, trainer.args.save_total_limit
        run_dir = os.path.abspath(trainer._get_output_dir(trial=trial))
        name = HF.build(trainer.state.global_step)
        engine.wait()  # the previous save is committed (or failed, on every rank) first
        # Trainer writes its files into checkpoint-N before the step exists: the directory is
        # made pending first, so a crash leaves nothing a resume takes for a checkpoint, and
        # the next start sweeps it.
        tier = local_tier(run_dir)
        if engine.lifecycle.writers.run_id is None:  # the first save decides the run
            engine.lifecycle.writers.run_id = join_run(
                engine.lifecycle.agree, tier, remote, storage_options
            )
        claimed = args.process_index == 0 and tier.claim_pending(name, [], whole=True)
        engine.lifecycle.agree.barrier()  # nobody writes into it before the claim
        args.save_total_limit = None  # Trainer's rotation would delete steps still uploading
        try:
            with engine.holding():
                save(model, trial)
        finally:
            args.save_total_limit = limit
        settle = functools.partial(tier.settle_pending, name)
        launched = engine.release(
            _own_files(os.path.join(run_dir, name), args.process_index),
            on_commit=settle if claimed else None,
        )
        if claimed and not launched:  # no DeepSpeed step (save_only_model): Trainer's alone
            settle()
        if args.should_save and limit:
            rotate(run_dir, limit, trainer.state.best_model_checkpoint, remote, storage_options)

    @functools.wraps(train)
    def train_then_flush(resume_from_checkpoint: Any = None, *a: Any, **kw: Any) -> Any:
        run_dir = os.path.abspath(trainer.args.output_dir)
        if is_node_leader() and os.path.isdir(run_dir):  # what a crashed save left
            local_tier(run_dir).sweep_pending()
        if resume_from_checkpoint:  # Trainer's own pick could be a crashed save's directory
            resume_from_checkpoint = prepare_resume(
                run_dir, resume_from_checkpoint, remote, storage_options
            )
        out = train(resume_from_checkpoint, *a, **kw)
        ds_shim.flush(trainer.model_wrapped)  # committed, published and durable
        args = trainer.args
        if args.should_save and args.save_total_limit:  # now that every step is durable
            rotate(
                run_dir,
                args.save_total_limit,
                trainer.state.best_model_checkpoint,
                remote,
                storage_options,
            )
        return out

    trainer._save_checkpoint = save_checkpoint
    trainer.train = train_then_flush
    return trainer


def _own_files(step_dir: str, process_index: int) -> dict[str, bytes]:
    """The files of ``step_dir`` this rank carries into the step: its own RNG state and, on
    process 0, the rest of Trainer's files (weights and ``latest`` left out)."""
    backend = files_in(step_dir)
    own_rng = {f"rng_state_{process_index}.pth"} | (
        {"rng_state.pth"} if process_index == 0 else set()
    )
    files = {}
    for name in backend.list_names():
        if not is_step_name(name):  # hidden files (our pending marker): not Trainer's
            continue
        if _RNG.match(name):
            wanted = name in own_rng
        else:
            wanted = process_index == 0 and not _WEIGHTS.match(name) and name != ds_shim.LATEST_NAME
        if wanted and backend.is_regular_file(name):
            files[name] = backend.read_file(name)
    return files


def prepare_resume(
    run_dir: str,
    wanted: Any,
    remote: str | RemoteConfig | None,
    storage_options: Mapping[str, Any] | None,
) -> str:
    """Collective: the ``checkpoint-N`` directory Trainer resumes from, rebuilt from the remote
    tier (by one process a node) when this node lacks it. ``wanted`` is True (the newest
    committed step on either tier; never a directory a crash left mid-save) or a checkpoint
    path or name."""
    agree = Agreement()
    if wanted is True:
        number = agree.from_rank0(lambda: _newest(run_dir, remote, storage_options))
        if number is None:
            raise CheckpointNotFoundError(
                f"no committed checkpoint-N in {run_dir}"
                + (f" and no global_stepN on {remote}" if remote is not None else "")
                + ": nothing to resume from. Train without resume_from_checkpoint, or check "
                "the paths."
            )
    else:
        number = HF.parse(os.path.basename(os.path.normpath(str(wanted))))
        if number is None:
            return str(wanted)  # not Trainer's layout: Trainer says what is wrong with it
    step_dir, tag = os.path.join(run_dir, HF.build(number)), DEEPSPEED.build(number)
    agree.by_node_leaders(
        lambda: _rebuild(step_dir, tag, remote, storage_options),
        f"rebuilding {step_dir}",
    )
    return step_dir


def _newest(
    run_dir: str, remote: str | RemoteConfig | None, storage_options: Mapping[str, Any] | None
) -> int | None:
    """The newest N whose step is committed here or on the remote tier. A ``checkpoint-N``
    without its committed step is what a crash left mid-save: Trainer would pick it."""
    local = [
        number
        for n in (os.listdir(run_dir) if os.path.isdir(run_dir) else [])
        if (number := HF.parse(n)) is not None
        and local_tier(os.path.join(run_dir, n)).has_step(DEEPSPEED.build(number))
    ]
    backend = remote_backend(remote, storage_options)
    try:
        on_remote = [
            number for n in remote_step_names(backend) if (number := DEEPSPEED.parse(n)) is not None
        ]
    except DcpTieredError as e:
        raise TierUnavailableError(
            f"cannot list {backend.config.url if backend else remote}: {e}. Which steps exist "
            "there is unknown, so nothing was resumed; fix the remote and train again"
        ) from e
    return max(local + on_remote, default=None)


def _rebuild(
    step_dir: str,
    tag: str,
    remote: str | RemoteConfig | None,
    storage_options: Mapping[str, Any] | None,
) -> None:
    """``step_dir`` as Trainer wrote it: the step (adopted from the remote if missing), its
    stubs and ``latest``, and Trainer's files from inside the step."""
    adopted = not local_tier(step_dir).has_step(tag)
    if adopted:
        if remote is None:
            raise CheckpointNotFoundError(
                f"{step_dir} holds no committed {tag} (a save that did not finish?) and there is "
                "no remote tier to take it from; resume from another checkpoint"
            )
        ds_shim.adopt(step_dir, tag, remote, storage_options)
    if adopted or not os.path.isfile(os.path.join(step_dir, "trainer_state.json")):
        names = ds_shim.write_sidecars(
            step_dir, tag, step_dir, remote=remote, storage_options=storage_options
        )
        logger.info("rebuilt %s: %s", step_dir, ", ".join(names) or "no files")


def rotate(
    run_dir: str,
    limit: int,
    best: str | None,
    remote: str | RemoteConfig | None,
    storage_options: Mapping[str, Any] | None,
) -> list[str]:
    """``save_total_limit`` over ``checkpoint-N`` directories: the newest ``limit`` and the
    best are kept, and a directory whose step is not durable on the remote tier (while it
    cannot tell) is never deleted. Every delete is logged."""
    policy = RetentionPolicy(
        keep_latest=limit, pinned=frozenset({os.path.basename(best)} if best else ())
    )
    return prune_step_roots(
        run_dir,
        HF,
        policy,
        remote,
        storage_options,
        label="save_total_limit",
        reason=f"save_total_limit={limit}",
    )


__all__ = ["prepare_resume", "rotate", "wrap_deepspeed"]
