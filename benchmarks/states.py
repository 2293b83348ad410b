"""State shapes for the peer benchmarks: few large tensors, and model-like states of many.

``model_like(n, nbytes)`` is a transformer's parameters with AdamW state, as a trainer's state
dict holds them: per parameter the tensor itself, ``exp_avg``, ``exp_avg_sq`` and a scalar
``step``. Sizes mix as in a real model: per layer a fused QKV and an output projection, two MLP
matrices (4x wider), their biases and two LayerNorms, plus an embedding; the width is solved so
that the whole state comes to about ``nbytes``. The same bytes in 10x the tensors is a model with
10x the layers, each narrower (the shape of FSDP/TP shards or of MoE experts per rank).
"""

from __future__ import annotations

import math

import torch

# per layer: (name, shape as a function of the width d)
_LAYER = [
    ("ln1.weight", lambda d: (d,)),
    ("ln1.bias", lambda d: (d,)),
    ("attn.qkv.weight", lambda d: (3 * d, d)),
    ("attn.qkv.bias", lambda d: (3 * d,)),
    ("attn.proj.weight", lambda d: (d, d)),
    ("attn.proj.bias", lambda d: (d,)),
    ("ln2.weight", lambda d: (d,)),
    ("ln2.bias", lambda d: (d,)),
    ("mlp.fc1.weight", lambda d: (4 * d, d)),
    ("mlp.fc1.bias", lambda d: (4 * d,)),
    ("mlp.fc2.weight", lambda d: (d, 4 * d)),
    ("mlp.fc2.bias", lambda d: (d,)),
]
_PER_PARAM = 4  # the parameter, exp_avg, exp_avg_sq, step


def large(count: int, tensor_bytes: int, seed: int = 0) -> dict:
    """``count`` fp32 tensors of ``tensor_bytes`` each (the suite's 32 x 32 MiB shape)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {f"t{i:03d}": torch.randn(tensor_bytes // 4, generator=gen) for i in range(count)}
    }


def model_like(n_tensors: int, nbytes: int, seed: int = 0) -> dict:
    """About ``nbytes`` of fp32 model + AdamW state in exactly ``n_tensors`` tensors."""
    layers = max(1, (n_tensors - 3 * _PER_PARAM) // (len(_LAYER) * _PER_PARAM))
    # parameters: 12 d^2 per layer, plus an embedding of 3 * layers * d rows (~20 %)
    params = nbytes / (3 * 4)  # param, exp_avg and exp_avg_sq are fp32 each
    d = max(8, round(math.sqrt(params / (15 * layers)) / 8) * 8)
    shapes = {"embed.weight": (3 * layers * d, d)}
    for i in range(layers):
        shapes.update({f"layers.{i}.{name}": shape(d) for name, shape in _LAYER})
    shapes.update({"norm.weight": (d,), "norm.bias": (d,)})
    gen = torch.Generator().manual_seed(seed)
    model, optim = {}, {}
    for name, shape in shapes.items():
        model[name] = torch.randn(shape, generator=gen)
        optim[f"{name}.exp_avg"] = torch.randn(shape, generator=gen)
        optim[f"{name}.exp_avg_sq"] = torch.rand(shape, generator=gen)
        optim[f"{name}.step"] = torch.tensor(100.0)
    # small buffers (rotary frequencies and the like) make the count exact
    for j in range(n_tensors - _PER_PARAM * len(shapes)):
        model[f"buffers.{j}.inv_freq"] = torch.rand(max(1, d // 2), generator=gen)
    return {"model": model, "optim": optim}


def tensors(state: dict) -> list[torch.Tensor]:
    return [t for part in state.values() for t in part.values()]


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(state))


def zeros_like(state: dict) -> dict:
    return {k: {n: torch.zeros_like(t) for n, t in part.items()} for k, part in state.items()}


def equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k][n], t) for k, part in b.items() for n, t in part.items())


def build(name: str, quick: bool) -> dict:
    """The named state; ``quick`` shrinks it (the smoke test): fewer bytes, fewer tensors."""
    if name == "large":
        return large(4, 2**20) if quick else large(32, 32 * 2**20)
    count = {"2k": 2000, "20k": 20000}[name]
    if quick:
        return model_like(count // 20, 4 * 2**20)
    return model_like(count, 256 * 2**20)


NAMES = {"large": "32 x 32 MiB", "2k": "2,000 tensors", "20k": "20,000 tensors"}
