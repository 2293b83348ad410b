"""Admission control: may a save start now, and does it fit? Pure, no I/O."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

_MIB = 2**20


@dataclass(frozen=True)
class Admission:
    """What a checkpoint manager does when a save cannot start or cannot fit.

    Args:
        max_in_flight: disk saves staged but not yet committed, per rank. Two staging buffer
            sets alternate, so more than 2 in flight would wait for buffers anyway. (Memory
            snapshots are not counted: each waits only for the previous one's checksums.)
        when_busy: at the cap, ``"block"`` waits for the oldest save (the wait counts as the
            caller's stall) and ``"skip"`` skips this save with a WARNING.
        when_full: if the save would not fit in host memory or on the tier's filesystem,
            ``"skip"`` skips it with a WARNING and ``"raise"`` raises InsufficientSpaceError.
            Either way nothing is written, so no tier is left half-written.
        memory_margin_bytes: host RAM that must stay available beyond staging and the memory tier.
        disk_margin_bytes: free space that must stay on the local disk beyond the save.
    """

    max_in_flight: int = 2
    when_busy: str = "block"
    when_full: str = "skip"
    memory_margin_bytes: int = 512 * _MIB
    disk_margin_bytes: int = 64 * _MIB

    def __post_init__(self) -> None:
        if not 1 <= self.max_in_flight <= 2:
            raise ConfigError(f"max_in_flight must be 1 or 2, got {self.max_in_flight}")
        if self.when_busy not in ("block", "skip"):
            raise ConfigError(f"when_busy must be 'block' or 'skip', got {self.when_busy!r}")
        if self.when_full not in ("skip", "raise"):
            raise ConfigError(f"when_full must be 'skip' or 'raise', got {self.when_full!r}")
        if self.memory_margin_bytes < 0 or self.disk_margin_bytes < 0:
            raise ConfigError("margins must be >= 0")


@dataclass(frozen=True)
class Headroom:
    """What one rank measured just before staging."""

    ranks_on_node: int  # ranks writing to the same filesystems
    new_tier_bytes: int  # this rank's bytes the tier must newly hold (0: reused slots)
    new_ram_bytes: int  # host RAM this rank's save will newly take (buffers, tmpfs slots)
    ram_available: int | None  # None: unknown (not Linux)
    tier_free: int  # free bytes on the target tier's filesystem


def shortfall(adm: Admission, h: Headroom, tier: str) -> str | None:
    """Why a save to ``tier`` ("memory" or "local") does not fit, or None if it does."""
    need = h.new_tier_bytes * h.ranks_on_node
    margin = adm.memory_margin_bytes if tier == "memory" else adm.disk_margin_bytes
    if need and h.tier_free < need + margin:
        return (
            f"the {tier} tier has {h.tier_free / _MIB:.0f} MiB free; this node's save needs "
            f"{need / _MIB:.0f} MiB more plus a {margin / _MIB:.0f} MiB margin"
        )
    ram = h.new_ram_bytes * h.ranks_on_node
    if h.ram_available is not None and ram and h.ram_available < ram + adm.memory_margin_bytes:
        what = "the memory tier's slots" if tier == "memory" else "staging buffers"
        return (
            f"host RAM has {h.ram_available / _MIB:.0f} MiB available; {what} need "
            f"{ram / _MIB:.0f} MiB more plus a {adm.memory_margin_bytes / _MIB:.0f} MiB margin"
        )
    return None
