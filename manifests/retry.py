"""Tell transient storage errors from permanent ones, and retry the transient ones with backoff.

Transient: throttling (503 SlowDown, "reduce your request rate"), timeouts, connection resets,
500/502/504 and request timeouts. Permanent: access denied (403), a missing bucket, bad
credentials; those must stop the job with a clear message instead of being retried or recorded
as a per-file error. s3fs and botocore already retry some of these internally; this is the outer
layer that also covers other fsspec filesystems.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from typing import Callable, TypeVar


__all__ = ["is_transient", "is_permanent", "with_retries"]

T = TypeVar("T")

# status codes only as botocore/HTTP print them, "(503)" or "503 Service...", so that a file
# named img_5031.jpg in a message is not mistaken for one
_TRANSIENT = re.compile(
    r"slow ?down|reduce your request rate|service ?unavailable|internal ?error|bad gateway|gateway timeout"
    r"|request ?timeout|timed out|read timeout|connect timeout|connection (reset|aborted|closed)|throttl"
    r"|too many requests|\((429|500|502|503|504)\)|\b(429|500|502|503|504) [a-z]",
    re.IGNORECASE,
)
_PERMANENT = re.compile(
    r"access ?denied|forbidden|\(403\)|\b403 [a-z]|no ?such ?bucket|bucket does not exist|invalid ?access ?key"
    r"|signature ?does ?not ?match|expired ?token|invalid ?token|all ?access ?disabled",
    re.IGNORECASE,
)


def is_permanent(exc: BaseException) -> bool:
    """True for errors a retry cannot fix and the user must: permissions, missing bucket, credentials."""
    if isinstance(exc, PermissionError):
        return True
    return bool(_PERMANENT.search(f"{type(exc).__name__} {exc}"))


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: throttling, timeouts, resets, 5xx."""
    if is_permanent(exc) or isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError, asyncio.TimeoutError)):
        return True
    return bool(_TRANSIENT.search(f"{type(exc).__name__} {exc}"))


def with_retries(
    call: Callable[[], T], *, attempts: int = 6, base_delay: float = 0.1, max_delay: float = 5.0
) -> T:
    """Run ``call()``; on a transient error wait (exponential backoff, full jitter) and retry.

    Re-raises the last error after ``attempts`` tries, and any non-transient error at once.
    Delays are in seconds.
    """
    for attempt in range(attempts):
        try:
            return call()
        except Exception as e:
            if attempt == attempts - 1 or not is_transient(e):
                raise
            # full jitter: many threads hitting the same throttled prefix must not retry in step
            time.sleep(random.uniform(0, min(max_delay, base_delay * 2**attempt)))
    raise AssertionError("unreachable")
