"""The only module that uses private standard-library APIs; each with a fallback, as
:mod:`dcp_tiered._torch_compat` does for torch."""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable


def at_interpreter_shutdown(hook: Callable[[], None]) -> None:
    """Run ``hook`` when the interpreter begins to exit: before it joins non-daemon threads,
    and before ``concurrent.futures`` and ``asyncio`` shut their executors down (threading's
    exit hooks run in reverse order of registration, and those modules register theirs when
    first imported). ``threading._register_atexit`` (private, CPython 3.9+) is that hook list;
    without it, ``atexit`` runs ``hook`` later, once those threads are joined."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(hook)
    else:
        register(hook)
