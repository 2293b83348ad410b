"""``dist_checkpointing.load`` through the tiers, at its former path: it lives in
:mod:`dcp_tiered.shims.megatron.load`."""

from __future__ import annotations

from .megatron.load import load

__all__ = ["load"]
