"""Publishing a step on the local tier of every node.

Per node, the step is published by that node's leader (its lowest rank): it writes the
manifest, then DCP's ``.metadata``, fsyncs, and renames the temporary directory to the step's
name. The job-wide coordinator (rank 0) decides; the other nodes' leaders follow a two-phase
handshake through the c10d store, which never interleaves with DCP's collectives:

    coordinator                           leader of node n (background thread)
    store the index + each node's section ─▶  write the index and its section, fsync
                                          ◀─  prepared/n = ok | error
    rename own dir (the commit point)
    decision = commit | abort             ─▶  rename its dir (or delete it on abort)
                                          ◀─  done/n = ok | error
    return (so dcp.save returns on every rank only after every node has published)

Each node receives the manifest's index, the shared section and its own section only (the
coordinator's node keeps every section and DCP's ``.metadata``), so the bytes through the store
grow with the state, not with nodes x ranks. The coordinator's store traffic is batched: one
``multi_set`` of the sections, and per phase one ``wait`` and one ``multi_get`` over every
node's key.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..backends.local import LocalBackend
from ..errors import CheckpointExistsError, CommitError, ForeignPathError, ManifestError
from ..policy import layout, manifest
from ..policy.manifest_types import SHARED

logger = logging.getLogger(__name__)

_OK = b"ok"


def write_step_files(
    backend: LocalBackend, tmp: str, files: Mapping[str, bytes], *, sync: bool
) -> None:
    """Write a step's manifest files (index last) into ``tmp`` before its rename."""
    for name, data in files.items():
        backend.write_file(tmp, name, data, sync=sync)
    if sync:
        backend.sync_dir(tmp)


def publish_step(
    backend: LocalBackend,
    step: str,
    save_id: str,
    tmp: str,
    *,
    overwrite: bool = True,
    may_replace: Callable[[str], bool] | None = None,
) -> None:
    """Rename ``tmp`` to ``step``. Without ``overwrite``, a step that appeared at that name
    since the save was planned (another job saving into this root) is never replaced: the
    rename fails, and CheckpointExistsError says so. With it, what was replaced is checked
    with ``may_replace(its hidden name)`` before anything is deleted: when that says it is not
    ours to replace (it changed since the save checked), it is swapped back, untouched, and
    ForeignPathError raised."""
    old = layout.old_dir_name(step, save_id)
    pending = backend.exists(step, layout.PENDING_MARKER)
    try:
        replaced = backend.publish(tmp, step, old, replace=overwrite or pending)
    except FileExistsError:
        discard_tmp(backend, tmp, reason=f"save {save_id} of {step} lost to another save")
        raise CheckpointExistsError(
            f"{backend.path_of(step)} appeared while save {save_id} of it was being written: "
            "another job (or writer) saves the same step name into this root. It was left "
            "untouched and this save was not committed; give each job its own root, or save "
            "under another step name."
        ) from None
    if replaced and not pending and may_replace is not None and not may_replace(old):
        backend.publish(old, step, tmp, replace=True)  # ours goes back to tmp, theirs stays
        discard_tmp(backend, tmp, reason=f"save {save_id} of {step} would have replaced another")
        raise ForeignPathError(
            f"{backend.path_of(step)} changed while save {save_id} of it was being written, to "
            "a step that is not this run's to replace: it was left untouched and this save was "
            "not committed. Give each job its own root, or save under another step name."
        )
    if replaced:
        backend.remove_step_dir(
            old,
            reason=(
                f"the directory made for {step} before its commit (its files are in the step)"
                if pending
                else f"overwritten by a new save of {step}"
            ),
        )
    # The lock guarded the temporary directory until now; a committed step needs none.
    backend.remove_file(step, layout.LOCK_NAME)
    logger.info("committed-local step=%s root=%s", step, backend.root)


def _save_id_of(backend: LocalBackend, directory: str) -> str | None:
    """The save id a step directory's manifest names (None if it has no readable one)."""
    try:
        return manifest.parse(
            backend.read_file(directory, layout.MANIFEST_NAME), where=directory
        ).save_id
    except (ManifestError, OSError):
        return None


def discard_tmp(backend: LocalBackend, tmp: str, *, reason: str) -> None:
    if backend.exists(tmp):
        backend.remove_tree(tmp, reason=reason)


def build_and_publish(
    backend: LocalBackend,
    step: str,
    save_id: str,
    fill: Callable[[str], None],
    files: Mapping[str, bytes],
    *,
    what: str,
    replaces: str | None = None,
) -> None:
    """Commit a step made outside a save (adopted or hydrated from the remote) as a save is
    committed: a hidden temporary directory, locked so that no sweep takes it while
    ``fill(tmp)`` writes its data, then the manifest files last, fsync, and the rename.
    A failure or a crash leaves no step that looks committed but lacks files: the temporary
    directory is removed here, or swept as abandoned once its lock dies with the process.
    A step of that name is replaced only when it is save ``replaces`` (the copy being completed):
    one committed meanwhile by a job, or any other, is never replaced (CheckpointExistsError)."""
    tmp = layout.tmp_dir_name(step, save_id)
    backend.make_dir(tmp)
    lock = None
    try:
        lock = backend.lock_shared(tmp)
        fill(tmp)
        write_step_files(backend, tmp, files, sync=True)
        publish_step(
            backend,
            step,
            save_id,
            tmp,
            overwrite=replaces is not None,
            may_replace=lambda old: _save_id_of(backend, old) == replaces,
        )
    except BaseException:
        if lock is not None:
            backend.unlock(lock)
            lock = None
        try:
            discard_tmp(backend, tmp, reason=f"{what} of {step} failed")
        except OSError as e:  # the original error is the one to report; a sweep finishes this
            logger.warning("could not remove %s: %s", backend.path_of(tmp), e)
        raise
    finally:
        if lock is not None:
            backend.unlock(lock)


class Handshake:
    """The store keys of one save's cross-node commit."""

    def __init__(self, store: Any, save_id: str, timeout_secs: float, nodes: int = 1) -> None:
        self._store = store
        self._prefix = f"dcp_tiered/commit/{save_id}/"
        # Each phase waits for every node: allow for the slowest of many (20 ms a node).
        self._timeout = datetime.timedelta(seconds=timeout_secs + 0.02 * nodes)

    def _keys(self, keys: list[str]) -> list[str]:
        return [self._prefix + k for k in keys]

    def _get_all(self, keys: list[str]) -> list[bytes]:
        try:
            self._store.wait(self._keys(keys), self._timeout)
        except RuntimeError as e:  # c10d reports a wait timeout as RuntimeError
            missing = [k for k in keys if not self._store.check(self._keys([k]))][:8]
            raise CommitError(
                f"no {missing} from the other nodes within {self._timeout.total_seconds():.0f} s "
                "(a rank probably failed); the step was not published"
            ) from e
        if len(keys) > 1 and self._has_batches():
            return [bytes(v) for v in self._store.multi_get(self._keys(keys))]
        return [bytes(self._store.get(k)) for k in self._keys(keys)]

    def _get(self, key: str) -> bytes:
        return self._get_all([key])[0]

    def _set(self, key: str, value: bytes) -> None:
        self._store.set(self._prefix + key, value)

    def _has_batches(self) -> bool:
        try:
            return bool(self._store.has_extended_api())
        except (AttributeError, RuntimeError):
            return False

    # ------------------------------------------------------------ coordinator

    def coordinate(
        self,
        other_nodes: list[int],
        index: bytes,
        sections: Mapping[int, bytes],
        publish_own: Callable[[], None],
    ) -> None:
        decided = False
        try:
            nodes = [SHARED, *other_nodes]
            keys = [f"section/{n}" for n in nodes]
            if self._has_batches():
                self._store.multi_set(self._keys(keys), [sections[n] for n in nodes])
            else:
                for key, n in zip(keys, nodes):
                    self._set(key, sections[n])
            self._set("index", index)
            failures = self._failures("prepared", other_nodes)
            if failures:
                raise CommitError(f"nodes could not prepare the step: {_describe(failures)}")
            publish_own()
            self._set("decision", b"commit")
            decided = True
        finally:
            if not decided:
                self._set("decision", b"abort")
        failed = self._failures("done", other_nodes)
        if failed:
            raise CommitError(
                f"step published on the coordinator's node but not on: {_describe(failed)}"
            )

    def _failures(self, phase: str, nodes: list[int]) -> dict[int, bytes]:
        values = self._get_all([f"{phase}/{n}" for n in nodes])
        return {n: v for n, v in zip(nodes, values) if v != _OK}

    # ------------------------------------------------------------ other node leaders

    def follow_in_background(
        self,
        node: int,
        prepare: Callable[[bytes, bytes, bytes], None],
        publish: Callable[[], None],
        abandon: Callable[[str], None],
    ) -> threading.Thread:
        def run() -> None:
            try:
                index, shared, own = self._get_all(
                    ["index", f"section/{SHARED}", f"section/{node}"]
                )
                self._report(f"prepared/{node}", lambda: prepare(index, shared, own))
                if self._get("decision") == b"commit":
                    self._report(f"done/{node}", publish)
                else:
                    abandon("the coordinator aborted the commit")
            except Exception as e:  # noqa: BLE001 - a background thread must report, not raise
                logger.error("node %d could not publish the step: %s", node, e)
                abandon(f"commit failed: {e}")

        thread = threading.Thread(target=run, name=f"dcp-tiered-commit-node{node}", daemon=True)
        thread.start()
        return thread

    def _report(self, key: str, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception as e:
            self._set(key, f"{type(e).__name__}: {e}".encode())
            raise
        self._set(key, _OK)


def _describe(failures: dict[int, bytes]) -> str:
    return "; ".join(f"node {n}: {v.decode(errors='replace')}" for n, v in sorted(failures.items()))
