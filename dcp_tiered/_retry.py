"""The retry policy for remote operations, built from RetryConfig (tenacity)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from tenacity import (
    Retrying,
    before_sleep_log,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from .config import RetryConfig
from .errors import TransientTierError

logger = logging.getLogger("dcp_tiered.retry")
T = TypeVar("T")

# Set when the interpreter exits (see tiers.uploads): background uploads stop retrying, so a job
# that ends with uploads pending exits at once instead of logging retries against a closing
# runtime.
EXITING = threading.Event()


def _worth_retrying(e: BaseException) -> bool:
    return isinstance(e, TransientTierError) and not EXITING.is_set()


def retrying(config: RetryConfig, *, sleep: Callable[[float], None] | None = None) -> Retrying:
    """Retry TransientTierError only (never once the process is exiting); log every retry at
    WARNING; re-raise the last error."""
    kwargs: dict[str, Any] = {}
    if sleep is not None:
        kwargs["sleep"] = sleep
    return Retrying(
        retry=retry_if_exception(_worth_retrying),
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
