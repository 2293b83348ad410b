"""torchft through torchtitan: ``TorchFTCheckpointManager`` on the tiers.

torchft has no storage hook of its own: the durable checkpoint of a fault-tolerant job is the
full one the replica with ``participating_rank() == 0`` saves through torchtitan's
``TorchFTCheckpointManager``. :class:`TieredTorchFTCheckpointManager` puts
:class:`~dcp_tiered.shims.torchtitan.TieredCheckpointMixin` under it, selected with::

    --override.imports 'dcp_tiered.shims.torchtitan_ft.tiered_torchft_checkpoint={"remote": "s3://b/run"}'

Every full save and restore is dcp_tiered's (see :mod:`dcp_tiered.shims.torchtitan`). The
per-replica data-loader checkpoints torchft saves every step into ``folder/ft-replicat-N/``
(a side channel, not a step of the job) stay torchtitan's own, written and read as it does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal  # noqa: F401 - pdoc resolves the inherited Config annotations here

from .torchtitan import TieredCheckpointMixin, TierOptions  # torchtitan's ImportError

# isort: split
from torchtitan.config import override
from torchtitan.config.override import derive
from torchtitan.experiments.torchft.checkpoint import TorchFTCheckpointManager


class TieredTorchFTCheckpointManager(TieredCheckpointMixin, TorchFTCheckpointManager):
    """torchtitan's ``TorchFTCheckpointManager`` on the tiers."""

    @dataclass(kw_only=True, slots=True)
    class Config(TorchFTCheckpointManager.Config):
        tiers: TierOptions = field(default_factory=TierOptions)
        """dcp_tiered's options: the remote tier, trust, timeouts."""

    def _wait_for_saving(self) -> None:
        # torchft's data-loader saves are torchtitan's futures; the full save is ours.
        side = self.save_future
        if side is not None and side is not self._written:
            side.result()
        TieredCheckpointMixin._wait_for_saving(self)


@override(
    target=TorchFTCheckpointManager.Config,
    exact=True,
    description="dcp_tiered: torchft's durable checkpoints through the local and remote tiers",
)
def tiered_torchft_checkpoint(config: TorchFTCheckpointManager.Config, **tiers: Any) -> Any:
    """The override entry for torchft jobs (see the module's docs)."""
    return derive(config, TieredTorchFTCheckpointManager.Config, tiers=TierOptions(**tiers))


__all__ = ["TieredTorchFTCheckpointManager", "tiered_torchft_checkpoint"]
