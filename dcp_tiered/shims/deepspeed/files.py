"""A DeepSpeed step's files: reading one back as DeepSpeed saved it, the files that travel
inside the step, the stubs and ``latest`` that let DeepSpeed's loader find a committed step,
and adopting a step from the remote tier. Needs DeepSpeed only for its classes, when loading."""

from __future__ import annotations

import io
import logging
import operator
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ...config import RemoteConfig
from ...errors import CheckpointNotFoundError, ManifestError
from ...lifecycle.roots import (
    adopt_remote_step,
    files_in,
    is_step_name,
    local_tier,
    newest_step,
    remote_backend,
    validate_step_name,
    write_file_atomically,
)
from ...reader import TieredStorageReader
from .. import skeleton
from .._common import load_keys

logger = logging.getLogger(__package__)  # one logger per adapter, as before its split

STUB_FORMAT = "dcp_tiered.deepspeed-stub/1"
LATEST_NAME = "latest"
SIDECARS = "dcp_tiered.sidecars"  # files of the framework's own that travel inside the step


def deepspeed_classes() -> list[type]:
    """Plain-data classes DeepSpeed puts in its checkpoint files (beside tensors and dicts)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def read_file(
    save_dir: str,
    tag: str,
    name: str,
    *,
    remote: str | RemoteConfig | None = None,
    storage_options: Mapping[str, Any] | None = None,
    trusted_classes: Iterable[type] = (),
    allow_pickle: bool = False,
) -> Any:
    """DeepSpeed file ``name`` of step ``tag``, as DeepSpeed saved it. Not collective.

    Only that file's keys are read, from the nearest tier holding a valid copy.
    ``allow_pickle``: rebuild its structure with full pickle (checkpoints you trust only).
    """
    reader = TieredStorageReader(
        save_dir, remote=remote, storage_options=storage_options, allow_pickle=allow_pickle
    )
    reader.reset(tag)
    out: dict[str, Any] = {}
    load_keys(out, {name}, reader)
    if name not in out:
        raise FileNotFoundError(f"step {tag!r} in {save_dir} holds no DeepSpeed file {name!r}")
    return skeleton.join(
        out[name],
        where=f"{os.path.join(save_dir, tag, name)} (step {tag!r})",
        trusted=[*deepspeed_classes(), *trusted_classes],
        allow_pickle=allow_pickle,
    )


def file_names(save_dir: str, tag: str) -> list[str]:
    """The DeepSpeed files a committed step holds, from its verified manifest."""
    planner_data = local_tier(save_dir).read_manifest(tag).metadata.planner_data
    return sorted(
        {str(path[0]) for path in (planner_data or {}).values() if path and path[0] != SIDECARS}
    )


def write_sidecars(
    save_dir: str,
    tag: str,
    directory: str,
    *,
    remote: str | RemoteConfig | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Writes the files that travel inside step ``tag`` (see
    :meth:`~dcp_tiered.shims.deepspeed.TieredCheckpointEngine.release`) into ``directory``, from the nearest tier holding a
    valid copy; returns their names. Not collective."""
    reader = TieredStorageReader(save_dir, remote=remote, storage_options=storage_options)
    reader.reset(tag)
    out: dict[str, Any] = {}
    load_keys(out, {SIDECARS}, reader)
    files = out.get(SIDECARS, {})
    backend = files_in(directory)
    for name in files:
        if not is_step_name(name):  # a plain file name: nothing that climbs out of directory
            raise ManifestError(
                f"step {tag!r} in {save_dir} carries a file named {name!r}, "
                "which is not a plain file name; nothing was written"
            )
    for name, data in files.items():
        backend.replace_root_file(name, data.numpy().tobytes())
    return sorted(files)


def adopt(
    save_dir: str,
    tag: str | None,
    remote: str | RemoteConfig,
    storage_options: Mapping[str, Any] | None = None,
) -> str | None:
    """Make step ``tag`` (default: what ``latest`` names, else the newest step on either tier)
    loadable by DeepSpeed from ``save_dir``, adopting it from the remote if this disk lacks it.
    Returns the tag, or None when neither tier holds a step (a fresh start)."""
    tier, backend = local_tier(save_dir), remote_backend(remote, storage_options)
    assert backend is not None
    latest_path = os.path.join(save_dir, LATEST_NAME)
    has_latest = os.path.isfile(latest_path)
    if tag is None and has_latest:
        with open(latest_path, encoding="utf-8") as f:
            tag = f.read().strip()
    if tag is None:
        try:
            tag = newest_step(save_dir, backend)
        except CheckpointNotFoundError:
            return None
    tag = validate_step_name(str(tag))
    if tier.has_step(tag) and has_latest:
        return tag
    adopt_remote_step(save_dir, backend, tag)
    publish(save_dir, tag, latest=not has_latest)
    return tag


def publish(save_dir: str, tag: str, *, latest: bool) -> None:
    """Writes DeepSpeed's file stubs into the committed step, then (optionally) ``latest``.

    The stub names come from the committed step's own metadata, so they can be rebuilt from
    any copy of the step (for instance one restored from the remote tier).
    """
    step_dir, backend = os.path.join(save_dir, tag), local_tier(save_dir).backend
    for name in file_names(save_dir, tag):
        backend.write_sidecar(tag, name, _stub(step_dir, name))
    if latest:
        write_file_atomically(os.path.join(save_dir, LATEST_NAME), tag.encode())
        logger.info("published %s as the latest DeepSpeed checkpoint in %s", tag, save_dir)


class _StubError:
    """Unpickles to ``{}[message]``: DeepSpeed's own tools (``zero_to_fp32``, ``ds_to_universal``)
    load the stub with a full unpickler and stop with this KeyError, which says what to run.
    Nothing else runs; dcp_tiered itself never unpickles a stub (see :func:`is_stub`)."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return operator.getitem, ({}, self.message)


def _stub(step_dir: str, name: str) -> bytes:
    message = (
        f"{STUB_FORMAT}: {name} is a placeholder written by dcp_tiered; the data of "
        f"{os.path.basename(step_dir)} is in the DCP step in {step_dir}. DeepSpeed loads it "
        "with dcp_tiered.shims.deepspeed installed. For DeepSpeed's own tools, convert it "
        f"first: 'dcp-tiered convert deepspeed {step_dir} OUT' writes full fp32 weights and "
        "optimizer state as DCP; add --native to write DeepSpeed's own files (zero_to_fp32)."
    )
    buf = io.BytesIO()
    torch.save(_StubError(message), buf)  # a real torch file: zero_to_fp32 opens it with mmap
    return buf.getvalue()


def is_stub(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(1024)  # the message sits, uncompressed, near the start of the zip
    return STUB_FORMAT.encode() in head


def bytes_tensor(data: bytes) -> torch.Tensor:
    """A copy of ``data`` as a uint8 tensor (torch.frombuffer refuses an empty buffer)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
