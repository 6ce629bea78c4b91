"""An HTTP proxy on 127.0.0.1 in front of the test S3 server (moto) that misbehaves on demand, the way a
store under load does: it throttles (S3's ``503 SlowDown``, R2's ``429`` with ``Retry-After``) a share of
the requests for a while, trickles its answers a byte at a time, drops a request's connection, or loses an
answer after the store acted on it.

    proxy = FaultProxy(s3.endpoint)                           # forwards every request as it is
    proxy = FaultProxy(s3.endpoint, latency=0.02)             # ... 20 ms later, as a store across a network
    proxy.throttle(share=0.5, seconds=3)                      # every 2nd request for 3 s: 503 SlowDown
    proxy.throttle(share=1.0, seconds=2, status=429, retry_after=1)
    proxy.throttle(share=0.5, requests=100, match=reads)      # every 2nd of the next 100 GETs and HEADs
    proxy.trickle(interval=0.3)                               # response bodies: one byte every 0.3 s
    proxy.lose_answers(1, match=lambda m, p: m == "PUT")      # the next PUT is done upstream, its answer lost
    proxy.drop_requests(1, match=lambda m, p: m == "PUT")     # the next PUT's connection drops: never sent on
    options = {"endpoint_url": proxy.endpoint}

``log`` records every request it answered as a :class:`Seen` (time, method, path, status, throttled), so a
test can count attempts per second before, during and after the faults. Threaded (one thread per client
connection, HTTP/1.1 keep-alive, ``Expect: 100-continue`` answered); each request is forwarded on a new
connection to the upstream, its body read whole first (``Content-Length`` or chunked).
"""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

__all__ = ["FaultProxy", "Seen", "reads"]

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
               "expect"}  # fmt: skip
_CODES = {503: ("SlowDown", "Please reduce your request rate."), 429: ("TooManyRequests", "Too many requests.")}


def reads(method: str, path: str) -> bool:
    """GETs and HEADs, except of a writer lock (a job's last read, after its summary is written)."""
    return method in ("GET", "HEAD") and "_writer.json" not in path


@dataclass(frozen=True)
class _Throttle:
    until: float
    requests: int | None
    share: float
    status: int
    retry_after: float | None
    match: Callable[[str, str], bool] | None


@dataclass(frozen=True)
class Seen:
    """One request the proxy answered: ``at`` (``time.monotonic()``), ``method``, ``path``, ``status``."""

    at: float
    method: str
    path: str
    status: int
    throttled: bool


class FaultProxy(ThreadingHTTPServer):
    """See the module docstring. ``endpoint`` is its URL; :meth:`close` stops it."""

    daemon_threads = True

    def __init__(self, upstream: str, latency: float = 0.0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.latency = latency  # seconds added to every answer, throttled ones too: a store's round trip
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.lock = threading.Lock()
        self.log: list[Seen] = []
        self._throttle: _Throttle | None = None
        self._counter = 0
        self._trickle: tuple[float, float, bool] | None = None  # interval, until, headers too
        self._lose: tuple[int, Callable[[str, str], bool] | None] = (0, None)  # answers still to lose, which
        self._drop: tuple[int, Callable[[str, str], bool] | None] = (0, None)  # requests still to drop, which
        threading.Thread(target=self.serve_forever, daemon=True, name="fault-proxy").start()

    def handle_error(self, request, client_address) -> None:  # a client that gave up on a trickle: quiet
        pass

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def throttle(self, share: float, seconds: float = float("inf"), status: int = 503,
                 retry_after: float | None = None, requests: int | None = None,
                 match: Callable[[str, str], bool] | None = None) -> float:  # fmt: skip
        """Answer ``share`` (0..1, spread evenly) of the requests of the next ``seconds`` (or the next
        ``requests`` of them, whichever ends first) with ``status`` (503 SlowDown or 429 TooManyRequests,
        ``Retry-After: retry_after`` when given); ``match(method, path)`` picks the requests it may throttle
        and counts (default: all). Returns the start."""
        with self.lock:
            start = time.monotonic()
            self._throttle = _Throttle(start + seconds, requests, share, status, retry_after, match)
            self._counter = 0
        return start

    def trickle(self, interval: float, seconds: float = float("inf"), headers: bool = False) -> float:
        """For the next ``seconds``, send each response body (with ``headers``: the whole response) one byte
        every ``interval`` seconds; returns the start."""
        start = time.monotonic()
        self._trickle = (interval, start + seconds, headers)
        return start

    def lose_answers(self, requests: int = 1, match: Callable[[str, str], bool] | None = None) -> None:
        """Forward the next ``requests`` requests that ``match(method, path)`` picks (default: all) to the store,
        then close the client's connection without an answer: the store did the work, its answer was lost."""
        with self.lock:
            self._lose = (requests, match)

    def drop_requests(self, requests: int = 1, match: Callable[[str, str], bool] | None = None) -> None:
        """Read the next ``requests`` requests that ``match(method, path)`` picks (default: all), then close the
        client's connection without forwarding them: the connection dropped mid-request, the store saw nothing.
        Each is logged with status 0."""
        with self.lock:
            self._drop = (requests, match)

    def _losing(self, method: str, path: str) -> bool:
        return self._count_down("_lose", method, path)

    def _dropping(self, method: str, path: str) -> bool:
        return self._count_down("_drop", method, path)

    def _count_down(self, fault: str, method: str, path: str) -> bool:
        with self.lock:
            left, match = getattr(self, fault)
            if left <= 0 or (match is not None and not match(method, path)):
                return False
            setattr(self, fault, (left - 1, match))
            return True

    def heal(self) -> None:
        """Stop every fault now."""
        with self.lock:
            self._throttle, self._trickle, self._lose, self._drop = None, None, (0, None), (0, None)

    def close(self) -> None:
        self.heal()
        self.shutdown()
        self.server_close()

    def seen(self, start: float = 0.0, end: float = float("inf")) -> list[Seen]:
        """The requests answered in ``[start, end)`` (``time.monotonic()`` seconds)."""
        with self.lock:
            return [s for s in self.log if start <= s.at < end]

    def _decide(self, method: str, path: str) -> tuple[int, float | None] | None:
        """``(status, retry_after)`` when this request is to be throttled, else None."""
        with self.lock:
            t = self._throttle
            if t is None or (t.match is not None and not t.match(method, path)):
                return None
            if time.monotonic() >= t.until or (t.requests is not None and self._counter >= t.requests):
                self._throttle = None
                return None
            i, self._counter = self._counter, self._counter + 1
            return (t.status, t.retry_after) if int((i + 1) * t.share) > int(i * t.share) else None

    def _trickling(self) -> tuple[float, bool] | None:
        trickle = self._trickle
        if trickle is None or time.monotonic() >= trickle[1]:
            return None
        return trickle[0], trickle[2]

    def _record(self, method: str, path: str, status: int, throttled: bool) -> None:
        with self.lock:
            self.log.append(Seen(time.monotonic(), method, path, status, throttled))


class _Handler(BaseHTTPRequestHandler):
    server: FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, and "100 Continue" for botocore's PUTs

    def log_message(self, *args) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self) -> None:
        body = self._body()
        if self.server._dropping(self.command, self.path):
            self.server._record(self.command, self.path, 0, False)
            self.close_connection = True  # the client hears nothing; the store never saw the request
            return
        if self.server.latency:
            time.sleep(self.server.latency)
        throttled = self.server._decide(self.command, self.path)
        if throttled is not None:
            status, retry_after = throttled
            code, message = _CODES[status]
            data = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                    "<RequestId>fault-proxy</RequestId></Error>").encode()  # fmt: skip
            headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(data)))]
            if retry_after is not None:
                headers.append(("Retry-After", f"{retry_after:g}"))
            self.server._record(self.command, self.path, status, True)
            return self._send(status, headers, b"" if self.command == "HEAD" else data)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection(*self.server.upstream, timeout=60)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            out = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
            if self.command != "HEAD":
                out = [(k, v) for k, v in out if k.lower() != "content-length"] + [("Content-Length", str(len(data)))]
            status = response.status
        finally:
            upstream.close()
        self.server._record(self.command, self.path, status, False)
        if self.server._losing(self.command, self.path):
            self.close_connection = True  # the store did it; the client hears nothing
            return
        self._send(status, out, data)

    def _send(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
        lines = [f"HTTP/1.1 {status} {http.client.responses.get(status, 'Unknown')}"]
        lines += [f"{k}: {v}" for k, v in headers]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        trickle = self.server._trickling()
        if trickle is None:
            self.wfile.write(head + data)
            self.wfile.flush()
            return
        interval, whole = trickle
        raw, start = head + data, 0 if whole else len(head)
        self.wfile.write(raw[:start])
        for i in range(start, len(raw)):
            self.wfile.flush()
            time.sleep(interval)
            self.wfile.write(raw[i : i + 1])
        self.wfile.flush()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward
