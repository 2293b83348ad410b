"""Restoring from peer replication: which copies each rank holds, and loading a rank's snapshot
from its own memory or, failing that, from a partner that holds a verified copy.

:class:`ReplicaRestore` is a part of :class:`~dcp_tiered.tiers.replica.Replicator` (which
inherits it); the module docstring there tells the whole protocol."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..backends.local import LocalBackend
from ..errors import CheckpointNotFoundError, DcpTieredError, IntegrityError, describe
from ..policy import memory_format as fmt
from ..policy.replication import Survey
from .memory import MemoryTier
from .memory_restore import fill_state, verify

logger = logging.getLogger(__name__)

PREFIX = "replica-"  # replica-<R>/ in a memory root: the copies of rank R's snapshots
_FETCH = 10  # message tags of restore-time fetches (10, 11, 12)


def source_of(entry: str) -> int | None:
    """The rank whose copies memory-root entry ``entry`` holds; None if it holds none."""
    digits = entry[len(PREFIX) :] if entry.startswith(PREFIX) else ""
    return int(digits) if digits.isdigit() else None


def wait_all(works: list[Any]) -> None:
    """Wait for point-to-point sends and receives, in order."""
    for work in works:
        work.wait()


class ReplicaRestore:
    """The restore side of one rank's replication (a role of Replicator)."""

    memory: MemoryTier
    group: Any
    rank: int
    world: int
    nodes: list[str]
    sources: list[int]
    survey_: Survey | None
    _node_first: bool
    _sent_here: set[int]
    _emit: Callable[..., Any]

    if TYPE_CHECKING:  # Replicator's

        def store(self, source: int) -> MemoryTier: ...

        def drain(self, timeout_secs: float | None = None) -> bool: ...

    def survey(self) -> Survey:
        """Collective: every rank's own memory steps and the copies it holds, on every rank."""
        self.drain()
        held: dict[int, list[str]] = {}
        for entry in LocalBackend(self.memory.root).list_names():
            source = source_of(entry)
            if source is None:
                continue
            if source in self.sources or (self._node_first and source not in self._sent_here):
                held[source] = sorted(self.store(source).steps())
        reports: list[Any] = [None] * self.world
        dist.all_gather_object(reports, (sorted(self.memory.steps()), held), group=self.group)
        self.survey_ = Survey([r[0] for r in reports], [r[1] for r in reports], self.nodes)
        return self.survey_

    def load(self, name: str, app_state: dict[str, Any]) -> str | None:
        """Collective: load ``name`` into ``app_state`` from this rank's own memory or, failing
        that, from the partners holding a copy, nearest first; None, or why it failed."""
        assert self.survey_ is not None, "survey() first"
        problems: list[str] = []
        need = True
        try:
            self.memory.load(name, app_state)
            need = False
        except CheckpointNotFoundError:
            pass
        except (DcpTieredError, OSError) as e:
            problems.append(f"own memory: {describe(e)}")
        tried: set[int] = set()
        while True:
            holder = None
            if need:
                copies = self.survey_.copies(name, self.rank)
                holder = next((h for h in copies if isinstance(h, int) and h not in tried), None)
            plan: list[Any] = [None] * self.world
            dist.all_gather_object(plan, holder, group=self.group)
            if all(h is None for h in plan):
                break
            sends = [s for r, h in enumerate(plan) if h == self.rank for s in self._serve(name, r)]
            if holder is not None:
                why = self._fetch(name, holder, app_state)
                tried.add(holder)
                if why is None:
                    need = False
                    self._emit("restored_from_partner", step=name, rank=self.rank, holder=holder)
                else:
                    problems.append(why)
                    logger.warning("rank %d cannot use a copy of %s: %s", self.rank, name, why)
            wait_all(sends)
        if not need:
            return None
        return f"rank {self.rank}: " + ("; ".join(problems) or f"no copy of {name} anywhere")

    def _serve(self, name: str, rank: int) -> list[Any]:
        raw = self.store(rank).raw(name)
        header, data = raw if raw is not None else (b"", torch.empty(0, dtype=torch.uint8))
        meta = torch.tensor([len(header), data.numel()], dtype=torch.int64)
        works = [dist.isend(meta, rank, group=self.group, tag=_FETCH)]
        if header:
            header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8)
            works.append(dist.isend(header_t, rank, group=self.group, tag=_FETCH + 1))
            works.append(dist.isend(data, rank, group=self.group, tag=_FETCH + 2))
        return works

    def _fetch(self, name: str, holder: int, app_state: dict[str, Any]) -> str | None:
        where = f"copy of rank {self.rank}'s {name} on rank {holder} (node {self.nodes[holder]})"
        meta = torch.zeros(2, dtype=torch.int64)
        dist.recv(meta, holder, group=self.group, tag=_FETCH)
        length, size = (int(v) for v in meta.tolist())
        if not length:
            return f"{where}: gone since the survey"
        header_t = torch.empty(length, dtype=torch.uint8)
        dist.recv(header_t, holder, group=self.group, tag=_FETCH + 1)
        data = torch.empty(size, dtype=torch.uint8)
        dist.recv(data, holder, group=self.group, tag=_FETCH + 2)
        try:
            header = fmt.decode_header(header_t.numpy().tobytes(), where=where)
            if header.rank != self.rank or header.step != name:
                raise IntegrityError(f"{where}: it is rank {header.rank}'s {header.step}")
            verify(header, data, where)
            fill_state(header, data, app_state, where, allow_pickle=self.memory.allow_pickle)
        except DcpTieredError as e:
            return describe(e)
        return None

    def where(self) -> dict[str, dict[int, list[str | int]]]:
        """Per step of the last survey: rank -> where its copies are ("own", holder ranks)."""
        survey = self.survey_
        if survey is None:
            return {}
        return {s: {r: survey.copies(s, r) for r in range(self.world)} for s in survey.steps()}
