"""Helpers for worker processes launched by torchrun in the tests."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for tests._model
warnings.filterwarnings("ignore")
torch.set_num_threads(1)


def init() -> tuple[int, int]:
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def shard(model: torch.nn.Module, kind: str, world: int) -> torch.nn.Module:
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from tests._model import Block

        return FSDP(
            model,
            device_id=torch.device("cpu"),
            use_orig_params=True,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
        )
    if kind == "plain":
        return model
    raise ValueError(kind)


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def remote_arg(url: str | None, storage_options: dict | None, fast_retry: bool) -> Any:
    """``remote=`` for a shim: the URL, or with ``fast_retry`` a RemoteConfig that gives up on
    a transient error after 2 attempts 10-20 ms apart. For remotes that fail by design (a
    file:// URL under a regular file): the default policy spends about a minute backing off
    before the failure the test asserts on."""
    if url is None or not fast_retry:
        return url
    from dcp_tiered import RemoteConfig, RetryConfig

    retry = RetryConfig(max_attempts=2, initial_backoff_secs=0.01, max_backoff_secs=0.02)
    return RemoteConfig(url=url, storage_options=dict(storage_options or {}), retry=retry)


def finish() -> None:
    """Leave without interpreter teardown, where gloo sometimes aborts ("terminate called
    without an active exception", seen in dcp-cpu-findings) after all work is done."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def die_while_writing(step: str) -> None:
    """SIGKILL this process when its write of step ``step``'s data starts."""
    import signal

    from dcp_tiered.writer import _datafile  # writes each data file, looked up per call

    original = _datafile.write_file

    def write_or_die(save, *args, **kwargs):
        if save.step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(save, *args, **kwargs)

    _datafile.write_file = write_or_die
