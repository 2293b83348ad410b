"""What every command shares and ``main`` needs before any command is imported: the exit
codes, the ``--json`` envelope, error entries and the table's number and time formats.

Only the standard library: ``dcp-tiered --help``, ``--version`` and usage errors answer without
importing torch (seconds). Imports nothing of :mod:`dcp_tiered.cli` itself.
"""

from __future__ import annotations

import datetime
import enum
from typing import Any

from .._version import __version__

SCHEMA = 1  # of the --json output; bumped only on an incompatible change


class ExitCode(enum.IntEnum):
    """The exit status of every command (docs/cli.md)."""

    OK = 0  # done
    PROBLEM = 1  # a problem was found in the data (a corrupt or missing file, a bad manifest)
    USAGE = 2  # usage or configuration error, or a refusal (nothing was changed)
    UNREADABLE = 3  # a tier could not be read, so the answer is incomplete


OK, PROBLEM, USAGE, UNREADABLE = (
    ExitCode.OK,
    ExitCode.PROBLEM,
    ExitCode.USAGE,
    ExitCode.UNREADABLE,
)


def envelope(
    command: str | None, code: int, errors: list[dict[str, str]], fields: dict[str, Any]
) -> dict[str, Any]:
    """The one JSON shape every command prints: these keys, then the command's own."""
    return {
        "schema": SCHEMA,
        "tool": "dcp-tiered",
        "version": __version__,
        "command": command,
        "exit_code": int(code),
        "ok": code == OK,
        "errors": errors,
        **fields,
    }


def error_entry(e: BaseException) -> dict[str, str]:
    return {"type": type(e).__name__, "message": str(e)}


def human(n: float) -> str:
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            break
        n /= 1024
    return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"


def iso(ns: int) -> str | None:
    if ns < 0:
        return None
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).isoformat(
        timespec="seconds"
    )
