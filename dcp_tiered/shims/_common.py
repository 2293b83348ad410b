"""What the framework adapters share beyond the public API and the lifecycle: the package's
process helpers they build on (collective agreement, node leaders, RNG state, torch-version
differences). tests/test_layering.py lets only this module import them, and no shim module
import the tiers, the backends or the policy modules: those come through
:mod:`dcp_tiered.lifecycle` (:mod:`~dcp_tiered.lifecycle.roots` for a checkpoint root)."""

from __future__ import annotations

from .._torch_compat import load_keys, upload_future
from ..agreement import Agreement
from ..distributed import is_node_leader
from ..rank_state import capture_rng, restore_rng

__all__ = [
    "Agreement",
    "capture_rng",
    "is_node_leader",
    "load_keys",
    "restore_rng",
    "upload_future",
]
