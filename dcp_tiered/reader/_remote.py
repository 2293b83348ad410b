"""The remote tier on the read path: its first probe, the step's keys (from its marker),
ranged GETs of just the bytes wanted, and hydration of the files read into the local tier."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from torch.distributed.checkpoint.planner import ReadItem

from ..backends import ranged_reads
from ..errors import CheckpointNotFoundError, DcpTieredError, IntegrityError, TransientTierError
from ..policy import layout
from ..tiers import pull
from ..tiers.remote import RemoteTier, chunk_bytes
from ._state import ReaderState, by_storage_index

logger = logging.getLogger("dcp_tiered.reader")  # the reader's one logger, whichever module


class RemoteReads(ReaderState):
    """The step's bytes from the remote tier, each item checked as it arrives."""

    def _check_remote(self) -> None:
        """The first time this reader needs the remote: a wrong bucket, bad or missing
        credentials or denied access raise PermanentTierError saying what to fix. A store
        that cannot be reached now is left to the listing that follows (it retries, then says
        the tier cannot be read)."""
        assert self._remote is not None
        try:
            self._remote.probe()
        except TransientTierError:
            return
        self._remote_checked = True

    def _remote_keys_of(self, step: str) -> layout.RemoteKeys:
        assert self._remote is not None
        keys = RemoteTier(self._remote).keys_of(step)
        if keys is None:
            raise CheckpointNotFoundError(
                f"step {step!r} is not committed on {self._remote.config.url}"
            )
        return keys

    def _remote_holds_step(self) -> bool:
        """Whether the remote tier has this step committed, for a local copy that proved bad:
        without it the local failure is the answer (one GET of its marker, asked only then)."""
        try:
            self._remote_keys()
        except CheckpointNotFoundError:
            return False
        return True

    def _remote_keys(self) -> layout.RemoteKeys:
        assert self._remote is not None and self._step is not None
        if self._keys is None:
            keys = self._remote_keys_of(self._step.name)
            if self._manifest is not None and keys.save_id not in (None, self._manifest.save_id):
                raise IntegrityError(
                    f"the remote copy of step {self._step.name!r} on {self._remote.config.url} "
                    f"is another save ({keys.save_id}) than the local one "
                    f"({self._manifest.save_id}): two jobs saved this step name. Its files "
                    "cannot stand in for the local copy's; restore another step."
                )
            self._keys = keys
        return self._keys

    def _fetch(self, name: str, start: int, end: int) -> bytes:
        assert self._remote is not None and self._step is not None
        self.files_read_remotely.add(name)
        key = self._remote_keys().file(name)
        try:
            return self._remote.get_range(key, start, end)
        except FileNotFoundError:  # the store's own word: an object of a committed save is gone
            raise IntegrityError.proof(
                f"{self._remote.url(key)}, a data file of committed step "
                f"{self._step.name!r}, is not on the store; restore an earlier step"
            ) from None

    def _remote_payloads(
        self, files: list[tuple[str, list[ReadItem]]]
    ) -> Iterator[tuple[ReadItem, memoryview]]:
        """Every item of ``files`` from the remote, delivered in file order: neighbours merged
        into ranges of about a part, parallel ranged GETs of a part each across all the files
        (:mod:`dcp_tiered.backends.ranged_reads`)."""
        assert self._remote is not None
        span = chunk_bytes(self._remote)
        plan = []
        for name, items in files:
            groups = list(by_storage_index(items))
            locs = [self._locations[index] for index, _ in groups]
            spans = [(loc.offset, loc.offset + loc.length) for loc in locs]
            plan.append((name, groups, ranged_reads.coalesce(spans, span)))
        blobs = ranged_reads.read_ranges(
            [(name, ranges) for name, _, ranges in plan],
            self._fetch,
            span,
            self._remote.config.max_concurrency,
        )
        joiner = ranged_reads.Joiner()  # each item is delivered before the next range is read
        try:
            for name, groups, ranges in plan:
                g = 0
                for _ in ranges:
                    _, start, end, parts = next(blobs)
                    blob = parts[0] if len(parts) == 1 else joiner.joined(parts)
                    while g < len(groups) and self._locations[groups[g][0]].offset < end:
                        index, group = groups[g]
                        loc = self._locations[index]
                        # a view, not a copy: the range's bytes are handed out in place
                        data = memoryview(blob)[
                            loc.offset - start : loc.offset - start + loc.length
                        ]
                        problem = self._problem(loc, [data])
                        if problem:
                            raise self._integrity_error(name, index.fqn, loc, problem, remote=True)
                        for item in group:
                            yield item, data
                        g += 1
        finally:
            blobs.close()

    def _hydrate(self, names: list[str]) -> None:
        """Copy the whole files read from the remote into the local tier, committed like a
        save (see :func:`pull.hydrate_step`). Caching is optional: when it cannot be
        done (a full or read-only disk, ...) the load, which has succeeded, is not failed."""
        assert self._remote is not None and self._manifest is not None and self._step is not None
        try:
            pull.hydrate_step(
                self._tier,
                self._remote,
                self._step.name,
                self._manifest,
                names,
                self._remote_keys(),
            )
        except (DcpTieredError, OSError) as e:
            logger.warning(
                "hydration of step %s into %s skipped: %s: %s. The load itself "
                "succeeded (from %s); nothing was left on the local tier.",
                self._step.name,
                self.root,
                type(e).__name__,
                e,
                self._remote.config.url,
            )
            return
        logger.info(
            "hydrated %s (%s) from %s into %s",
            self._step.name,
            ", ".join(names),
            self._remote.config.url,
            self.root,
        )
