"""Run records and live-job locks: which run a local root, a remote prefix or a memory directory
belongs to (:mod:`dcp_tiered.policy.identity`), and which job uses a root now.

A run record is created once, exclusively, where a run first writes, and read at every start;
it changes only through ``dcp-tiered adopt``. A job holds a shared lock on a file named after its
instance (every rank of one launch shares it) while it uses a root, so a second job starting on
a root in use is refused, naming the first; a crashed job's lock dies with its processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..backends.local import LocalBackend
from ..backends.remote import RemoteBackend
from ..errors import ForeignRunError, ManifestError, NotWritableError
from ..policy import identity
from ..policy.identity import RunRecord

logger = logging.getLogger(__name__)
T = TypeVar("T")


def instance_token() -> str:
    """The job instance this process belongs to: every rank of one launch shares its
    rendezvous endpoint and run id; a process started without one is an instance of its own."""
    port = os.environ.get("MASTER_PORT")
    if port:
        basis = ":".join(
            (os.environ.get("MASTER_ADDR", ""), port, os.environ.get("TORCHELASTIC_RUN_ID", ""))
        )
    else:
        basis = f"{socket.gethostname()}:{os.getpid()}"
    return hashlib.sha256(basis.encode()).hexdigest()[:16]


def new_record(run_id: str, where: str) -> RunRecord:
    return RunRecord(run_id, time.time_ns(), socket.gethostname(), where)


# ---------------------------------------------------------------- local roots


def read_local(backend: LocalBackend) -> RunRecord | None:
    """The run record of a local root or memory directory; None if it has none (ManifestError
    if it has one that cannot be read: nothing is decided from it)."""
    try:
        data = backend.read_file(identity.RUN_RECORD)
    except FileNotFoundError:
        return None
    return identity.decode_record(data, where=backend.path_of(identity.RUN_RECORD))


def record_local(backend: LocalBackend, run_id: str) -> RunRecord:
    """Record ``run_id`` in a local root or memory directory unless it records one already;
    ForeignRunError if that is another run's."""
    found = read_local(backend)
    if found is None:
        record = new_record(run_id, str(backend.root))
        if backend.create_root_file(identity.RUN_RECORD, identity.encode_record(record)):
            logger.info("%s belongs to run %s from now on", backend.root, run_id)
            return record
        found = read_local(backend)  # another process recorded it meanwhile
        assert found is not None
    if found.run_id != run_id:
        raise ForeignRunError(
            f"{backend.root} belongs to {found.describe()}, not to run {run_id!r}: nothing was "
            "written there. Give this job its own directory, or pass that run_id to continue it"
        )
    return found


def save_local(backend: LocalBackend, record: RunRecord) -> None:
    """Replace a local run record (adoptions), atomically."""
    backend.replace_root_file(identity.RUN_RECORD, identity.encode_record(record))


# Processes of a job that was just killed may take a moment to exit (and drop their locks); the
# kernel may take longer to tear down one killed in the middle of I/O.
_EXIT_GRACE_SECS = 10.0
_TEARDOWN_WAIT_SECS = 300.0
_HELD: set[int] = set()  # descriptors of this process's live locks


def _drop_in_child() -> None:
    """A forked child does not hold its parent's root: flock belongs to the open file, which
    fork shares, so a long-lived child would otherwise keep the job "live" after it ends."""
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_in_child)


class LiveLock:
    """This job instance's hold on a root: a shared lock on ``.dcp-tiered-live.<token>.lock``,
    which every process of the instance takes. Taking it refuses a root another live instance
    holds (ForeignRunError naming it; the processes of a job just killed get a few seconds to
    exit first, longer while the kernel is still tearing them down) and removes the files of
    instances that are gone."""

    def __init__(self, backend: LocalBackend, token: str, about: dict[str, object]) -> None:
        self.backend, self.token = backend, token
        name = identity.live_lock_name(token)
        for _ in range(8):
            backend.create_root_file(name, json.dumps(about).encode())  # who, for the message
            fd = backend.lock_root_shared(name)
            if backend.names_file(fd, name):  # not removed as stale between open and lock
                break
            LocalBackend.unlock(fd)
        else:  # pragma: no cover - a sweeper removing our file eight times in a row
            raise ForeignRunError(f"cannot hold {backend.path_of(name)}: it keeps disappearing")
        self.fd: int | None = fd
        _HELD.add(fd)
        try:
            self._refuse_others()
        except BaseException:
            self.release()
            raise

    def _refuse_others(self) -> None:
        backend = self.backend
        for name in backend.list_names():
            token = identity.parse_live_lock(name)
            if token is None or token == self.token:
                continue
            holders = self._live_holders(name)
            if holders is not None:
                held_by = f"; held by pid(s) {', '.join(map(str, holders))}" if holders else ""
                raise ForeignRunError(
                    f"{backend.root} is in use by another job ({_describe_holder(backend, name)}"
                    f"{held_by}): a root holds one job's checkpoints at a time, and nothing was "
                    "changed. Give this job its own root, or stop the other job first"
                )
            logger.info(
                "deleting %s (the job instance it stood for has ended)", backend.path_of(name)
            )
            backend.remove_file(name)

    def _live_holders(self, name: str) -> list[int] | None:
        """None once nothing holds live-lock file ``name``; else the processes holding it (an
        empty list where the OS does not say) once they are taken for a live job. A killed
        job's processes get ``_EXIT_GRACE_SECS`` to exit, and while the kernel is still
        tearing them down (a thread of theirs in uninterruptible I/O keeps their files open)
        up to ``_TEARDOWN_WAIT_SECS``: a job restarted at once must not fail on them."""
        backend = self.backend
        start, warned, live = time.monotonic(), False, 0
        while backend.root_lock_held(name):
            waited = time.monotonic() - start
            if waited >= _EXIT_GRACE_SECS:
                holders = backend.root_lock_holders(name) or []
                dying = bool(holders) and all(map(backend.process_exiting, holders))
                # seen live three times running: not the instant another rank of this job
                # probes the file, as the last killed process lets go of it
                live = 0 if dying else live + 1
                if live == 3 or waited >= _TEARDOWN_WAIT_SECS:
                    return holders
                if dying and not warned:
                    warned = True
                    logger.warning(
                        "%s: waiting for pid(s) %s of a killed job to finish exiting (the "
                        "kernel ends their I/O first; they hold the root until then)",
                        backend.root,
                        ", ".join(map(str, holders)),
                    )
            time.sleep(0.1)
        return None

    def release(self) -> None:
        if self.fd is not None:
            _HELD.discard(self.fd)
            LocalBackend.unlock(self.fd)
            self.fd = None


def _describe_holder(backend: LocalBackend, name: str) -> str:
    try:
        about = json.loads(backend.read_file(name)[:4096])
        return ", ".join(f"{k} {about[k]}" for k in ("run", "host", "pid", "root") if k in about)
    except (OSError, ValueError, TypeError, RecursionError):
        return f"its lock file {backend.path_of(name)}"


def hold_root(backend: LocalBackend, run_id: str | None) -> LiveLock:
    """Take this job instance's hold on ``backend``'s root (see :class:`LiveLock`)."""
    about = {"run": run_id, "host": socket.gethostname(), "pid": os.getpid()}
    return LiveLock(backend, instance_token(), {**about, "root": str(backend.root)})


# ---------------------------------------------------------------- the remote prefix


def read_remote(remote: RemoteBackend) -> RunRecord | None:
    try:
        data = remote.get_bytes(identity.RUN_RECORD)
    except FileNotFoundError:
        return None
    return identity.decode_record(data, where=remote.url(identity.RUN_RECORD))


class Unknown(Exception):
    """The remote prefix's record could not be read in time (unreachable, slow)."""


def soon(remote: RemoteBackend, act: Callable[[RemoteBackend], T], within_secs: float = 5.0) -> T:
    """``act`` on ``remote`` with one attempt per request, waited for at most ``within_secs``
    (it goes on in the background): a start or a first save never waits long on a store that
    does not answer. Unknown if it did not answer in time or failed on the store; our own
    errors about what it holds (ManifestError, ForeignRunError) as themselves."""
    once = remote.with_one_attempt()
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(act(once))
        except Exception as e:  # noqa: BLE001 - reported below
            box.append(e)

    thread = threading.Thread(target=run, name="dcp-tiered-run-record", daemon=True)
    thread.start()
    thread.join(within_secs)
    if not box:
        raise Unknown(f"{remote.config.url} did not answer within {within_secs:.0f} s")
    if isinstance(box[0], (ManifestError, ForeignRunError)):
        raise box[0]
    if isinstance(box[0], BaseException):
        raise Unknown(f"{remote.config.url}: {box[0]}") from box[0]
    return box[0]


def record_remote(remote: RemoteBackend, run_id: str, where: str) -> RunRecord:
    """Record ``run_id`` at the remote prefix unless it records one already (created
    exclusively: of two jobs starting at once, one wins); ForeignRunError if that is another
    run's."""
    found = read_remote(remote)
    if found is None:
        record = new_record(run_id, where)
        if remote.create_exclusive(identity.RUN_RECORD, identity.encode_record(record)):
            logger.info("%s belongs to run %s from now on", remote.config.url, run_id)
            return record
        found = read_remote(remote)
        assert found is not None
    if found.run_id != run_id:
        raise ForeignRunError(
            f"{remote.config.url} belongs to {found.describe()}, not to run {run_id!r}: nothing "
            "of this run was written there. Give this job its own remote prefix, or pass that "
            "run_id to continue it"
        )
    return found


def save_remote(remote: RemoteBackend, record: RunRecord) -> None:
    remote.put_bytes(identity.RUN_RECORD, identity.encode_record(record))


class RootRun:
    """What a writer knows of its root's run: the run ``run_id=`` names (``explicit``), the
    one the root records, the one the remote prefix records, and this job's hold on the root.
    The writer asks it; only :meth:`join` and the first :meth:`start` write (the root's
    record, the live lock)."""

    def __init__(
        self, backend: LocalBackend, remote: RemoteBackend | None, explicit: str | None
    ) -> None:
        self.backend, self.remote = backend, remote
        self.explicit = None if explicit is None else identity.validate_run_id(explicit)
        self.run_id: str | None = self.explicit  # known once recorded, joined or decided
        self.remote_run: str | None = None  # what the prefix records, once asked
        self._recorded: str | None = None  # what the root is known to record
        self._asked = False
        self._live: LiveLock | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_live": None}  # the hold stays with the trainer's process

    def start(self, *, hold: bool) -> None:
        """Hold the root for this job instance (``hold``; a read-only root is left to the
        save's own check) and learn the run it records. ForeignRunError if that is not
        ``explicit``, or another job holds the root."""
        if hold and self._live is None:
            try:
                self._live = hold_root(self.backend, self.run_id)
            except NotWritableError as e:
                logger.debug("not holding %s: %s", self.backend.root, e)
        if self._recorded is None:
            found = read_local(self.backend)
            if found is not None:
                decided = identity.decide(self.explicit, {str(self.backend.root): found.run_id})
                self._recorded = self.run_id = decided

    def join(self, run_id: str) -> None:
        """Make ``run_id`` the run and record it in the root (ForeignRunError if the root
        records another)."""
        identity.validate_run_id(run_id)
        if self._recorded != run_id:
            self._recorded = record_local(self.backend, run_id).run_id
        self.run_id = run_id

    def learn_remote(self) -> bool:
        """Whether the remote prefix records a run (then ``remote_run``): asked once, and
        never waited on for long (a store that does not answer leaves it to the uploads, which
        check it before writing anything there)."""
        if self.remote is None or self._asked:
            return self.remote_run is not None
        self._asked = True
        try:
            found = soon(self.remote, read_remote)
        except Unknown as e:
            logger.warning("cannot read the run record of %s now: %s", self.remote.config.url, e)
            return False
        self.remote_run = found.run_id if found is not None else None
        return found is not None

    def join_remote(self) -> None:
        """A root that records no run yet joins the run its remote prefix records (a fresh
        node of that run)."""
        if self.run_id is None and self.learn_remote():
            assert self.remote_run is not None
            try:
                self.join(self.remote_run)
            except NotWritableError:  # a read-only root: its saves say so; reads go on
                self.run_id = self.remote_run

    def decide(self, roots: dict[str, str | None]) -> str:
        """The run of a save (the coordinator's call): the one ``roots`` (each node's, as its
        ranks planned) and the prefix record, else a new one; ForeignRunError if they
        disagree. No I/O: the prefix as :meth:`learn_remote` found it."""
        found = dict(roots)
        if self.remote is not None:
            found[self.remote.config.url] = self.remote_run
        self.run_id = identity.decide(self.explicit, found) or identity.new_run_id()
        return self.run_id

    @property
    def recorded(self) -> str | None:
        return self._recorded

    def release(self) -> None:
        if self._live is not None:
            self._live.release()
            self._live = None
