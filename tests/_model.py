"""A small deterministic model shared by the tests and their worker processes."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

DIM = 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Tiny(nn.Module):
    """A small language-model-shaped net (embedding, norm) for the DeepSpeed tests."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.l1 = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(24)
        self.l2 = nn.Linear(24, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.norm(torch.relu(self.l1(self.emb(x)))))


def build(seed: int, layers: int = 2) -> Net:
    torch.manual_seed(seed)
    return Net(layers)


def make_opt(model: nn.Module) -> torch.optim.Optimizer:
    """Create after sharding: FSDP replaces the parameters."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, DIM, generator=g)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    loss = model(batch(step)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


class AppState(Stateful):
    """Model + optimizer through get_state_dict/set_state_dict, plus plain values."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, extra: dict | None = None):
        self.model, self.opt = model, opt
        self.extra = extra if extra is not None else {"step": 0, "note": "hello", "lr": [0.1]}

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd, "extra": self.extra}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )
        self.extra = sd["extra"]


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Unsharded copies (cloned: full_state_dict may alias live tensors on CPU)."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return clone({"model": msd, "optim": osd})


def clone(obj: Any) -> Any:
    """A copy of every tensor in nested dicts, lists and tuples (namedtuples are kept)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(clone(v) for v in obj)
    return obj


def mismatches(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where two nested states differ (bit-exact for tensors)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if ok else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [m for k in a for m in mismatches(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: len"]
        return [m for i, (x, y) in enumerate(zip(a, b)) for m in mismatches(x, y, f"{path}[{i}]")]
    if hasattr(a, "__dict__") and type(a) is type(b):  # plain objects: by their attributes
        return mismatches(vars(a), vars(b), path)
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]
