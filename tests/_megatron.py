"""megatron-core on a CPU-only machine, for the tests and the example.

Test-only patches live here and nowhere else. megatron-core 0.16.1 assumes CUDA in three places
on the GPT forward path (none on dcp_tiered's save and load path):

- ``transformer/utils.py`` builds the attention mask with ``device=torch.cuda.current_device()``;
- attention dropout runs under ``get_cuda_rng_tracker().fork()``, which needs a CUDA RNG state;
- ``torch.cuda.synchronize()`` is called by timers and by the stock async writer.

Megatron's own optimizers hard-code ``device='cuda'`` (``FP32Optimizer._scale``), so
:class:`TorchAdam` stands in: torch Adam behind Megatron's optimizer interface, sharded with
mcore's own helpers (the recipe of ``FP32Optimizer.sharded_state_dict``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from typing import Any

import torch
from packaging.version import Version

# megatron-core < 0.19 writes common.pt into the step directory before the sharded save; 0.19
# keeps the common state inside the DCP checkpoint.
MCORE = Version(importlib.metadata.version("megatron-core"))
WRITES_COMMON_PT = MCORE < Version("0.19")

_patched = False


def patch_cuda_for_cpu() -> None:
    """Make the GPT forward run without CUDA (test-only; idempotent)."""
    global _patched
    if _patched or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    _patched = True


def init_parallel(tp: int = 1) -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def tiny_gpt(seed: int) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=16)


class TorchAdam:
    """torch Adam with the parts of Megatron's optimizer interface checkpointing uses."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-2) -> None:
        self.model = model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def get_parameters(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def sharded_state_dict(
        self, model_sharded_state_dict: dict[str, Any], is_loading: bool = False, **_: Any
    ) -> dict[str, Any]:
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        if is_loading and not self.optimizer.state:
            self._init_state()
        # state_dict() aliases the live per-param dicts: copy before editing.
        state = self.optimizer.state_dict()
        state = {
            "state": {i: dict(s) for i, s in state["state"].items()},
            "param_groups": [dict(g) for g in state["param_groups"]],
        }
        steps = {i: s.pop("step") for i, s in state["state"].items() if "step" in s}
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.get_parameters())
        optim_state_to_sharding_state(state, id_map)
        if steps:
            state["state"]["common_step"] = next(iter(steps.values()))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step = state["state"].pop("common_step", None)
        if step is not None:
            for s in state["state"].values():
                s["step"] = torch.as_tensor(step, dtype=torch.float32).clone()
        self.optimizer.load_state_dict(state)

    def _init_state(self) -> None:
        for p in self.get_parameters():
            self.optimizer.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, 128, (2, 16), generator=gen)
    labels = torch.randint(0, 128, (2, 16), generator=gen)
    position_ids = torch.arange(16).unsqueeze(0).expand(2, -1)
    return tokens, position_ids, labels


# True above the diagonal = masked. Passed explicitly: the default one is built on CUDA.
CAUSAL_MASK = torch.triu(torch.ones(1, 1, 16, 16), diagonal=1).bool()


def train_step(
    model: torch.nn.Module, opt: TorchAdam, step: int, rank: int, *, average: bool = True
) -> float:
    """One step; gradients are averaged over data-parallel ranks so every replica agrees
    (``average=False`` where every rank is a tensor-parallel rank: no data-parallel ones)."""
    import torch.distributed as dist

    tokens, position_ids, labels = batch(step, rank if average else 0)
    opt.zero_grad()
    loss = model(tokens, position_ids, CAUSAL_MASK, labels=labels).float().mean()
    loss.backward()
    if average and dist.is_initialized() and dist.get_world_size() > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
    opt.step()
    return float(loss.detach())
