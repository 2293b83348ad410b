"""Switching DeepSpeed engines to :class:`~dcp_tiered.shims.deepspeed.TieredCheckpointEngine`:
:func:`install` (engines built from now on), :func:`attach` (one built already), and the
wrappers of ``save_checkpoint``/``load_checkpoint`` that DeepSpeed's protocol needs."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

from ...config import RemoteConfig
from .engine import Options, TieredCheckpointEngine


def install(
    *,
    mode: str = "async",
    remote: str | RemoteConfig | None = None,
    storage_options: Mapping[str, Any] | None = None,
    trusted_classes: Iterable[type] = (),
    allow_pickle: bool = False,
    **writer_options: Any,
) -> None:
    """Makes every DeepSpeed engine built from now on checkpoint through dcp_tiered.

    Call before ``deepspeed.initialize`` (or before ``Trainer.train`` for HF + DeepSpeed).

    Args:
        mode: ``"sync"`` (``save_checkpoint`` returns once committed), ``"async"`` (it returns
            once the state is staged; ``latest`` moves when the write is done) or
            ``"decoupled"`` (DeepSpeed's own async protocol: completion is polled at step
            boundaries).
        remote: a remote tier (fsspec URL or RemoteConfig) each step is promoted to.
        trusted_classes: extra classes your ``client_state`` holds, allowed when loading.
        allow_pickle: load the checkpoint's non-tensor values with full pickle. Only for
            checkpoints you trust: a pickle can run arbitrary code. Without it, a save whose
            state holds a value that would not load back (a class neither DeepSpeed's nor in
            ``trusted_classes``) is refused with ConfigError, on every rank, before anything
            is written.
        writer_options: passed to :class:`TieredStorageWriter` (``thread_count``, ...).
    """
    import deepspeed.runtime.engine as ds_engine

    options = Options(
        mode, remote, storage_options, tuple(trusted_classes), writer_options, allow_pickle
    )
    _patch_save_checkpoint(ds_engine.DeepSpeedEngine)
    _patch_load_checkpoint(ds_engine.DeepSpeedEngine)
    ds_engine.create_checkpoint_engine = functools.partial(_factory, options)


def uninstall() -> None:
    """Undoes :func:`install` for engines built from now on."""
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.runtime.checkpoint_engine import create_checkpoint_engine

    ds_engine.create_checkpoint_engine = create_checkpoint_engine


def attach(engine: Any, **kwargs: Any) -> TieredCheckpointEngine:
    """Switches an engine that ``deepspeed.initialize`` already built (same arguments as
    :func:`install`). Call on every rank."""
    trusted = tuple(kwargs.pop("trusted_classes", ()))
    allow_pickle = bool(kwargs.pop("allow_pickle", False))
    options = Options(
        kwargs.pop("mode", "async"),
        kwargs.pop("remote", None),
        kwargs.pop("storage_options", None),
        trusted,
        kwargs,
        allow_pickle,
    )
    _patch_save_checkpoint(type(engine))
    _patch_load_checkpoint(type(engine))
    engine.checkpoint_engine = TieredCheckpointEngine(options)
    return engine.checkpoint_engine


def flush(engine: Any, timeout_secs: float | None = None) -> None:
    """Call on every rank at the end of training: the last checkpoint is committed, ``latest``
    names it and, with a remote tier, every step saved is durable there when this returns
    (see :meth:`TieredCheckpointEngine.flush`)."""
    if isinstance(engine.checkpoint_engine, TieredCheckpointEngine):
        engine.checkpoint_engine.flush(timeout_secs)


def _factory(options: Options, config_params: Any = None, **_: Any) -> TieredCheckpointEngine:
    return TieredCheckpointEngine(options, config_params)


def _patch_load_checkpoint(cls: type[Any]) -> None:
    original = cls.load_checkpoint
    if getattr(original, "_dcp_tiered", False):
        return

    @functools.wraps(original)
    def load_checkpoint(
        self: Any, load_dir: str, tag: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        engine = getattr(self, "checkpoint_engine", None)
        if isinstance(engine, TieredCheckpointEngine):
            engine.prepare_load(load_dir, tag)
        return original(self, load_dir, tag, *args, **kwargs)

    load_checkpoint._dcp_tiered = True  # type: ignore[attr-defined]
    cls.load_checkpoint = load_checkpoint


def _patch_save_checkpoint(cls: type[Any]) -> None:
    original = cls.save_checkpoint
    if getattr(original, "_dcp_tiered", False):
        return

    @functools.wraps(original)
    def save_checkpoint(
        self: Any,
        save_dir: str,
        tag: Any = None,
        client_state: Any = None,
        save_latest: bool = True,
        **kwargs: Any,
    ) -> Any:
        engine = getattr(self, "checkpoint_engine", None)
        if not isinstance(engine, TieredCheckpointEngine):
            return original(self, save_dir, tag, client_state or {}, save_latest, **kwargs)
        engine._want_latest = save_latest  # we publish it, atomically, once committed
        done = original(self, save_dir, tag, client_state or {}, False, **kwargs)
        engine.launch_decoupled()
        return done

    save_checkpoint._dcp_tiered = True  # type: ignore[attr-defined]
    cls.save_checkpoint = save_checkpoint
