"""Where a save's data objects live under the remote root: its prefix strategy. Pure, no I/O.

Object stores rate-limit requests per key prefix, so a save of many nodes may spread its data
files over ``data/<h>/`` prefixes (``"hash"``) instead of keeping them under the step
(``"none"``). The strategy a save was written with is recorded in its marker and its claims,
so a reader or the orphan sweep computes the same keys the writer did, never a guess.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The count is RemoteConfig.hash_prefixes, recorded in each marker (markers without one were
# written with 16), so a reader never guesses.
DEFAULT_HASH_PREFIXES = 16
MAX_HASH_PREFIXES = 4096
HASHED_DATA = "data"  # remote prefix of hashed data keys: never a step name
NAMES = ("none", "hash")  # what RemoteConfig.prefix_strategy and the records spell


@dataclass(frozen=True)
class PrefixStrategy:
    """How one save spreads its data keys: ``hashed`` over ``buckets`` prefixes, or not.

    ``buckets`` is kept (and recorded) with ``hashed=False`` too: the cleanup of a save looks
    at every prefix a save of the step could have used.
    """

    hashed: bool = False
    buckets: int = DEFAULT_HASH_PREFIXES

    @classmethod
    def named(cls, name: str, buckets: int = DEFAULT_HASH_PREFIXES) -> PrefixStrategy:
        """The strategy a user option or a record spells ``name``; ValueError for another."""
        if name not in NAMES:
            raise ValueError(f"unknown prefix_strategy {name!r} (expected 'none' or 'hash')")
        return cls(hashed=name == "hash", buckets=buckets)

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> PrefixStrategy:
        """The strategy a marker or claim records (``"none"`` and 16 prefixes where it records
        none: written before they were). ValueError if it is not one we write."""
        return cls.named(str(record.get("prefix_strategy", "none")), hash_prefixes_of(record))

    @property
    def name(self) -> str:
        return "hash" if self.hashed else "none"

    def record(self) -> dict[str, Any]:
        """The fields a marker or claim records it with (read back by :meth:`of_record`)."""
        return {"prefix_strategy": self.name, "hash_prefixes": self.buckets}

    def data_key(self, step: str, base: str, name: str) -> str:
        """The key of data file ``name`` of a save whose own prefix is ``base``."""
        if self.hashed and name.endswith(".distcp"):
            bucket = zlib.crc32(f"{step}/{name}".encode()) % self.buckets
            return f"{HASHED_DATA}/{bucket:x}/{base}{name}"
        return f"{base}{name}"

    def hashed_prefixes(self, base: str) -> list[str]:
        """Every hashed prefix that could hold data of a save whose own prefix is ``base``."""
        return [f"{HASHED_DATA}/{b:x}/{base}" for b in range(self.buckets)]


def hash_prefixes_of(marker: Mapping[str, Any]) -> int:
    """How many hashed data prefixes a marker's save spreads over (16 before it was recorded)."""
    value = marker.get("hash_prefixes", DEFAULT_HASH_PREFIXES)
    if isinstance(value, bool) or not isinstance(value, int):
        # ValueError, not TypeError: callers catch ValueError for a bad marker
        raise ValueError(f"hash_prefixes {value!r} is not an integer")  # noqa: TRY004
    if not 1 <= value <= MAX_HASH_PREFIXES:
        raise ValueError(f"hash_prefixes {value} is outside 1..{MAX_HASH_PREFIXES}")
    return value
