"""Typed settings for the remote tier."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .policy.prefixes import NAMES as _PREFIX_STRATEGIES
from .policy.prefixes import PrefixStrategy


@dataclass(frozen=True, kw_only=True)
class RetryConfig:
    """Retries of transient remote errors: exponential backoff with full jitter."""

    max_attempts: int = 8
    initial_backoff_secs: float = 0.2
    max_backoff_secs: float = 20.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 < self.initial_backoff_secs <= self.max_backoff_secs:
            raise ConfigError("need 0 < initial_backoff_secs <= max_backoff_secs")


@dataclass(frozen=True, kw_only=True)
class RemoteConfig:
    """Where and how steps are copied to the remote tier.

    Args:
        url: any fsspec URL, e.g. ``s3://bucket/run1`` or ``file:///mnt/shared/run1``, or an
            absolute directory path; a relative path without a scheme is refused.
        storage_options: passed to fsspec unchanged (for s3fs: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``, ``config_kwargs``...).
        part_size_bytes: multipart part size for large files (S3 allows 5 MiB to 5 GiB). Small
            parts mean more parts in flight per file; at many-node scale raise it to 32-64 MiB
            to keep the request rate down.
        max_concurrency: files uploaded at once per node, and parts at once per file.
        prefix_strategy: ``"none"`` keeps data under ``<url>/<step>/``; ``"hash"`` spreads
            data objects over 16 ``<url>/data/<x>/`` prefixes (S3 partitions by key prefix, so
            this avoids SlowDown at scale, as s3torchconnector's prefix strategies do).
        hash_prefixes: how many ``data/<x>/`` prefixes ``"hash"`` spreads data over (default
            16). S3 serves about 3,500 PUT and 5,500 GET/HEAD per second per partitioned
            prefix, so size it from the peak part rate of all nodes uploading at once:
            ``hash_prefixes >= nodes * node_bandwidth / part_size_bytes / 3500`` (and
            ``/ 5500`` for restores), rounded up with some headroom; e.g. 2,048 nodes at
            3.1 GB/s with 16 MiB parts need 109, with 64 MiB parts 28. Each save records its
            count in its commit marker, so changing it never makes older steps unreadable.
        durable_timeout_secs: how long the coordinator waits for other nodes' uploads.
        verify_uploads: how an upload is proved whole before the step is committed remotely,
            so a store or proxy that corrupts a PUT is caught at promotion, not at restore (it
            is uploaded again). S3 uploads always send the CRC32C of every body (object or
            part). ``"auto"`` (default): once per store and process, a PUT with a wrong CRC32C
            probes whether the store refuses a body that fails its checksum (AWS S3 does); where
            it does, an upload it accepted is proved and not read back; elsewhere (the store
            keeps it, or the probe got no answer) every object is read back and its CRC32C
            checked against the manifest. ``True``: always read back (one read of each
            object). ``False``: never; turn off only for a store you trust end to end.
        orphan_grace_secs: objects of a save that was never committed remotely (a killed
            upload) are removed by the next writer's ``recover()`` once the newest of them is
            this old; younger ones may belong to a save still uploading.
    """

    url: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    part_size_bytes: int = 16 * 2**20
    max_concurrency: int = 8
    prefix_strategy: str = "none"
    hash_prefixes: int = 16
    durable_timeout_secs: float = 3600.0
    verify_uploads: bool | str = "auto"
    orphan_grace_secs: float = 3600.0
    retry: RetryConfig = field(default_factory=RetryConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ConfigError(
                f"remote must be an fsspec URL such as s3://bucket/run, got {self.url!r}"
            )
        if "://" not in self.url and not self.url.startswith("/"):
            # "bucket/run" would silently become a directory under the working directory.
            raise ConfigError(
                f"remote {self.url!r} has no scheme: did you mean s3://{self.url}? For a local "
                "directory give an absolute path or file:///ABSOLUTE/PATH"
            )
        if not 5 * 2**20 <= self.part_size_bytes <= 5 * 2**30:
            raise ConfigError(
                f"part_size_bytes={self.part_size_bytes} is outside S3's multipart limits "
                "(5 MiB to 5 GiB); choose a value in that range"
            )
        if self.verify_uploads not in (True, False, "auto"):
            raise ConfigError(
                f"verify_uploads must be 'auto', True or False, not {self.verify_uploads!r}"
            )
        if self.max_concurrency < 1:
            raise ConfigError("max_concurrency must be >= 1")
        if self.prefix_strategy not in _PREFIX_STRATEGIES:
            raise ConfigError(
                f"prefix_strategy must be 'none' or 'hash', not {self.prefix_strategy!r}"
            )
        if isinstance(self.hash_prefixes, bool) or not 1 <= int(self.hash_prefixes) <= 4096:
            raise ConfigError(
                f"hash_prefixes must be between 1 and 4096, got {self.hash_prefixes!r}; size it "
                "as nodes x per-node bandwidth / part_size_bytes / 3500 (S3's PUT rate per prefix)"
            )

    @property
    def strategy(self) -> PrefixStrategy:
        """``prefix_strategy`` and ``hash_prefixes`` as the object that computes the keys of
        the saves this config writes."""
        return PrefixStrategy.named(self.prefix_strategy, int(self.hash_prefixes))
