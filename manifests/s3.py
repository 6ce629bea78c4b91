"""s3fs with its own retries off and every request bounded in time, so that :mod:`manifests.retry`
is the only retry layer and a hung endpoint is a failure it can retry, not a hang.

Retries. s3fs retries inside every call (``S3FileSystem.retries = 5`` tries, and ``cat_file`` nests
two such loops), and botocore retries again below it; over bucketeer's own loop a throttled read
could be sent ~150 times. :class:`SingleAttemptS3FileSystem` tries once (the class attribute s3fs
reads; it is no constructor option) and :func:`manifests.storage.open_url` sets botocore's
``retries={"total_max_attempts": 1}`` unless the user's ``config_kwargs`` say otherwise.

Timeouts. :func:`manifests.storage.open_url` puts botocore's ``connect_timeout`` and
``read_timeout`` (:func:`storage_timeouts`: ``$BUCKETEER_STORAGE_CONNECT_TIMEOUT``, default 10 s,
``$BUCKETEER_STORAGE_READ_TIMEOUT``, default 60 s) into ``config_kwargs`` unless the user's
``--storage-options`` set them, so they travel with a pickled filesystem to Ray workers. aiohttp
applies them as ``sock_connect`` and ``sock_read``, but ``sock_read`` only starts once a request's
body is sent: an upload (every PUT botocore makes carries ``Expect: 100-continue``) waits for the
server's ``100 Continue``, and then for its socket to drain, with no timer at all. A frozen endpoint
that accepts connections hung ``embed`` that way for good. :class:`UploadWatchdogSession` closes
that gap: a request with a body fails with botocore's ``ReadTimeoutError`` when it makes no progress
(the body is not read on, no response arrives) for ``connect + read`` seconds. (aiohttp's own
``sock_read`` still starts once the last of the body is handed to the kernel, whose send buffer
must drain within the read timeout: on a link slower than ~100 kB/s, raise the read timeout.)

Slow drips. A read timeout bounds the wait for the *next* bytes, so an endpoint that sends a byte
every few seconds never trips it and holds a read for hours. So every answer is also held to a
rate floor (:func:`rate_floor`: ``$BUCKETEER_STORAGE_MIN_RATE`` bytes per second, default 10,000,
over each ``$BUCKETEER_STORAGE_RATE_WINDOW`` seconds, default 30; ``0`` switches it off): a request
without a body must have its answer's headers (and, but for a GET's body, the whole answer) within
``connect + read`` seconds, and a GET's body must bring ``rate x window`` bytes in every whole window
until it ends (:class:`RateFloor`); else it fails with :class:`SlowResponseError`, a botocore
``ReadTimeoutError`` that says what came, retried as any timeout and reported in the same one line.
An answer that ends within its first window is never judged, so small reads of a slow store pass.
obstore's GETs are held to the same floor (:mod:`manifests.objstore`).

A class rather than an attribute set on an instance: a filesystem that is pickled (to a Ray task,
a DataLoader worker) is rebuilt from its constructor arguments, and an instance attribute would
be lost on the way. Imported only for ``s3://`` URLs, so ``manifests`` loads without botocore.
"""

from __future__ import annotations

import asyncio
import functools
import io
import math
import os
import time
from typing import Callable

import wrapt
from aiobotocore.httpsession import AIOHTTPSession
from botocore.exceptions import ReadTimeoutError
from s3fs import S3FileSystem

from manifests.errors import UsageError

__all__ = [
    "BOTOCORE_RETRIES",
    "CONNECT_TIMEOUT_ENV",
    "READ_TIMEOUT_ENV",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_READ_TIMEOUT",
    "MIN_RATE_ENV",
    "RATE_WINDOW_ENV",
    "RateFloor",
    "SingleAttemptS3FileSystem",
    "SlowResponseError",
    "WatchdogSession",
    "rate_floor",
    "storage_timeouts",
]

# one attempt per request in botocore ("standard" mode; total_max_attempts counts the first try)
BOTOCORE_RETRIES = {"total_max_attempts": 1, "mode": "standard"}

CONNECT_TIMEOUT_ENV = "BUCKETEER_STORAGE_CONNECT_TIMEOUT"
READ_TIMEOUT_ENV = "BUCKETEER_STORAGE_READ_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 60.0
MIN_RATE_ENV = "BUCKETEER_STORAGE_MIN_RATE"
RATE_WINDOW_ENV = "BUCKETEER_STORAGE_RATE_WINDOW"
DEFAULT_MIN_RATE = 10_000.0  # bytes per second: a link a hundred times slower than a slow one
DEFAULT_RATE_WINDOW = 30.0


def storage_timeouts() -> tuple[float, float]:
    """``(connect, read)`` timeouts in seconds for every S3 request: the defaults (10, 60) or
    ``$BUCKETEER_STORAGE_CONNECT_TIMEOUT`` / ``$BUCKETEER_STORAGE_READ_TIMEOUT``.

    Raises UsageError naming the variable when a value is not a number of seconds > 0.
    """
    out = []
    for name, default in ((CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT), (READ_TIMEOUT_ENV, DEFAULT_READ_TIMEOUT)):
        text = os.environ.get(name, "").strip()
        try:
            value = float(text) if text else default
        except ValueError:
            value = math.nan
        if not 0 < value < math.inf:
            raise UsageError(f"{name}={text!r}: give the timeout in seconds, a number > 0 (default {default:g})")
        out.append(value)
    return out[0], out[1]


def rate_floor() -> tuple[float, float]:
    """``(bytes per second, window seconds)`` every answer must keep to: the defaults (10,000, 30) or
    ``$BUCKETEER_STORAGE_MIN_RATE`` / ``$BUCKETEER_STORAGE_RATE_WINDOW``; a rate of 0: no floor.

    Raises UsageError naming the variable when a value is not a number in range.
    """
    # read on every GET (a test or job may change the variables between reads): parsed once per text
    return _rate_floor(os.environ.get(MIN_RATE_ENV, ""), os.environ.get(RATE_WINDOW_ENV, ""))


@functools.lru_cache(maxsize=16)
def _rate_floor(rate_text: str, window_text: str) -> tuple[float, float]:
    out = []
    for name, default, low, raw in ((MIN_RATE_ENV, DEFAULT_MIN_RATE, 0.0, rate_text),
                                    (RATE_WINDOW_ENV, DEFAULT_RATE_WINDOW, 1e-9, window_text)):  # fmt: skip
        text = raw.strip()
        try:
            value = float(text) if text else default
        except ValueError:
            value = math.nan
        if not low <= value < math.inf:
            unit = "bytes per second, 0 for no floor" if name == MIN_RATE_ENV else "seconds, > 0"
            raise UsageError(f"{name}={text!r}: give a number ({unit}; default {default:g})")
        out.append(value)
    return out[0], out[1]


class SlowResponseError(ReadTimeoutError):
    """An answer that came slower than the rate floor (:func:`rate_floor`): a read timeout, retried as one,
    whose message says how many bytes came in the last window."""

    fmt = 'Read timeout on endpoint URL: "{endpoint_url}": {error}'


class RateFloor:
    """One answer's bytes against the floor: :meth:`check` with the bytes received so far, after each chunk or
    window, raises :class:`SlowResponseError` once a whole window has passed that brought less than
    ``rate x window`` bytes. ``clock``: seconds, monotonic."""

    def __init__(self, url: str, rate: float, window: float, clock: Callable[[], float] = time.monotonic):
        self.url, self.rate, self.window, self.clock = url, rate, window, clock
        self.window_end, self.at_window_start = clock() + window, 0

    def check(self, received: int) -> None:
        """Judge the windows that have ended, ``received`` bytes having come in all."""
        while self.clock() >= self.window_end:
            got = received - self.at_window_start
            if got < self.rate * self.window:
                raise SlowResponseError(endpoint_url=self.url, error=(
                    f"{got:,} bytes in the last {self.window:g} s, below the floor of {self.rate:,.0f} bytes/s "
                    f"(${MIN_RATE_ENV}, ${RATE_WINDOW_ENV})"))  # fmt: skip
            self.at_window_start, self.window_end = received, self.window_end + self.window

    def seconds_left(self) -> float:
        """Seconds until the current window ends (when :meth:`check` must be called again)."""
        return max(0.0, self.window_end - self.clock())


class SingleAttemptS3FileSystem(S3FileSystem):
    """``s3fs.S3FileSystem`` that makes one attempt per call (bucketeer retries above it) and
    whose requests are bounded in time (:class:`WatchdogSession`, unless the user's
    ``config_kwargs`` name another ``http_session_cls``)."""

    retries = 1

    def _prepare_config_kwargs(self) -> dict:
        config_kwargs = super()._prepare_config_kwargs()
        config_kwargs.setdefault("http_session_cls", WatchdogSession)
        return config_kwargs


class _Progress(wrapt.ObjectProxy):
    """A request body that notes the time whenever the HTTP client reads on in it."""

    def __init__(self, body: io.IOBase, stamp: list[float]):
        super().__init__(body)
        self._self_stamp = stamp

    def read(self, *args):
        self._self_stamp[0] = time.monotonic()
        return self.__wrapped__.read(*args)


class WatchdogSession(AIOHTTPSession):
    """aiobotocore's aiohttp session, with bounds on requests that send a body and on slow answers.

    aiohttp's ``sock_read`` timer starts only after the body is written, so a PUT to a server that
    never answers its ``Expect: 100-continue`` (or stops reading the body) waits forever. Here such
    a request is cancelled and raises botocore's ``ReadTimeoutError`` (a transient failure for
    :mod:`manifests.retry`) once ``connect + read`` seconds pass with no progress: from the start,
    and again from each chunk of the body the client reads; the response headers end the watch.
    A request without a body must have its answer within ``connect + read`` seconds (a GET: its
    headers), and a GET's body is held to the rate floor (:class:`RateFloor`) by a watcher that
    fails the body's stream with :class:`SlowResponseError`.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        connect, read = self._timeout.sock_connect, self._timeout.sock_read
        self._stall = connect + read if connect and read else None  # None: the user switched a timeout off
        self._floor = rate_floor()
        self._watchers: set[asyncio.Task] = set()  # held here: the loop keeps only weak references to tasks

    async def send(self, request):
        if self._stall is None:
            return await super().send(request)
        if isinstance(request.body, io.IOBase):
            return await self._send_body(request)
        if self._floor[0] <= 0:  # no floor: sock_connect and sock_read alone
            return await super().send(request)
        try:
            response = await asyncio.wait_for(super().send(request), self._stall)
        except asyncio.TimeoutError:
            raise SlowResponseError(endpoint_url=request.url, error=(
                f"no answer within {self._stall:g} s (connect + read timeout)")) from None  # fmt: skip
        if request.stream_output:
            self._watch(response.raw, request.url)
        return response

    def _watch(self, raw, url: str) -> None:
        """Hold the body of ``raw`` (aiohttp's response) to the rate floor until it ends or is released."""
        floor, content = RateFloor(url, *self._floor), raw.content

        async def watch() -> None:
            while not (content.is_eof() or raw.closed or content.exception() is not None):
                try:
                    floor.check(content.total_bytes)
                except SlowResponseError as e:
                    content.set_exception(e)  # the pending read raises it; the reader then closes the response
                    return
                await asyncio.sleep(floor.seconds_left() + 0.01)

        task = asyncio.ensure_future(watch())
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _send_body(self, request):
        stamp = [time.monotonic()]
        request.body = _Progress(request.body, stamp)
        sending = asyncio.ensure_future(super().send(request))
        try:
            while not sending.done():
                idle = time.monotonic() - stamp[0]
                if idle >= self._stall:
                    sending.cancel()
                    error = TimeoutError(f"no progress on a request with a body for {idle:.1f} s")
                    raise ReadTimeoutError(endpoint_url=request.url, error=error)
                await asyncio.wait({sending}, timeout=self._stall - idle)
            return sending.result()
        finally:
            if not sending.done():  # we were cancelled, or timed out: the request goes too
                sending.cancel()
