"""``dcp-tiered convert deepspeed``: a DeepSpeed ZeRO checkpoint as world-size-independent DCP.

DeepSpeed's own universal-checkpoint tool (``ds_to_universal``) does the hard part: it merges
every rank's flat ZeRO partitions back into whole parameters, including padding, ZeRO-3 and
bf16 master weights. This module only runs it and rewrites its per-parameter files as one DCP
step in the layout ``torch.distributed.checkpoint.state_dict`` uses::

    {"model": {fqn: fp32 tensor, ...buffers},
     "optim": {"state": {fqn: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}},
               "param_groups": [{"lr": ..., "params": [fqn, ...]}, ...]},
     "deepspeed": {"tag": ..., "global_steps": ..., "zero_stage": ..., "ds_version": ...}}

so ``set_model_state_dict`` / ``set_optimizer_state_dict`` load it into a plain module or an
FSDP2 one, at any world size. The source can be DeepSpeed's own files or a step written by
:mod:`dcp_tiered.shims.deepspeed` (its files are materialised first).

``ds_to_universal`` unpickles its input without restriction, so native input files are first
opened with torch's ``weights_only`` loader and DeepSpeed's plain-data classes; a file that
needs anything else is refused unless the caller says the source is trusted.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import logging
import os
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ...errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    IntegrityError,
)
from ...lifecycle.roots import MANIFEST_NAME, local_tier
from ...writer import TieredStorageWriter
from . import files as ds_shim

logger = logging.getLogger(__package__)  # one logger per adapter, as before its split

UNIVERSAL_PARAM = "param"  # ds_to_universal's key for a merged tensor (stages 1/2)


def convert(
    src: str,
    dst: str,
    *,
    tag: str | None = None,
    native: bool = False,
    trust_source: bool = False,
    overwrite: bool = False,
    work_dir: str | None = None,
) -> str:
    """Converts checkpoint ``tag`` (default: the one ``latest`` names) of ``src`` into ``dst``.

    ``src`` is DeepSpeed's save directory or one tag directory in it. The result is written as
    DCP step ``tag`` of the tier root ``dst``, or, with ``native``, as DeepSpeed's own files in
    ``dst/tag`` (what ``zero_to_fp32`` reads). Returns the path written.
    """
    save_dir, tag = _locate(src, tag)
    tag_dir = os.path.join(save_dir, tag)
    taken = os.path.exists(os.path.join(dst, tag)) if native else local_tier(dst).has_step(tag)
    if taken and not overwrite:
        raise CheckpointExistsError(
            f"{os.path.join(dst, tag)} already exists; choose another "
            "destination or pass --overwrite"
        )
    with tempfile.TemporaryDirectory(prefix="dcp-tiered-convert-", dir=work_dir) as tmp:
        if os.path.exists(os.path.join(tag_dir, MANIFEST_NAME)):
            if native:
                return _materialise(save_dir, tag, dst)
            tag_dir = _materialise(save_dir, tag, os.path.join(tmp, "native"))
        else:
            if native:
                raise ConfigError(f"{tag_dir} already holds DeepSpeed's own files")
            if not trust_source:
                _vet_native(tag_dir)
        state = _to_state(_universal(tag_dir, os.path.join(tmp, "universal", tag)), tag)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process: yes
        dcp.save(
            state,
            checkpoint_id=tag,
            no_dist=True,
            storage_writer=TieredStorageWriter(dst, overwrite=overwrite),
        )
    logger.info("converted DeepSpeed checkpoint %s into DCP step %s of %s", tag_dir, tag, dst)
    return os.path.join(dst, tag)


def _locate(src: str, tag: str | None) -> tuple[str, str]:
    src = os.path.abspath(src)
    if not os.path.isdir(src):
        raise CheckpointNotFoundError(f"no DeepSpeed checkpoint at {src}: not a directory")
    if tag is None and not os.path.exists(os.path.join(src, ds_shim.LATEST_NAME)):
        if glob.glob(os.path.join(src, "*model_states.pt")):
            return os.path.dirname(src), os.path.basename(src)  # a tag directory
        raise CheckpointNotFoundError(
            f"{src} has no 'latest' file and no *model_states.pt: pass a DeepSpeed save "
            "directory, one of its tag directories, or --tag"
        )
    if tag is None:
        with open(os.path.join(src, ds_shim.LATEST_NAME)) as f:
            tag = f.read().strip()
    if not os.path.isdir(os.path.join(src, tag)):
        raise CheckpointNotFoundError(f"no checkpoint {tag!r} in {src}")
    return src, tag


def _materialise(save_dir: str, tag: str, out_root: str) -> str:
    """Writes a dcp_tiered DeepSpeed step back as DeepSpeed's own files, plus ``latest``."""
    out = os.path.join(out_root, tag)
    os.makedirs(out, exist_ok=True)
    for name in ds_shim.file_names(save_dir, tag):
        torch.save(ds_shim.read_file(save_dir, tag, name), os.path.join(out, name))
    with open(os.path.join(out_root, ds_shim.LATEST_NAME), "w") as f:
        f.write(tag)
    return out


def _vet_native(tag_dir: str) -> None:
    """Every input file must load without running code before ``ds_to_universal`` opens it."""
    with torch.serialization.safe_globals(list(ds_shim.deepspeed_classes())):
        for path in sorted(glob.glob(os.path.join(tag_dir, "*.pt"))):
            try:
                torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:
                raise IntegrityError(
                    f"{path} holds objects beyond tensors and DeepSpeed's plain-data classes "
                    f"({str(e).splitlines()[-1]}); converting it would unpickle them. If you "
                    "wrote this checkpoint yourself, pass --trust-source."
                ) from e


def _universal(tag_dir: str, out: str) -> str:
    from deepspeed.checkpoint import ds_to_universal

    if not glob.glob(os.path.join(tag_dir, "*optim_states.pt")):
        raise ConfigError(
            f"{tag_dir} is a ZeRO stage 0 checkpoint (no *optim_states.pt): its model states "
            "file already holds whole parameters ('module') and the optimizer's state dict "
            "('optimizer'). The converter handles ZeRO stages 1-3."
        )
    args = argparse.Namespace(
        input_folder=tag_dir,
        output_folder=out,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # ZeRO-1/2 outside Megatron-DeepSpeed lack this info
    )
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal.main(args)
    except Exception as e:
        raise ConfigError(
            f"DeepSpeed's ds_to_universal failed on {tag_dir}: {e!r}\n{log.getvalue()[-2000:]}"
        ) from e
    return out


def _to_state(universal: str, tag: str) -> dict[str, Any]:
    trusted = ds_shim.deepspeed_classes()

    def load(*parts: str) -> Any:
        with torch.serialization.safe_globals(list(trusted)):
            return torch.load(
                os.path.join(universal, *parts), map_location="cpu", weights_only=True
            )

    model_file = min(glob.glob(os.path.join(universal, "*model_states.pt")))
    model_states = load(os.path.basename(model_file))
    common = load("zero", "optimizer_state.pt")
    groups = [list(shapes.items()) for shapes in model_states["param_shapes"]]
    zero_stage = int(common["zero_stage"])

    def tensor(name: str, what: str, shape: torch.Size | None = None) -> torch.Tensor:
        value = load("zero", name, f"{what}.pt")
        value = value[UNIVERSAL_PARAM] if isinstance(value, dict) else value
        return value if shape is None else value.reshape(shape)  # ZeRO-3 files are flat

    model: dict[str, torch.Tensor] = {}
    optim_state: dict[str, dict[str, Any]] = {}
    param_groups = []
    for index, group in enumerate(groups):
        for name, shape in group:
            model[name] = tensor(name, "fp32", shape)
            kinds = sorted(
                os.path.splitext(f)[0]
                for f in os.listdir(os.path.join(universal, "zero", name))
                if f != "fp32.pt"
            )
            optim_state[name] = {
                k: tensor(name, k, torch.Size([]) if k == "step" else shape) for k in kinds
            }
            if "step" not in optim_state[name]:  # ZeRO-3 keeps one step per group
                optim_state[name]["step"] = common["optimizer_state_dict"]["state"][index]["step"]
        hyper = {k: v for k, v in common["param_groups"][index].items() if k != "params"}
        param_groups.append({**hyper, "params": [name for name, _ in group]})
    for name in model_states.get("buffer_names", []):
        model[name] = model_states["module"][name]
    for name in sorted(os.listdir(os.path.join(universal, "zero"))):
        if name not in model and os.path.isdir(os.path.join(universal, "zero", name)):
            model[name] = tensor(name, "fp32")  # frozen: no optimizer state
    return {
        "model": model,
        "optim": {"state": optim_state, "param_groups": param_groups},
        "deepspeed": {
            "tag": tag,
            "global_steps": int(model_states.get("global_steps", 0)),
            "zero_stage": zero_stage,
            "ds_version": str(model_states.get("ds_version")),
        },
    }
