"""EasyCkpt's module functions: :func:`initialize` builds an :class:`EasyCkpt`, and the others
call the one built last."""

from __future__ import annotations

import os
from typing import Any

from ...errors import ConfigError
from .facade import EasyCkpt

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
