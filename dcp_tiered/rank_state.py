"""Per-rank state that a resume needs besides weights: RNG streams, data position, schedulers.

DCP de-duplicates items with the same key across ranks, keeping one rank's copy. Each rank's
values therefore live under its own key (``rank_<N>``), so every rank gets its own back.
Everything is stored as tensors and plain numbers, which load with ``weights_only=True``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful

from ._torch_compat import global_rank

logger = logging.getLogger(__name__)


def capture_rng() -> dict[str, Any]:
    """This process's python, numpy, torch (and CUDA, when present) random states."""
    version, py_state, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {
            "version": version,
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        saved = list(state["cuda"])
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
        else:
            logger.warning(
                "CUDA RNG states of %d devices saved, %d present: not restored",
                len(saved),
                torch.cuda.device_count(),
            )


class RankState(Stateful):
    """Saves and restores this rank's RNG states and any per-rank ``Stateful`` objects.

    Put it in the state dict next to the model::

        app_state = {"train": TrainState(model, opt),
                     "rank": RankState(dataloader=loader, lr_scheduler=sched)}

    Keyword arguments are objects with ``state_dict()``/``load_state_dict()`` (a
    ``StatefulDataLoader``, an LR scheduler, a sampler). Their values must be tensors, numbers,
    strings, lists or dicts of those.
    """

    def __init__(self, *, rng: bool = True, **objects: Any) -> None:
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"RankState({name}=...) needs state_dict() and load_state_dict()")
        self.rng = rng
        self.objects = objects
        self.restored = False

    @property
    def key(self) -> str:
        return f"rank_{global_rank()}"

    def state_dict(self) -> dict[str, Any]:
        mine: dict[str, Any] = {name: obj.state_dict() for name, obj in self.objects.items()}
        if self.rng:
            mine["rng"] = capture_rng()
        return {self.key: mine}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = state_dict[self.key]
        for name, obj in self.objects.items():
            obj.load_state_dict(mine[name])
        if self.rng:
            restore_rng(mine["rng"])
        self.restored = True
