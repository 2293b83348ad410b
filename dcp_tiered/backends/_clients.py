"""One fsspec filesystem per store and options per process, shared by every remote backend.

Making an S3 client is not cheap: botocore parses its endpoint and service models (JSON) for
each new session, 0.15-0.25 s of CPU on a 2-core node, on the thread that runs every request.
Each writer, reader, housekeeping pass and ``with_one_attempt`` view made its own, so one save
or restore paid it several times beside its uploads. Backends with equal storage options now
share one filesystem (and its connection pool); retries are ours (tenacity, per call), not the
filesystem's, so a backend tried once shares it with one that retries. Only options that are
plain data (strings, numbers, lists, dicts: what JSON holds) are compared; options holding any
other object (a session, a credentials provider) get a filesystem of their own, as before, since
two such objects can print alike and differ. The clients read the environment when they are made
(``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, credentials, ...), so the store's variables are part of
what is compared: a backend made after one of them changed gets a filesystem that sees it.

Credentials a client read from the shared credentials or config file stay with it: the files'
modification times are part of the key, so a backend made after a sidecar rewrote them gets a
client that reads them again (self-refreshing providers, such as instance roles, refresh
inside one client anyway).

S3 request bodies are not SHA-256-signed unless the options ask for it (botocore's
``payload_signing_enabled``). Every body we send carries its CRC32C in a signed header, which a
store that checks checksums verifies (and elsewhere uploads are read back:
:mod:`dcp_tiered.backends.s3_checksums`); botocore itself drops the body's SHA-256 over
``https`` when such a header is there. Over plain ``http`` it hashed every body again: 0.3-0.4 s
of CPU per 256 MiB, a third of our client's CPU in an upload, beside a store on the same node.
The SHA-256 guarded a body against a forger on a plain-``http`` path, where the objects read
back at restore are unguarded anyway (use ``https`` against such a path); storage options
with ``config_kwargs={"s3": {"payload_signing_enabled": True}}`` keep it.

Private to this package, not fsspec's instance cache: a caller's own ``fsspec.filesystem`` with
the same options never gets ours, nor we theirs. A forked child makes its own (a parent's
client belongs to the parent's event loop) and never frees the parent's: freeing one closes
its pooled connections, and closing them in the child takes their sockets off the event
loop's epoll set, which the child shares with the parent (the parent's requests on them would
then hang until their read timeout). Listings ask the store every time (see
:mod:`dcp_tiered.backends.remote`), so sharing one filesystem shares no stale view.
"""

from __future__ import annotations

import copy
import json
import os
import threading
from collections.abc import Mapping
from typing import Any

import fsspec

_lock = threading.Lock()
_shared: dict[tuple[str, str], Any] = {}
_inherited: list[Any] = []  # in a forked child: the parent's filesystems, never freed here
# Environment variables the stores' clients read when made (botocore, gcsfs, adlfs, fsspec).
_ENV_PREFIXES = ("AWS_", "BOTO", "GOOGLE_", "GCS", "AZURE_", "FSSPEC_")
_CREDENTIAL_FILES = (
    ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
    ("AWS_CONFIG_FILE", "~/.aws/config"),
)
_KEEP = 16  # the newest filesystems kept; an older one lives on with the backends holding it


def filesystem(protocol: str, options: Mapping[str, Any]) -> Any:
    """This process's filesystem for ``protocol`` with ``options``, made on first use (a new
    one every time where ``options`` hold anything but plain data)."""
    options = _with_defaults(protocol, options)
    try:
        env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
        text = json.dumps([dict(options), env, _file_times()], sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):  # not plain data: not compared, not shared
        return fsspec.filesystem(protocol, skip_instance_cache=True, **dict(options))
    key, dropped = (protocol, text), []
    with _lock:
        fs = _shared.get(key)
        if fs is None:
            # A copy: botocore rewrites a ``config_kwargs['retries']`` dict it is given in place.
            fs = fsspec.filesystem(
                protocol, skip_instance_cache=True, **copy.deepcopy(dict(options))
            )
            _shared[key] = fs
            while len(_shared) > _KEEP:
                dropped.append(_shared.pop(next(iter(_shared))))
    del dropped  # freed here, outside the lock: closing a client's session can take a while
    return fs


def _with_defaults(protocol: str, options: Mapping[str, Any]) -> Mapping[str, Any]:
    """``options`` with S3 bodies unsigned unless they say otherwise (see the module's doc)."""
    if protocol not in ("s3", "s3a"):
        return options
    config = options.get("config_kwargs") or {}
    s3 = (config.get("s3") or {}) if isinstance(config, Mapping) else None
    if not isinstance(s3, Mapping):
        return options  # not what s3fs documents: passed on as it is
    if "payload_signing_enabled" in s3:
        return options
    s3 = {**s3, "payload_signing_enabled": False}
    return {**options, "config_kwargs": {**config, "s3": s3}}


def keep_inherited(fs: Any) -> None:
    """A filesystem a forked child found in an object from its parent: never freed here."""
    _inherited.append(fs)


def _file_times() -> list[int | None]:
    """Modification times of the shared credentials and config files (None: absent)."""
    times: list[int | None] = []
    for variable, default in _CREDENTIAL_FILES:
        try:
            times.append(os.stat(os.path.expanduser(os.environ.get(variable, default))).st_mtime_ns)
        except OSError:
            times.append(None)
    return times


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a parent thread may have held it at the fork
    _inherited.extend(_shared.values())
    _shared.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
