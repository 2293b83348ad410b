"""When each tier is due for a save: cadence by steps or by seconds. Pure, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError


@dataclass(frozen=True)
class Every:
    """Due every ``steps`` steps (``step % steps == 0``) and/or every ``secs`` seconds since
    the tier's last save; with both, whichever comes first."""

    steps: int | None = None
    secs: float | None = None

    def __post_init__(self) -> None:
        if self.steps is None and self.secs is None:
            raise ConfigError("Every() needs steps= or secs= (or both)")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"Every(steps=) must be >= 1, got {self.steps}")
        if self.secs is not None and self.secs <= 0:
            raise ConfigError(f"Every(secs=) must be > 0, got {self.secs}")

    def due(self, step: int, now: float, last: float) -> bool:
        by_steps = self.steps is not None and step % self.steps == 0
        by_time = self.secs is not None and now - last >= self.secs
        return by_steps or by_time


@dataclass(frozen=True)
class SavePolicy:
    """Cadence per tier; None switches a tier's periodic saves off.

    The default is the hierarchy of PAI EasyCkpt: host memory every step, the local disk
    every 10 steps, the remote tier every 50 steps. A remote save goes through the local
    tier (that is where it is copied from), so a step due remotely is also saved locally.
    """

    memory: Every | None = field(default_factory=lambda: Every(steps=1))
    local: Every | None = field(default_factory=lambda: Every(steps=10))
    remote: Every | None = field(default_factory=lambda: Every(steps=50))


@dataclass(frozen=True)
class Decision:
    """Where one save goes: nowhere, host memory, or the local disk (and maybe remote)."""

    memory: bool = False
    local: bool = False
    remote: bool = False

    @property
    def any(self) -> bool:
        return self.memory or self.local


def decide(
    policy: SavePolicy,
    step: int,
    now: float,
    last: dict[str, float],
    *,
    force: bool = False,
    has_memory: bool = True,
    has_remote: bool = True,
) -> Decision:
    """The tiers due at ``step``. ``last`` maps a tier to the time of its last save.

    A step written to disk is not also written to memory: restore takes the newest step of
    any tier, so one copy per step is enough. ``force`` saves to disk (and remote) now.
    """

    def due(tier: str, every: Every | None) -> bool:
        return every is not None and every.due(step, now, last.get(tier, 0.0))

    remote = has_remote and (force or due("remote", policy.remote))
    local = force or remote or due("local", policy.local)
    memory = has_memory and not local and due("memory", policy.memory)
    return Decision(memory=memory, local=local, remote=remote)


def encode(d: Decision) -> list[int]:
    """A decision as flags, so ranks can agree on it with one MAX all-reduce."""
    return [int(d.memory), int(d.local), int(d.remote)]


def agree(flags: list[int]) -> Decision:
    """The decision all ranks take once any rank found a tier due (clocks differ)."""
    local = bool(flags[1] or flags[2])
    return Decision(memory=bool(flags[0]) and not local, local=local, remote=bool(flags[2]))
