"""The data files a restore is about to read, read into the page cache while DCP plans it.

A restore's reads start only once DCP has planned the load: the metadata read, every rank's
plan made and agreed, the targets matched with the stored tensors. On the development VM that
was 160 ms of a cold restore of 20,000 tensors with the disk idle, then 200 ms of reads one
block after another. Once DCP sets the reader up for a load (a look at the metadata alone
reads nothing ahead), the manifest's sections and the data files this rank wrote (the ones a
restore at the same world size reads) are read into the page cache on a thread of their own
(``LocalBackend.prefetch``), up to :data:`MAX_BYTES` or an eighth of the memory available
(shared by the ranks of the node), until the load's own reads are done. Only that: those
reads check every byte as before, and a file that cannot be opened (a link, a FIFO, gone) is
left to them to name.
"""

from __future__ import annotations

import logging
import os
import threading

from .._torch_compat import global_rank
from ..backends.local import LocalBackend, available_memory_bytes
from ..policy import layout

logger = logging.getLogger(__name__)

MAX_BYTES = 2 * 2**30
# Read in pieces this large, asking between them whether the load is done: few enough to
# keep the GIL out of the way (see LocalBackend.prefetch), small enough to stop soon.
PIECE_BYTES = 64 * 2**20


class Prefetch:
    """The reads ahead of one load, on a daemon thread, until done or :meth:`stop`."""

    def __init__(self, backend: LocalBackend, step: str, budget: int) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(backend, step, global_rank(), budget),
            name="dcp-tiered-prefetch",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop after the piece being read (the load has read what it needs); return once
        the thread has ended."""
        self._stopped.set()
        self._thread.join()

    def _run(self, backend: LocalBackend, step: str, rank: int, budget: int) -> None:
        try:
            names = backend.list_files(step)
            # the manifest's sections first: the restore reads them before any data file,
            # and would wait behind the data files' reads
            ahead = [n for n in names if layout.is_step_metadata(n)]
            for name in ahead + [n for n in names if layout.data_file_rank(n) == rank]:
                size = backend.file_size(step, name)
                for offset in range(0, size, PIECE_BYTES):
                    length = min(PIECE_BYTES, size - offset, budget)
                    if length <= 0 or self._stopped.is_set():
                        return
                    backend.prefetch(step, name, offset=offset, length=length)
                    budget -= length
        except OSError as e:  # the reads meet it again, and say what is wrong
            logger.debug("no reads ahead for step %s: %s", step, e)


def start(backend: LocalBackend, step: str) -> Prefetch | None:
    """Read local step ``step``'s manifest sections and the data files this rank wrote into
    the page cache, in the background, up to the budget; None where there is no budget."""
    ranks_on_node = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    budget = min(MAX_BYTES, (available_memory_bytes() or 0) // (8 * ranks_on_node))
    return Prefetch(backend, step, budget) if budget > 0 else None
