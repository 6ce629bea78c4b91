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

A class rather than an attribute set on an instance: a filesystem that is pickled (to a Ray task,
a DataLoader worker) is rebuilt from its constructor arguments, and an instance attribute would
be lost on the way. Imported only for ``s3://`` URLs, so ``manifests`` loads without botocore.
"""

from __future__ import annotations

import asyncio
import io
import math
import os
import time

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
    "SingleAttemptS3FileSystem",
    "UploadWatchdogSession",
    "storage_timeouts",
]

# one attempt per request in botocore ("standard" mode; total_max_attempts counts the first try)
BOTOCORE_RETRIES = {"total_max_attempts": 1, "mode": "standard"}

CONNECT_TIMEOUT_ENV = "BUCKETEER_STORAGE_CONNECT_TIMEOUT"
READ_TIMEOUT_ENV = "BUCKETEER_STORAGE_READ_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_READ_TIMEOUT = 60.0


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


class SingleAttemptS3FileSystem(S3FileSystem):
    """``s3fs.S3FileSystem`` that makes one attempt per call (bucketeer retries above it) and
    whose uploads are bounded in time (:class:`UploadWatchdogSession`, unless the user's
    ``config_kwargs`` name another ``http_session_cls``)."""

    retries = 1

    def _prepare_config_kwargs(self) -> dict:
        config_kwargs = super()._prepare_config_kwargs()
        config_kwargs.setdefault("http_session_cls", UploadWatchdogSession)
        return config_kwargs


class _Progress(wrapt.ObjectProxy):
    """A request body that notes the time whenever the HTTP client reads on in it."""

    def __init__(self, body: io.IOBase, stamp: list[float]):
        super().__init__(body)
        self._self_stamp = stamp

    def read(self, *args):
        self._self_stamp[0] = time.monotonic()
        return self.__wrapped__.read(*args)


class UploadWatchdogSession(AIOHTTPSession):
    """aiobotocore's aiohttp session, with a bound on requests that send a body.

    aiohttp's ``sock_read`` timer starts only after the body is written, so a PUT to a server that
    never answers its ``Expect: 100-continue`` (or stops reading the body) waits forever. Here such
    a request is cancelled and raises botocore's ``ReadTimeoutError`` (a transient failure for
    :mod:`manifests.retry`) once ``connect + read`` seconds pass with no progress: from the start,
    and again from each chunk of the body the client reads; the response headers end the watch,
    and the response body is aiohttp's ``sock_read`` again. Body-less requests (reads) are left to
    ``sock_connect`` and ``sock_read`` alone.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        connect, read = self._timeout.sock_connect, self._timeout.sock_read
        self._stall = connect + read if connect and read else None  # None: the user switched a timeout off

    async def send(self, request):
        if self._stall is None or not isinstance(request.body, io.IOBase):
            return await super().send(request)
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
