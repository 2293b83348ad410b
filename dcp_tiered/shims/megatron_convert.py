"""``dcp-tiered convert megatron``'s former path: it lives in :mod:`dcp_tiered.shims.megatron.convert`."""

from __future__ import annotations

from .megatron.convert import FILE_NAME, TRACKER, convert

__all__ = ["FILE_NAME", "TRACKER", "convert"]
