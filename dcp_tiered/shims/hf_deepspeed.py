"""The HF Trainer + DeepSpeed adapter's former path: it lives in :mod:`dcp_tiered.shims.hf.deepspeed`."""

from __future__ import annotations

from .hf.deepspeed import prepare_resume, rotate, wrap_deepspeed

__all__ = ["prepare_resume", "rotate", "wrap_deepspeed"]
