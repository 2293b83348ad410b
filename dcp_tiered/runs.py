"""The run a job joins at its start, agreed by every rank (see :mod:`dcp_tiered.policy.identity`).

Each rank reports what its node's local root and memory directory record; rank 0 adds what the
remote prefix records and decides: ``run_id=`` or the one run the roots and the prefix agree
on, else a new one. Memory directories never name the run (a new run must not resume from a
memory snapshot left by another), but one recording another run than the decided one refuses
the start. Then every rank records the run where it has none, and rank 0 at the prefix.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from .agreement import Agreement
from .backends.local import LocalBackend
from .backends.remote import RemoteBackend
from .errors import ForeignRunError, InsufficientSpaceError, NotWritableError
from .policy import identity
from .tiers import memory_slots, ownership
from .tiers.root import Tiers
from .writer import TieredStorageWriter

logger = logging.getLogger(__name__)


def join(
    agree: Agreement,
    tiers: Tiers,
    writer: TieredStorageWriter,
    memory: str | os.PathLike[str] | None,
    what: str,
) -> str:
    """Collective: the run every rank joins; recorded in each root (``tiers``, which
    ``writer`` writes on), ``memory`` and the remote prefix. ForeignRunError on every rank when
    they name different runs."""
    host = socket.gethostname()
    memory_backend = LocalBackend(memory) if memory is not None else None

    def recorded() -> dict[str, dict[str, str | None]]:
        local = tiers.local.record()
        out: dict[str, dict[str, str | None]] = {
            "roots": {f"{host}:{writer.root}": local.run_id if local else None},
            "memory": {},
        }
        if memory_backend is not None:
            mem = ownership.read_local(memory_backend)
            # without a record (lost, or removed by hand), the snapshots say whose they are
            runs = {mem.run_id} if mem else memory_slots.header_runs(memory_backend.root)
            out["memory"][f"{host}:{memory_backend.root}"] = min(runs) if runs else None
        return out

    mine = agree.everywhere(recorded, what)
    everyone = agree.gather(mine)

    def decide() -> str:
        places: dict[str, str | None] = {k: v for r in everyone for k, v in r["roots"].items()}
        remote = tiers.remote
        if remote is not None:
            try:
                found = ownership.soon(remote, ownership.read_remote)
                places[remote.config.url] = found.run_id if found is not None else None
            except ownership.Unknown as e:  # the uploads check it before writing there
                logger.warning("cannot read the run record of %s now: %s", remote.config.url, e)
        run = identity.decide(writer.explicit_run, places) or identity.new_run_id()
        others = {k: v for r in everyone for k, v in r["memory"].items() if v not in (None, run)}
        if others:
            raise ForeignRunError(
                "; ".join(
                    f"memory directory {k} holds snapshots of run {v!r}" for k, v in others.items()
                )
                + f", and this job is run {run!r}: a new run never resumes from another run's "
                "snapshots. Delete that directory if the other run is over, give this job "
                "another one, or pass that run_id to continue it"
            )
        return run

    run: str = agree.from_rank0(decide)

    def record() -> None:
        writer.join_run(run)
        if memory_backend is not None:
            try:
                ownership.record_local(memory_backend, run)
            except (NotWritableError, InsufficientSpaceError) as e:  # its first snapshot does
                logger.warning("cannot record run %s in %s now: %s", run, memory_backend.root, e)

    agree.everywhere(record, what)
    remote = tiers.remote
    if remote is not None:
        agree.from_rank0(lambda: _record_remote(remote, tiers.root, run))
    return run


def _record_remote(remote: RemoteBackend, root: str, run: str) -> Any:
    try:
        return ownership.soon(remote, lambda r: ownership.record_remote(r, run, root))
    except ownership.Unknown as e:  # the first upload records it
        logger.warning("cannot record run %s at %s now: %s", run, remote.config.url, e)
        return None
