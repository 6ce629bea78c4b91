"""The one retry layer for storage: classify a failure by its type and errno, retry the transient ones.

Every storage call bucketeer makes runs through :func:`with_retries` (or :func:`with_retries_async`),
mostly via the helpers of :mod:`manifests.storage`. The layers below it are switched off:
:func:`manifests.storage.open_url` gives s3fs one attempt per call (its own loop would retry 5
times, nested twice in ``cat_file``) and botocore ``total_max_attempts=1``, so a throttled read is
tried exactly ``attempts`` times, not attempts x 5 x 5 x botocore's.

A failure is one of three things, decided by type and errno (s3fs translates S3 error codes into
builtin exceptions, see ``s3fs/errors.py``), never by message text:

- **transient** (:func:`is_transient`): worth another try after a pause. ``TimeoutError``,
  ``ConnectionError`` and other ``OSError`` with errno EBUSY (S3 ``SlowDown``/``503``), EAGAIN,
  ETIMEDOUT, ECONNRESET, EREMOTEIO (``InternalError``/``500``), ...; botocore's and aiohttp's
  connection, timeout and truncated-body errors. An S3 error code s3fs has no errno for (502,
  504, ...) becomes EIO: when the botocore ``ClientError`` it came from is attached as the cause,
  its HTTP status decides (429 and 5xx are transient, other 4xx are not); a bare EIO is retried.
- **permanent** (:func:`is_permanent`): the store refuses this caller (``PermissionError``: access
  denied, bad signature, expired token; botocore's missing-credentials errors). No retry and no
  other object will fare better, so a job stops with a :class:`~manifests.errors.StorageError`.
- anything else (``FileNotFoundError`` for a missing key, a bad range, a bug): not retried, and
  not the store's fault as a whole; the caller decides (an error row for one image, a "missing
  artifact" message, a traceback for a bug).

Policy: ``attempts`` tries in all, waiting ``uniform(0, min(max_delay, base_delay * 2**i))``
seconds after failure ``i`` (exponential backoff with full jitter, so threads throttled together
do not retry in step). The defaults, 6 attempts from 0.1 s, give up after at most 3.1 s of
waiting (1.6 s on average). ``BUCKETEER_STORAGE_ATTEMPTS`` and ``BUCKETEER_STORAGE_RETRY_DELAY``
(base delay, seconds) override them per process; a local Ray's workers inherit the driver's
environment, on a cluster set them in the job's runtime environment (``env_vars`` of
``infra/ray/runtime_env.yaml`` or ``--runtime-env-json``).

Throttling (:func:`is_throttled`: S3's ``503 SlowDown``/``ServiceUnavailable``, which s3fs gives errno
EBUSY, and ``429 Too Many Requests``, R2's, by HTTP status) is the store asking for fewer requests,
not a failure: a throttled answer does not use up ``attempts``. The call waits as the providers ask,
``uniform(0, min(20, base_delay * 2**n))`` seconds after its ``n``-th throttled answer (exponential,
full jitter), or what the answer's ``Retry-After`` header says when that is longer (s3fs hands the
header on; obstore does not, so its throttled reads back off on the exponential alone), and tries
again, for as long as ``BUCKETEER_STORAGE_THROTTLE_SECONDS`` (default 300) from its first throttled
answer (its last wait cut to end there); a ``Retry-After`` past that gives up at once. Every throttled
answer is counted in this process (:func:`throttled_requests`); a job adds up those of all its processes
(:mod:`manifests.throttles`), and its progress line and summary say how many there were.

A hung endpoint is a transient failure like any other: every S3 request has a connect and a read
timeout, uploads included (:mod:`manifests.s3`), and the timeout it raises is retried here. So a
storage call that never gets an answer gives up after at most ``attempts x (connect + read)``
seconds plus the backoff (6 x (10 + 60) + 3.1 s, about 7 minutes, by default).

While a call waits to try again, the retry layer says so: each transient failure goes, as a
:class:`StorageWait`, to the listeners of this process (:func:`add_wait_listener`; a
:class:`~manifests.progress.Progress` reporter is one, its line then says "waiting for storage"),
or, where none listens (a Ray worker, a command between progress phases), to a warning of the
``bucketeer.retry`` logger, at most one every 10 s.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import email.utils
import errno
import logging
import math
import os
import random
import threading
import time
import weakref
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Awaitable, Callable, TypeVar

from manifests.errors import BucketeerError, UsageError

__all__ = [
    "ATTEMPTS_ENV",
    "DELAY_ENV",
    "THROTTLE_ENV",
    "RetryPolicy",
    "StorageWait",
    "add_wait_listener",
    "remove_wait_listener",
    "is_transient",
    "is_permanent",
    "is_timeout",
    "is_throttled",
    "retry_after",
    "throttled_requests",
    "is_storage_failure",
    "with_retries",
    "with_retries_async",
]

T = TypeVar("T")
log = logging.getLogger("bucketeer.retry")

ATTEMPTS_ENV = "BUCKETEER_STORAGE_ATTEMPTS"
DELAY_ENV = "BUCKETEER_STORAGE_RETRY_DELAY"
THROTTLE_ENV = "BUCKETEER_STORAGE_THROTTLE_SECONDS"

_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("EBUSY", "EAGAIN", "ETIMEDOUT", "ECONNRESET", "ECONNABORTED", "ECONNREFUSED", "EPIPE", "EINTR",
                 "ENETDOWN", "ENETUNREACH", "ENETRESET", "EHOSTDOWN", "EHOSTUNREACH", "EREMOTEIO", "EIO")
    if hasattr(errno, name)
)  # fmt: skip


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry: ``attempts`` tries in all (>= 1) for failures, and for
    throttled answers ``throttle_seconds`` from the first; delays in seconds."""

    attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 5.0
    throttle_seconds: float = 300.0
    throttle_max_delay: float = 20.0  # the longest exponential wait after a throttled answer (AWS SDKs': 20 s)

    @classmethod
    def from_env(cls) -> "RetryPolicy":
        """The default policy with ``$BUCKETEER_STORAGE_ATTEMPTS``, ``$BUCKETEER_STORAGE_RETRY_DELAY`` and
        ``$BUCKETEER_STORAGE_THROTTLE_SECONDS`` applied.

        Raises UsageError naming the variable when a value is not a number in range.
        """
        return _policy(os.environ.get(ATTEMPTS_ENV, ""), os.environ.get(DELAY_ENV, ""),
                       os.environ.get(THROTTLE_ENV, ""))  # fmt: skip

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failed attempt (1-based): full jitter."""
        return random.uniform(0, min(self.max_delay, self.base_delay * 2 ** (failures - 1)))

    def throttle_delay(self, throttles: int, retry_after: float | None = None) -> float:
        """Seconds to wait after the ``throttles``-th throttled answer to one call (1-based): full jitter
        over ``base_delay * 2**(throttles - 1)``, at most ``throttle_max_delay``, and at least ``retry_after``
        (the answer's ``Retry-After``) when the store said how long."""
        jitter = random.uniform(0, min(self.throttle_max_delay, self.base_delay * 2 ** min(throttles - 1, 32)))
        return max(jitter, retry_after or 0.0)


@lru_cache(maxsize=8)
def _policy(attempts: str, delay: str, throttle: str = "") -> RetryPolicy:
    policy = RetryPolicy()
    try:
        if attempts:
            policy = replace(policy, attempts=int(attempts))
        if delay:
            policy = replace(policy, base_delay=float(delay))
    except ValueError:
        raise UsageError(f"{ATTEMPTS_ENV}={attempts!r} / {DELAY_ENV}={delay!r}: give an integer and seconds") from None
    if policy.attempts < 1 or not policy.base_delay >= 0:
        raise UsageError(f"{ATTEMPTS_ENV} must be >= 1 and {DELAY_ENV} >= 0, got {attempts!r} and {delay!r}")
    if throttle:
        try:
            seconds = float(throttle)
        except ValueError:
            seconds = math.nan
        if not 0 <= seconds < math.inf:
            raise UsageError(f"{THROTTLE_ENV}={throttle!r}: give the seconds a throttled request keeps being "
                             "retried, a number >= 0 (default 300)")  # fmt: skip
        policy = replace(policy, throttle_seconds=seconds)
    return policy


@lru_cache(maxsize=1)
def _library_errors() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """(transient, permanent, timeout) exception classes of the HTTP stack, where installed
    (imported late: ``manifests`` must import without them)."""
    transient: list[type] = []
    permanent: list[type] = []
    timeout: list[type] = [TimeoutError]
    try:
        from botocore import exceptions as bc

        transient += [bc.HTTPClientError, bc.ConnectionError, bc.IncompleteReadError]
        permanent += [bc.NoCredentialsError, bc.PartialCredentialsError, bc.CredentialRetrievalError]
        timeout += [bc.ReadTimeoutError, bc.ConnectTimeoutError]
    except ImportError:
        pass
    try:
        import aiohttp

        transient += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
        timeout += [aiohttp.ServerTimeoutError]
    except ImportError:
        pass
    return tuple(transient), tuple(permanent), tuple(timeout)


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of a botocore ClientError (or aiohttp response error) in ``exc``'s cause chain."""
    seen = 0
    while exc is not None and seen < 8:
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
        status = getattr(exc, "status", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
        exc, seen = exc.__cause__, seen + 1
    return None


def is_permanent(exc: BaseException) -> bool:
    """True when the store refuses this caller (access denied, bad or missing credentials): the
    user must fix access; no retry and no other object will fare better."""
    if isinstance(exc, BucketeerError):  # judged by this layer already (a StorageError), or not storage at all
        return False
    if isinstance(exc, PermissionError):
        return True
    status = _http_status(exc)
    return status in (401, 403) or isinstance(exc, _library_errors()[1])


def is_transient(exc: BaseException) -> bool:
    """True for failures worth retrying: throttling, timeouts, dropped connections, 5xx."""
    if isinstance(exc, (BucketeerError, FileNotFoundError, IsADirectoryError, NotADirectoryError)) or is_permanent(exc):
        return False
    status = _http_status(exc)
    if status is not None:
        return status == 429 or status >= 500
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    return isinstance(exc, _library_errors()[0])


def is_throttled(exc: BaseException) -> bool:
    """True when the store asks for fewer requests: HTTP 503 (S3 ``SlowDown``, ``ServiceUnavailable``) or
    429 (R2, ``TooManyRequests``), by the status in the cause chain, else errno EBUSY (s3fs's for both)."""
    if isinstance(exc, BucketeerError):
        return False
    status = _http_status(exc)
    if status is not None:
        return status in (429, 503)
    return isinstance(exc, OSError) and exc.errno == errno.EBUSY


def retry_after(exc: BaseException) -> float | None:
    """The seconds a throttled answer's ``Retry-After`` header asks to wait (a number of seconds, or an HTTP
    date taken against the answer's own ``Date``), found on the botocore error in ``exc``'s cause chain or
    as its ``retry_after`` attribute; None when there is none."""
    seen = 0
    while exc is not None and seen < 8:
        value = getattr(exc, "retry_after", None)
        response = getattr(exc, "response", None)
        headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}) if isinstance(response, dict) else {}
        value = headers.get("retry-after", value)
        if value is not None:
            return _seconds_after(str(value), headers.get("date"))
        exc, seen = exc.__cause__, seen + 1
    return None


def _seconds_after(value: str, date: str | None) -> float | None:
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
        now = email.utils.parsedate_to_datetime(date) if date else _dt.datetime.now(_dt.timezone.utc)
        return max(0.0, (when - now).total_seconds())
    except (TypeError, ValueError):
        return None


_throttled = [0]  # throttled answers this process has had (guarded by _lock)


def throttled_requests() -> int:
    """How many throttled answers (:func:`is_throttled`) the storage calls of this process have had so far."""
    with _lock:
        return _throttled[0]


def is_timeout(exc: BaseException) -> bool:
    """True when storage did not answer in time: a connect or read timeout (a transient failure)."""
    return isinstance(exc, _library_errors()[2]) or (isinstance(exc, OSError) and exc.errno == errno.ETIMEDOUT)


def is_storage_failure(exc: BaseException) -> bool:
    """True for the ways a storage call fails (any ``OSError``, the HTTP stack's errors), as opposed
    to a bug or a bucketeer error: what :func:`manifests.storage.call_storage` reports as storage."""
    if isinstance(exc, BucketeerError):
        return False
    return isinstance(exc, OSError) or is_transient(exc) or is_permanent(exc)


@dataclass(frozen=True)
class StorageWait:
    """A storage call failed transiently and will be tried again: ``failures`` of ``attempts``
    tries have failed, the last with ``error`` (an exception type's name), ``waited`` seconds
    after its first try started. ``throttled``: the last answer was the store's "slow down"
    (``error`` is then its HTTP status or errno name, ``failures`` the throttled answers so far)."""

    error: str
    failures: int
    attempts: int
    waited: float
    throttled: bool = False

    def describe(self) -> str:
        """``waiting for storage (ReadTimeoutError, attempt 2 of 6 failed, 62s)``, or for a throttled
        call ``storage throttling (503, 3 throttled answers, 12s)``."""
        if self.throttled:
            return f"storage throttling ({self.error}, {self.failures} throttled answer{'s' * (self.failures > 1)}, " \
                   f"{self.waited:.0f}s)"  # fmt: skip
        return f"waiting for storage ({self.error}, attempt {self.failures} of {self.attempts} failed, " \
               f"{self.waited:.0f}s)"  # fmt: skip


_listeners: "weakref.WeakSet[object]" = weakref.WeakSet()  # objects with on_storage_wait(StorageWait)
_lock = threading.Lock()
_last_warning = [-float("inf")]
WARNING_SECONDS = 10.0  # at most one "waiting for storage" warning this often, where nothing listens


def add_wait_listener(listener: object) -> None:
    """Send this process's :class:`StorageWait` notices to ``listener.on_storage_wait(wait)``
    instead of the log; held weakly, called from whichever thread retries."""
    with _lock:
        _listeners.add(listener)


def remove_wait_listener(listener: object) -> None:
    """Stop sending notices to ``listener`` (no error if it was not listening)."""
    with _lock:
        _listeners.discard(listener)


def _notify(wait: StorageWait, exc: BaseException) -> None:
    with _lock:
        listeners = list(_listeners)
        warn = not listeners and time.monotonic() - _last_warning[0] >= WARNING_SECONDS
        if warn:
            _last_warning[0] = time.monotonic()
    for listener in listeners:
        listener.on_storage_wait(wait)  # type: ignore[attr-defined]
    if warn:
        log.warning("%s: %s", wait.describe(), exc)


class _Tries:
    """One call's retries: its failures and throttled answers so far, and what to do after the next."""

    def __init__(self, policy: RetryPolicy | None):
        self.policy = policy or RetryPolicy.from_env()
        self.failures = self.throttles = 0
        self.started = time.monotonic()
        self.throttled_since: float | None = None

    def after(self, exc: BaseException) -> float | None:
        """Seconds to wait before the next try after ``exc``, or None: give up (re-raise ``exc``)."""
        policy, now = self.policy, time.monotonic()
        if is_transient(exc) and is_throttled(exc):
            with _lock:
                _throttled[0] += 1
            self.throttles += 1
            self.throttled_since = self.throttled_since or now
            asked = retry_after(exc)
            left = policy.throttle_seconds - (now - self.throttled_since)
            if left <= 0 or (asked is not None and asked > left):  # no time left, or not as much as the store asks
                return None
            delay = min(policy.throttle_delay(self.throttles, asked), left)
            status = _http_status(exc)
            error = str(status) if status is not None else errno.errorcode.get(getattr(exc, "errno", 0), "EBUSY")
            wait = StorageWait(error, self.throttles, policy.attempts, now - self.started, throttled=True)
        else:
            self.failures += 1
            if self.failures >= policy.attempts or not is_transient(exc):
                return None
            delay = policy.delay(self.failures)
            wait = StorageWait(type(exc).__name__, self.failures, policy.attempts, now - self.started)
        log.debug("transient storage error (%s), retrying in %.2f s: %s: %s", wait.describe(), delay,
                  type(exc).__name__, exc)  # fmt: skip
        _notify(wait, exc)
        return delay


def with_retries(call: Callable[[], T], policy: RetryPolicy | None = None) -> T:
    """Run ``call()``; after a transient failure wait (backoff, full jitter) and run it again.

    Makes at most ``policy.attempts`` calls that fail (default :meth:`RetryPolicy.from_env`), and
    retries throttled answers for up to ``policy.throttle_seconds`` (see the module docstring).
    Re-raises the last error when they are used up, and any non-transient error at once, unchanged.
    """
    tries = _Tries(policy)
    while True:
        try:
            return call()
        except Exception as e:
            delay = tries.after(e)
            if delay is None:
                raise
        time.sleep(delay)


async def with_retries_async(call: Callable[[], Awaitable[T]], policy: RetryPolicy | None = None) -> T:
    """:func:`with_retries` for coroutines: ``await with_retries_async(lambda: fs._cat_file(path))``.

    ``call`` makes a new awaitable per attempt (a coroutine can be awaited once); waits with
    ``asyncio.sleep``, so other reads on the loop go on meanwhile.
    """
    tries = _Tries(policy)
    while True:
        try:
            return await call()
        except Exception as e:
            delay = tries.after(e)
            if delay is None:
                raise
        await asyncio.sleep(delay)
