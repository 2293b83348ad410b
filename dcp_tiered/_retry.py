"""The retry policy for remote operations, built from RetryConfig (tenacity)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from tenacity import (
    Retrying,
    before_sleep_log,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)

from .config import RetryConfig
from .errors import TransientTierError

logger = logging.getLogger("dcp_tiered.retry")
T = TypeVar("T")


def retrying(config: RetryConfig, *, sleep: Callable[[float], None] | None = None) -> Retrying:
    """Retry TransientTierError only; log every retry at WARNING; re-raise the last error."""
    kwargs: dict[str, Any] = {}
    if sleep is not None:
        kwargs["sleep"] = sleep
    return Retrying(
        retry=retry_if_exception_type(TransientTierError),
        wait=wait_random_exponential(
            multiplier=config.initial_backoff_secs, max=config.max_backoff_secs
        ),
        stop=stop_after_attempt(config.max_attempts),
        before_sleep=before_sleep_log(logger, logging.WARNING),
        reraise=True,
        **kwargs,
    )


def call(config: RetryConfig, fn: Callable[[], T]) -> T:
    return retrying(config)(fn)
