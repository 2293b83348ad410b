"""``dcp-tiered convert deepspeed``'s former path: it lives in :mod:`dcp_tiered.shims.deepspeed.convert`."""

from __future__ import annotations

from .deepspeed.convert import UNIVERSAL_PARAM, convert

__all__ = ["UNIVERSAL_PARAM", "convert"]
