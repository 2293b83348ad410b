"""When an entry point that takes its own save calls is due to save, by the manager's rule
(:func:`dcp_tiered.policy.cadence.decide`): the Megatron facade's memory and storage
intervals are a :class:`~dcp_tiered.SavePolicy` like the manager's."""

from __future__ import annotations

import time

from ..policy.cadence import Decision, SavePolicy, decide

__all__ = ["Cadence"]


class Cadence:
    """``policy`` applied step by step, remembering when each tier last saved (for
    ``Every(secs=...)``). A step due on disk is not also saved to memory."""

    def __init__(self, policy: SavePolicy, *, has_memory: bool, has_remote: bool) -> None:
        self.policy = policy
        self.has_memory, self.has_remote = has_memory, has_remote
        self._last = dict.fromkeys(("memory", "local", "remote"), time.time())

    def due(self, step: int) -> Decision:
        """The tiers due at ``step``; they count as saved now."""
        now = time.time()
        decision = decide(
            self.policy,
            step,
            now,
            self._last,
            has_memory=self.has_memory,
            has_remote=self.has_remote,
        )
        for tier in ("memory", "local", "remote"):
            if getattr(decision, tier):
                self._last[tier] = now
        return decision
