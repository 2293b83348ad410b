"""Peer replication: each rank's newest memory snapshot copied to partner nodes' host memory,
so a node lost before its upload loses nothing.

After each memory snapshot a background thread sends it (header and data, straight from the
snapshot's shared-memory slot) to the same-index rank on each partner node
(:mod:`dcp_tiered.policy.replication`), over a gloo group of its own. The partner keeps it in
its own memory root as ``replica-<R>/``: the memory tier's format and code, two slots, header
last, each tensor checked against its CRC32C before the header is written. A slot being sent
is leased: the next snapshot overwrites the other slot instead of waiting, so the training
step never waits for the network.

Rounds are collective on the replication group: the ranks agree on the step (the oldest of
each rank's newest offer), then exchange. A snapshot is replicated only if nothing newer was
offered meanwhile; a slow network replicates fewer steps, never queues them.

At a restore every rank reports what it holds (:meth:`Replicator.survey`); a step is a memory
candidate when every rank can get it from its own memory or from a partner. A rank without
its own copy fetches it from a holder, verifies it and loads it; a copy that fails
verification moves it to the next holder, then the ranks to an older step.

DCP's experimental ``staging._ReplicationStager`` (and its ``_pg_transport.PGTransport``) is
not used: it stages synchronously inside ``async_save``, pairs rank r with r + world/2 with no
regard for nodes, persists the received copy with ``torch.save`` (so a restore must unpickle
it) without checksums, sends metadata pickled and every tensor as its own message, and has no
restore path. The memory tier's snapshot already is one flat, checksummed buffer with a JSON
header: one message each.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from .._priority import lower_this_thread
from ..backends.local import LocalBackend
from ..distributed import replication_group
from ..errors import ConfigError, DcpTieredError, IntegrityError, describe
from ..policy.replication import Replication, Survey, node_of, rank_partners, sources
from ..policy.step_names import STEP
from .memory import MemoryTier
from .replica_restore import PREFIX, ReplicaRestore, source_of, wait_all

logger = logging.getLogger(__name__)

# Message tags: background rounds and restore-time fetches (replica_restore._FETCH) never share
# one.
_META, _HEADER, _DATA = 1, 2, 3


def _directory(rank: int) -> str:
    return f"{PREFIX}{rank}"


class Replicator(ReplicaRestore):
    """The replication of one rank's memory tier; construct on every rank, in the same order."""

    def __init__(
        self,
        memory: MemoryTier,
        config: Replication,
        *,
        timeout_secs: float,
        emit: Callable[..., Any] = lambda *a, **k: None,
    ) -> None:
        self.group = replication_group(timeout_secs)
        if self.group is None:
            raise ConfigError(
                "peer replication needs torch.distributed initialised on several nodes"
            )
        self.memory, self.config, self._emit = memory, config, emit
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        node = node_of(dict(os.environ), config.node_key, socket.gethostname())
        self.nodes: list[str] = [""] * self.world
        dist.all_gather_object(self.nodes, node, group=self.group)
        partners = rank_partners(self.nodes, config.factor, config.grouping)  # same everywhere
        self.partners = partners[self.rank]
        self.sources = sources(partners)[self.rank]
        # Ranks of a node share its memory root: each copy there is reported (and served) by
        # the rank it is sent to, a copy no rank is sent to any more by the node's first rank.
        self._node_first = self.rank == min(
            r for r in range(self.world) if self.nodes[r] == self.nodes[self.rank]
        )
        self._sent_here = {
            s
            for s in range(self.world)
            for d in partners[s]
            if self.nodes[d] == self.nodes[self.rank]
        }
        self._stores: dict[int, MemoryTier] = {}
        self._cv = threading.Condition()
        self._offered: tuple[int, str, Future[Any]] | None = None
        self._names: dict[int, str] = {}
        self.replicated = -1  # the step number of the last round
        self.error: BaseException | None = None
        self._closing = False
        self.survey_: Survey | None = None
        self._thread = threading.Thread(
            target=self._run, name="dcp-tiered-replication", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"Replicator(rank {self.rank} on {self.nodes[self.rank]} -> {self.partners})"

    def describe_partners(self) -> str:
        """Who this rank's snapshots go to and come from, and whether replication stopped
        (for the error a lost partner causes)."""
        ranks = sorted(set(self.partners) | set(self.sources))
        where = ", ".join(f"rank {r} on node {self.nodes[r]}" for r in ranks) or "none"
        stopped = (
            f"Peer replication had stopped: {describe(self.error)}."
            if self.error is not None
            else "Peer replication was still running."
        )
        return (
            f"With peer replication, rank {self.rank} (node {self.nodes[self.rank]}) sends its "
            f"snapshots to, and keeps copies of, {where}. {stopped} A restarted job restores "
            "a lost node's ranks from their partners' copies (or from disk and remote)."
        )

    def store(self, source: int) -> MemoryTier:
        """Where this rank keeps rank ``source``'s copies."""
        if source not in self._stores:
            self._stores[source] = MemoryTier(
                self.memory.root,
                source,
                allow_pickle=self.memory.allow_pickle,
                directory=_directory(source),
                run_id=self.memory.run_id,
                world_size=self.memory.world_size,
            )
        return self._stores[source]

    # ------------------------------------------------------------ background rounds

    def offer(self, number: int, name: str, committed: Future[Any]) -> None:
        """A memory snapshot was taken (its commit may still run): replicate it when free."""
        with self._cv:
            self._offered = (number, name, committed)
            self._names = {n: s for n, s in self._names.items() if n > number - 8}
            self._names[number] = name
            self._cv.notify_all()

    def drain(self, timeout_secs: float | None = None) -> bool:
        """Wait until the newest offer is replicated (or replication stopped); False on
        timeout. Every rank offers the same steps, so every rank ends after the same rounds."""
        deadline = None if timeout_secs is None else time.monotonic() + timeout_secs
        with self._cv:
            while self.error is None and self._pending():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout_secs: float | None = None) -> None:
        self.drain(timeout_secs)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout=1.0)
        for store in self._stores.values():
            store.close()

    def _pending(self) -> bool:
        return self._offered is not None and self._offered[0] > self.replicated

    def _run(self) -> None:
        lower_this_thread()  # training keeps priority over the copies
        last = -float("inf")
        while True:
            with self._cv:
                while not self._closing and not self._pending():
                    self._cv.wait()
                # At most one round per min_interval_secs (every rank waits alike).
                while (
                    not self._closing
                    and (left := last + self.config.min_interval_secs - time.monotonic()) > 0
                ):
                    self._cv.wait(left)
                last = time.monotonic()
                if not self._pending():
                    return
                assert self._offered is not None
                number, _, committed = self._offered
            try:
                self._round(number, committed)
            except Exception as e:  # noqa: BLE001 - a partner gone, a timeout: stop, say so
                logger.error(
                    "peer replication stopped on rank %d (its partners %s): %s. Memory "
                    "snapshots, disk and remote saves go on; a node lost from now on loses "
                    "the steps not yet on disk or remote.",
                    self.rank,
                    self.partners,
                    describe(e),
                )
                self._emit("replication_stopped", rank=self.rank, error=describe(e))
                with self._cv:
                    self.error = e
                    self._cv.notify_all()
                return

    def _round(self, number: int, committed: Future[Any]) -> None:
        started = time.perf_counter()
        agreed = torch.tensor([number], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        step_number = int(agreed.item())
        name = self._names.get(step_number, STEP.build(step_number))
        if step_number == number:
            with contextlib.suppress(Exception):  # the save reports it; nothing to send
                committed.result()
        lease = self.memory.lease(name)
        try:
            header, data = lease if lease is not None else (b"", torch.empty(0, dtype=torch.uint8))
            sent = self._exchange(name, header, data, _META)
        finally:
            self.memory.release()
        with self._cv:
            self.replicated = step_number
            self._cv.notify_all()
        if sent:
            self._emit(
                "replicated",
                step=step_number,
                rank=self.rank,
                node=self.nodes[self.rank],
                partners=self.partners,
                partner_nodes=[self.nodes[p] for p in self.partners],
                bytes=data.numel(),
                secs=round(time.perf_counter() - started, 6),
            )

    def _exchange(self, name: str, header: bytes, data: torch.Tensor, tag: int) -> bool:
        """Send this rank's snapshot to its partners, keep each source's copy of it."""
        meta = torch.tensor([len(header), data.numel()], dtype=torch.int64)
        incoming = {s: torch.zeros(2, dtype=torch.int64) for s in self.sources}
        wait_all(
            [dist.isend(meta, p, group=self.group, tag=tag) for p in self.partners]
            + [dist.irecv(m, s, group=self.group, tag=tag) for s, m in incoming.items()]
        )
        sends = []
        if header:
            header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8)
            for p in self.partners:
                sends.append(dist.isend(header_t, p, group=self.group, tag=tag + 1))
                sends.append(dist.isend(data, p, group=self.group, tag=tag + 2))
        for source, m in incoming.items():
            length, size = (int(v) for v in m.tolist())
            if length:
                self._keep(source, name, length, size, tag)
        wait_all(sends)
        return bool(header)

    def _keep(self, source: int, name: str, length: int, size: int, tag: int) -> None:
        header_t = torch.empty(length, dtype=torch.uint8)
        dist.recv(header_t, source, group=self.group, tag=tag + 1)
        received = False

        def fill(buffer: torch.Tensor) -> None:
            nonlocal received
            if buffer.numel() != size:
                raise IntegrityError(f"{size} bytes sent for a {buffer.numel()}-byte snapshot")
            dist.recv(buffer, source, group=self.group, tag=tag + 2)
            received = True

        try:
            self.store(source).receive(header_t.numpy().tobytes(), fill, step=name)
        except (DcpTieredError, OSError) as e:
            if not received:  # the sender waits for its data to be taken
                dist.recv(
                    torch.empty(size, dtype=torch.uint8), source, group=self.group, tag=tag + 2
                )
            logger.warning(
                "rejected rank %d's copy of %s (node %s): %s; its previous copy is kept",
                source,
                name,
                self.nodes[source],
                describe(e),
            )
            self._emit(
                "replica_rejected", step=name, rank=self.rank, source=source, error=describe(e)
            )


def list_copies(root: str | os.PathLike[str]) -> dict[str, list[int]]:
    """Step name -> ranks whose copies of it this memory root holds (for other nodes)."""
    found: dict[str, list[int]] = {}
    for entry in LocalBackend(root).list_names():
        if (source := source_of(entry)) is not None:
            copies = MemoryTier(root, source, directory=entry)
            for step in copies.steps():
                found.setdefault(step, []).append(source)
            copies.close()
    return {step: sorted(ranks) for step, ranks in found.items()}
