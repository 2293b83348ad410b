"""DeepSpeed: ``engine.save_checkpoint`` / ``load_checkpoint`` through DCP and the tiers.

One line before ``deepspeed.initialize`` (this also covers HF Trainer, which builds the engine
itself)::

    from dcp_tiered.shims import deepspeed as ds_tiers
    ds_tiers.install(mode="async", remote="s3://bucket/run-1")

or ``ds_tiers.attach(engine, ...)`` after it. Then, at the end of training, on every rank::

    ds_tiers.flush(engine)   # waits for the last save and publishes it

How it maps onto DeepSpeed's checkpoint-engine protocol (deepspeed/runtime/engine.py):

- ``save(state, path)``, once per DeepSpeed file, only records the file's state (tensors plus a
  skeleton, see :mod:`dcp_tiered.shims.skeleton`) under the file's name.
- ``commit`` (sync and async modes) writes every rank's files as one DCP step named after the
  tag, ``SAVE_DIR/TAG``, on a dedicated gloo group. ``decoupled`` mode launches the write when
  ``save_checkpoint`` returns and lets DeepSpeed's ``get_commit_info`` poll for completion at
  step boundaries, with a consensus on the checkpoint layer's own gloo group.
- DeepSpeed writes ``latest`` right after ``commit`` returns, with a plain ``open``: for an
  async save that is before the data exists. ``save_checkpoint`` is therefore wrapped to pass
  ``save_latest=False``, and rank 0 publishes ``latest`` itself, atomically, once the step is
  committed (the DCP coordinator finishes only after every rank's data is written).
- DeepSpeed's loader globs for its own file names, so small JSON stubs with those names are
  written into the committed step before ``latest`` moves. ``load(path)`` reads just that
  file's keys, non-collectively, as DeepSpeed expects.
"""

from __future__ import annotations

from .engine import CONVENTIONS, MODES, Options, TieredCheckpointEngine  # DeepSpeed's ImportError
from .files import (
    LATEST_NAME,
    SIDECARS,
    STUB_FORMAT,
    adopt,
    deepspeed_classes,
    file_names,
    publish,
    read_file,
    write_sidecars,
)
from .install import attach, flush, install, uninstall

__all__ = [
    "CONVENTIONS",
    "LATEST_NAME",
    "MODES",
    "SIDECARS",
    "STUB_FORMAT",
    "Options",
    "TieredCheckpointEngine",
    "adopt",
    "attach",
    "deepspeed_classes",
    "file_names",
    "flush",
    "install",
    "publish",
    "read_file",
    "uninstall",
    "write_sidecars",
]
