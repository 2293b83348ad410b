"""Agreement across ranks: every vote, gather and broadcast of the checkpoint lifecycle.

The manager and the framework adapters decide together (did any rank fail? is every rank's
write done? which step do we all try?) through this one class. It runs on a gloo group of its
own (``distributed.agreement_group()``, one per process): never the training group, so an
NCCL-only default group works and a vote on the training thread never interleaves with
training collectives; never the group a background save runs its collectives on
(``checkpoint_process_group()``), so a vote cannot interleave with those either. Without a
default process group every method answers for this process alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .distributed import agreement_group, is_node_leader
from .errors import DcpTieredError, ForeignRunError, PeerLostError, PermanentTierError, describe

T = TypeVar("T")
# Errors raised as their own kind on the ranks where they did not happen (None: any other)
_KEPT: list[type[DcpTieredError] | None] = [PermanentTierError, ForeignRunError, None]


class Agreement:
    """Collective decisions; construct it on every rank, in the same order (the first one
    with a given timeout makes the process's agreement group; later ones share it, so a
    process that builds many managers does not accumulate gloo groups)."""

    def __init__(self, timeout_secs: float = 1800.0) -> None:
        self.group = agreement_group(timeout_secs)
        self.world_size = dist.get_world_size() if self.group is not None else 1

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """The process group's own error (gloo's RuntimeError: a peer closed the connection,
        a timeout) as PeerLostError, saying what it means and what to do."""
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, DcpTieredError):
                raise
            rank = dist.get_rank()
            raise PeerLostError(
                f"rank {rank}: dcp_tiered's {what} with the other rank(s) of {self.world_size} "
                f"failed ({str(e)[:500]}): another rank's process is gone (killed, crashed, "
                "its node lost) or cannot be reached, so this job can no longer checkpoint. "
                "Restart the job (torchrun --max-restarts, your scheduler): its restore "
                "takes the newest step every rank can still get."
            ) from e

    def vote(self, flags: list[int]) -> list[int]:
        """Each flag's maximum over all ranks."""
        if self.group is None or self.world_size == 1:  # a collective of one: 0.5 ms a save
            return flags
        t = torch.tensor(flags, dtype=torch.int64)
        with self._collective("vote"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    def any(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is true on some rank."""
        return bool(self.vote([int(flag)])[0])

    def all(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is true on every rank."""
        return not self.any(not flag)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (small, picklable values)."""
        if self.group is None or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._collective("exchange"):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if self.group is None:
            return obj
        box = [obj]
        with self._collective("broadcast"):
            dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def from_rank0(self, fn: Callable[[], T]) -> T:
        """``fn()`` run by rank 0 alone (one listing of a tier, not one per rank); its value on
        every rank, or what it raised raised on every rank (never rank 0 alone, which would
        leave the others waiting here): a DcpTieredError as itself, anything else described."""
        value: Any = None
        error: DcpTieredError | None = None
        if self.group is None or dist.get_rank() == 0:
            try:
                value = fn()
            except DcpTieredError as e:
                error = e
            except Exception as e:  # noqa: BLE001 - e.g. an OSError listing the local root
                error = DcpTieredError(f"on rank 0: {type(e).__name__}: {e}")
        value, error = self.broadcast((value, error))
        if error is not None:
            raise error
        return value

    def by_node_leaders(
        self, fn: Callable[[], T], what: str, error: type[DcpTieredError] = DcpTieredError
    ) -> T | None:
        """``fn()`` run by one process a node (node-wide files); its value there, None
        elsewhere. What it raised is raised on every rank: a node's own error as itself on that
        node, ``error`` naming it on the others (never one node alone, leaving the rest here)."""
        value: T | None = None
        mine: BaseException | None = None
        if is_node_leader():
            try:
                value = fn()
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                mine = e
        problems = [p for p in self.gather(None if mine is None else describe(mine)) if p]
        if mine is not None:
            raise mine
        if problems:
            raise error(f"{what} failed on another node: {'; '.join(problems)}")
        return value

    def everywhere(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` run by every rank; what it raised on any rank raised on every rank: its own
        error as itself on that rank, naming it on the others (a PermanentTierError or a
        ForeignRunError when it was one, so a misconfigured remote or another run's root reads
        the same everywhere)."""
        value: Any = None
        mine: BaseException | None = None
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            mine = e
        kind = None if mine is None else next((k for k in _KEPT if k and isinstance(mine, k)), None)
        problems = [
            p
            for p in self.gather(None if mine is None else (describe(mine), _KEPT.index(kind)))
            if p
        ]
        if mine is not None:
            raise mine
        if problems:
            # the most telling kind any rank had (a misconfigured remote reads the same
            # everywhere, and so does another run's root)
            error = _KEPT[min(k for _, k in problems)] or DcpTieredError
            raise error(f"{what} failed on another rank: {'; '.join(d for d, _ in problems)}")
        return value

    def barrier(self) -> None:
        if self.group is not None:
            with self._collective("barrier"):
                dist.barrier(group=self.group)
