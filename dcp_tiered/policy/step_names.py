"""How frameworks name their step directories, and the order of committed steps. Pure, no I/O.

A :class:`StepNames` is one exact grammar: ``parse`` accepts only what ``build`` produces, so a
directory is taken for a framework's step by its exact name, never by a name that merely looks
like one (``iter_7``, ``checkpoint-007``, ``step-3.bak`` are not). Whether a step is *ours* is
never decided from its name: that is its manifest's and the run record's
(:mod:`dcp_tiered.policy.identity`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_TRAILING_DIGITS = re.compile(r"(\d+)$")


@dataclass(frozen=True)
class StepNames:
    """Step ``n`` is the directory ``prefix`` followed by ``n`` in decimal, zero-padded to
    ``width`` digits (more digits when ``n`` needs them)."""

    prefix: str
    width: int = 1

    def build(self, n: int) -> str:
        """The name of step ``n`` (>= 0: no negative number parses back)."""
        return f"{self.prefix}{n:0{self.width}d}"

    def parse(self, name: str) -> int | None:
        """The step number ``name`` is the name of, or None if ``build`` never gives it."""
        digits = name[len(self.prefix) :] if name.startswith(self.prefix) else ""
        if not (digits.isascii() and digits.isdigit()):
            return None
        n = int(digits)
        return n if self.build(n) == name else None


STEP = StepNames("step-")  # CheckpointManager, torchtitan, peer replication
MEGATRON = StepNames("iter_", width=7)  # Megatron-LM's iter_%07d
HF = StepNames("checkpoint-")  # transformers.Trainer's checkpoint-N
DEEPSPEED = StepNames("global_step")  # DeepSpeed's default tag, global_stepN
KNOWN = (STEP, MEGATRON, HF, DEEPSPEED)


def order_number(name: str) -> int | None:
    """The training step a committed step's name stands for, for ordering and milestones only:
    its number in one of the :data:`KNOWN` grammars, else the trailing digits of a name the
    user chose (``epoch3-run20`` is 20), else None. A user's names are ordered as before the
    grammars existed, so retention keeps and deletes the same steps."""
    for names in KNOWN:
        if (n := names.parse(name)) is not None:
            return n
    m = _TRAILING_DIGITS.search(name)
    return int(m.group(1)) if m else None


def order_key(name: str, committed_at_ns: int) -> tuple[int, int, str]:
    """Oldest first: by :func:`order_number` (none: before every numbered step), then commit
    time, so that saving an old step again does not make it newer than a later step."""
    num = order_number(name)
    return (num if num is not None else -1, committed_at_ns, name)


def newest(steps: Iterable[tuple[str, int]]) -> str | None:
    """The newest of ``(step, committed_at_ns)`` pairs in :func:`order_key`'s order."""
    best = max((order_key(name, at) for name, at in steps), default=None)
    return best[2] if best else None


def is_newer(step: str, committed_at_ns: int, than: tuple[str, int] | None) -> bool:
    """Whether ``step`` comes after ``than`` (a ``(step, committed_at_ns)``) in :func:`newest`'s
    order, or is the same step name (committed again: its marker is the one that counts)."""
    if than is None or than[0] == step:
        return True
    return newest([than, (step, committed_at_ns)]) == step
