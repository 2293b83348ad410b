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

Private to this package, not fsspec's instance cache: a caller's own ``fsspec.filesystem`` with
the same options never gets ours, nor we theirs. A forked child makes its own (a parent's
client belongs to the parent's event loop). Listings are read with the cache invalidated
first (see :mod:`dcp_tiered.backends.remote`), so sharing one filesystem shares no stale view.
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
_shared: dict[tuple[int, str, str], Any] = {}
# Environment variables the stores' clients read when made (botocore, gcsfs, adlfs, fsspec).
_ENV_PREFIXES = ("AWS_", "BOTO", "GOOGLE_", "GCS", "AZURE_", "FSSPEC_")
_KEEP = 16  # the newest filesystems kept; an older one lives on with the backends holding it


def filesystem(protocol: str, options: Mapping[str, Any]) -> Any:
    """This process's filesystem for ``protocol`` with ``options``, made on first use (a new
    one every time where ``options`` hold anything but plain data)."""
    try:
        env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
        text = json.dumps([dict(options), env], sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):  # not plain data: not compared, not shared
        return fsspec.filesystem(protocol, skip_instance_cache=True, **dict(options))
    key = (os.getpid(), protocol, text)
    with _lock:
        fs = _shared.get(key)
        if fs is None:
            if key[0] not in {pid for pid, _, _ in _shared}:
                _shared.clear()  # a forked child: the parent's clients are not its own
            # A copy: botocore rewrites a ``config_kwargs['retries']`` dict it is given in place.
            fs = fsspec.filesystem(
                protocol, skip_instance_cache=True, **copy.deepcopy(dict(options))
            )
            _shared[key] = fs
            while len(_shared) > _KEEP:
                del _shared[next(iter(_shared))]
        return fs
