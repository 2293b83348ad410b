"""Peer replication's arithmetic: which node keeps copies of which node's memory snapshots, and
which steps every rank can get whole at a restore. Pure: no I/O.

A node's newest memory snapshot survives the node only if another node holds a copy, so copies
never go to the node itself. Ranks are mapped by their index on the node: the i-th rank of node
A sends to the i-th rank of each partner node (nodes run the same number of ranks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from . import step_names

GROUPINGS = ("ring", "pairs")
# Where launchers name a process's node: torchrun, then generic launchers, then SLURM.
NODE_ENV = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")


@dataclass(frozen=True, kw_only=True)
class Replication:
    """Copies of each node's newest memory snapshot on other nodes' host memory.

    Args:
        factor: how many other nodes keep a copy of each node's snapshot (1: survives the loss
            of any one node; losing a node together with its partner loses the steps only
            they held, and the restore falls back to disk or the remote tier).
        grouping: ``"ring"``: node k's copies go to the next ``factor`` nodes (in node-id
            order, wrapping around); ``"pairs"``: nodes form groups of ``factor + 1`` that
            hold each other's copies (an odd node out joins the last group, as a ring), so
            two failures in different groups lose nothing.
        node_key: the environment variable naming this process's node. Default: the first of
            ``GROUP_RANK`` (torchrun), ``NODE_RANK``, ``SLURM_NODEID`` that is set, else the
            host name.
        min_interval_secs: start a round at most this often (0: as soon as the previous one
            ends and a newer snapshot exists). Bounds the CPU and network the copies take, at
            the cost of older copies: a node lost loses the steps since the last round.
    """

    factor: int = 1
    grouping: str = "ring"
    node_key: str | None = None
    min_interval_secs: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.factor, int) or self.factor < 1:
            raise ConfigError(f"Replication(factor={self.factor!r}): factor must be an int >= 1")
        if not self.min_interval_secs >= 0:
            raise ConfigError("Replication(min_interval_secs=...) must be >= 0")
        if self.grouping not in GROUPINGS:
            raise ConfigError(
                f"Replication(grouping={self.grouping!r}): grouping must be one of {GROUPINGS}"
            )


def node_of(env: dict[str, str], key: str | None, hostname: str) -> str:
    """This process's node id, from the launcher's environment ``env``."""
    if key is not None:
        if not env.get(key):
            raise ConfigError(
                f"Replication(node_key={key!r}) but ${key} is not set in this process: set it "
                "to the node's id on every node, or leave node_key unset"
            )
        return env[key]
    return next((env[k] for k in NODE_ENV if env.get(k)), hostname)


def _natural(node: str) -> tuple[Any, ...]:
    """Sort key: "node-10" after "node-9"."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", node))


def node_partners(nodes: list[str], factor: int, grouping: str) -> dict[str, list[str]]:
    """Node -> the nodes that keep copies of its snapshots (never itself)."""
    order = sorted(set(nodes), key=_natural)
    if factor > len(order) - 1:
        raise ConfigError(
            f"Replication(factor={factor}) needs at least {factor + 1} nodes, and this job runs "
            f"on {len(order)} ({', '.join(order)}): copies must be on other nodes. Lower the "
            "factor, turn replication off, or check the node key (every process of a node "
            "must report the same id, and different nodes different ones)"
        )
    if grouping == "ring":
        groups = [order]
    else:
        size = factor + 1
        groups = [order[i : i + size] for i in range(0, len(order), size)]
        if len(groups) > 1 and len(groups[-1]) < size:  # the odd nodes out join the last group
            groups[-2:] = [groups[-2] + groups[-1]]
    return {
        node: [group[(i + j) % len(group)] for j in range(1, factor + 1)]
        for group in groups
        for i, node in enumerate(group)
    }


def rank_partners(rank_nodes: list[str], factor: int, grouping: str) -> dict[int, list[int]]:
    """Rank -> the ranks that keep copies of its snapshots; ``rank_nodes[r]`` is rank r's node."""
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(rank_nodes):
        by_node.setdefault(node, []).append(rank)
    sizes = {node: len(ranks) for node, ranks in by_node.items()}
    if len(set(sizes.values())) > 1:
        raise ConfigError(
            f"peer replication needs the same number of ranks on every node, got {sizes}"
        )
    partners = node_partners(rank_nodes, factor, grouping)
    return {
        rank: [by_node[p][i] for p in partners[node]]
        for node, ranks in by_node.items()
        for i, rank in enumerate(ranks)
    }


def sources(partners: dict[int, list[int]]) -> dict[int, list[int]]:
    """Rank -> the ranks whose copies it keeps (the inverse of :func:`rank_partners`)."""
    out: dict[int, list[int]] = {r: [] for r in partners}
    for src, dsts in partners.items():
        for dst in dsts:
            out[dst].append(src)
    return out


@dataclass(frozen=True)
class Survey:
    """Which memory copies exist, as every rank reported them at a restore.

    ``own[r]``: steps in rank r's own memory; ``held[h][r]``: steps of rank r's snapshots that
    rank h holds as replicas; ``nodes[r]``: rank r's node.
    """

    own: list[list[str]]
    held: list[dict[int, list[str]]]
    nodes: list[str]

    def copies(self, step: str, rank: int) -> list[str | int]:
        """Where rank ``rank`` can get ``step`` from, nearest first: "own", then the ranks
        holding a copy."""
        out: list[str | int] = ["own"] if step in self.own[rank] else []
        return out + [h for h in range(len(self.held)) if step in self.held[h].get(rank, [])]

    def steps(self) -> list[str]:
        """Every step with a copy anywhere, newest first."""
        world = len(self.own)  # copies of ranks this job no longer has do not count
        names = {s for own in self.own for s in own} | {
            s for held in self.held for r, steps in held.items() if r < world for s in steps
        }
        return sorted(
            (n for n in names if step_names.order_number(n) is not None),
            key=lambda n: -(step_names.order_number(n) or 0),
        )

    def missing(self, step: str) -> list[int]:
        """Ranks with no copy of ``step``."""
        return [r for r in range(len(self.own)) if not self.copies(step, r)]

    def whole(self) -> list[str]:
        """Steps every rank can get from memory (its own or a replica), newest first."""
        return [s for s in self.steps() if not self.missing(s)]

    def lost(self, newer_than: int) -> dict[str, list[int]]:
        """Steps newer than ``newer_than`` that some rank cannot get: step -> those ranks."""
        return {
            s: miss
            for s in self.steps()
            if (step_names.order_number(s) or -1) > newer_than and (miss := self.missing(s))
        }


def describe_lost(survey: Survey, lost: dict[str, list[int]], restored: str | None) -> str:
    """A warning's text: which steps were lost, whose shards were missing, and where their
    copies should have been."""
    missing = sorted({r for ranks in lost.values() for r in ranks})
    nodes = sorted({survey.nodes[r] for r in missing}, key=_natural)
    numbers = sorted(step_names.order_number(s) or 0 for s in lost)
    return (
        f"step(s) {', '.join(map(str, numbers))} were lost: rank(s) "
        f"{', '.join(map(str, missing))} (node(s) {', '.join(nodes)}) have no copy of them, "
        "neither in their own memory nor on a partner node (the node and its partner(s) were "
        "lost together, or replication had not reached them); "
        + (f"restoring {restored} instead" if restored else "no older step exists")
    )
