"""``Run``, what every command gets: its arguments, the local tier, the remote tier it names or
the root records, its part of the ``--json`` object and its errors. Imported by the command
modules only (it imports the tiers, so torch), never by :mod:`dcp_tiered.cli` at import time."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from ..backends.local import LocalBackend
from ..backends.remote import RemoteBackend, remote_backend
from ..config import RemoteConfig, RetryConfig
from ..errors import ConfigError, ManifestError
from ..policy import layout, records
from ..tiers.local import LocalTier
from ._base import error_entry

logger = logging.getLogger(__name__)


class Run:
    """One command's arguments, local tier, output and errors."""

    def __init__(
        self, args: argparse.Namespace, fields: dict[str, Any], errors: list[dict[str, str]]
    ) -> None:
        self.args, self.fields, self.errors = args, fields, errors
        self.tier = LocalTier(LocalBackend(args.root))
        fields["root"] = self.tier.root

    def say(self, text: str = "") -> None:
        if not self.args.json:
            print(text)

    def error(self, e: BaseException) -> None:
        print(f"dcp-tiered: {e}", file=sys.stderr)
        self.errors.append(error_entry(e))

    def recorded(self) -> dict[str, Any]:
        """The tiers the writer or manager recorded in the root (never credentials)."""
        backend = self.tier.backend
        try:
            data = backend.read_file(layout.TIERS_RECORD, limit=records.MAX_RECORD_BYTES)
            return records.tiers_record(data, where=backend.path_of(layout.TIERS_RECORD))
        except FileNotFoundError:
            return {}
        except (OSError, ManifestError) as e:  # give --remote / --memory instead
            logger.warning("ignoring %s: %s", backend.path_of(layout.TIERS_RECORD), e)
            return {}

    def remote(self, url: str | None = None) -> RemoteBackend | None:
        """The remote tier: ``url``, else ``--remote``, else the one recorded in the root."""
        url = url or getattr(self.args, "remote", None) or self.recorded().get("remote")
        self.fields["remote"] = url
        # Two attempts, not eight: an operator wants the answer, not a minute of retries.
        return remote_backend(
            RemoteConfig(url=url, retry=RetryConfig(max_attempts=2)) if url else None
        )

    def need_remote(self, url: str | None = None) -> RemoteBackend:
        remote = self.remote(url)
        if remote is None:
            raise ConfigError(f"{self.tier.root} records no remote tier: give --remote URL")
        return remote


def progress(total: int, desc: str, run: Run) -> Any:
    """A tqdm bar (stderr) for work over 256 MiB; smaller work finishes before it would help."""
    from tqdm import tqdm

    return tqdm(
        total=total, unit="B", unit_scale=True, desc=desc, leave=False, disable=total < 256 * 2**20
    )
