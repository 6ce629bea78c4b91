"""The one retry layer: classification by type and errno, the attempt budget, and every read path
against an S3-compatible endpoint (a tiny HTTP server on 127.0.0.1) that fails on purpose."""

from __future__ import annotations

import asyncio
import errno
import random
import threading
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from manifests.cache import CacheReader, read_cache_meta
from manifests.errors import MissingError, StorageError, UsageError
from manifests.retry import RetryPolicy, is_permanent, is_transient, with_retries, with_retries_async
from manifests.storage import open_url, read_json, write_bytes_atomic
from pipeline.embed.imaging import fetch_all
from pipeline.sources.listing import WorkItem
from pipeline.sources.reading import probe_files
from pipeline.sources.listing import list_source
from tests.test_cache_format import build_cache

SECRET = "retry-test-secret-value"  # must never appear in an error
BUDGET = 4  # attempts per operation in these tests (the default is 6)

_ERRORS = {
    503: ("SlowDown", "Please reduce your request rate."),
    403: ("AccessDenied", "Access Denied"),
    500: ("InternalError", "We encountered an internal error. Please try again."),
}


class FakeS3(ThreadingHTTPServer):
    """Serves the files of ``root`` as bucket ``b`` (GET with Range, HEAD, PUT; listings are empty),
    except that the next ``fail_next`` requests (``-1``: all of them) get the S3 error of status
    ``fail_status``. ``requests`` records ``(method, path, status)`` of every request."""

    daemon_threads = True

    def __init__(self, root: Path):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.fail_status, self.fail_next = 500, 0
        self.requests: list[tuple[str, str, int]] = []
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def reset(self, fail_next: int = 0, status: int = 500) -> None:
        with self.lock:
            self.fail_status, self.fail_next, self.requests = status, fail_next, []

    def failed(self) -> int:
        return sum(1 for *_, status in self.requests if status >= 400)


class _Handler(BaseHTTPRequestHandler):
    server: FakeS3
    protocol_version = "HTTP/1.1"  # keep-alive, and "100 Continue" for botocore's PUTs

    def log_message(self, *args) -> None:  # quiet
        pass

    def _fail(self) -> int | None:
        with self.server.lock:
            if self.server.fail_next == 0:
                return None
            self.server.fail_next -= self.server.fail_next > 0
            return self.server.fail_status

    def _reply(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        with self.server.lock:
            self.server.requests.append((self.command, self.path, status))
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int) -> None:
        code, message = _ERRORS.get(status, ("NoSuchKey", "The specified key does not exist."))
        body = f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>' \
               f"<RequestId>fake</RequestId></Error>".encode()  # fmt: skip
        self._reply(status, body, {"Content-Type": "application/xml"})

    def _file(self) -> Path:
        return self.server.root / self.path.split("?")[0].lstrip("/").removeprefix("b/")

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        status = self._fail()
        if status:
            return self._error(status)
        if "list-type=2" in self.path:
            body = b"<ListBucketResult><Name>b</Name><KeyCount>0</KeyCount><IsTruncated>false</IsTruncated>" \
                   b"</ListBucketResult>"  # fmt: skip
            return self._reply(200, body, {"Content-Type": "application/xml"})
        path = self._file()
        if not path.is_file():
            return self._error(404)
        data = path.read_bytes()
        headers = {"ETag": '"fake"', "Last-Modified": formatdate(path.stat().st_mtime, usegmt=True)}
        wanted = self.headers.get("Range")
        if wanted:  # "bytes=START-" or "bytes=START-END" (inclusive)
            start, _, end = wanted.removeprefix("bytes=").partition("-")
            stop = int(end) + 1 if end else len(data)
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
            return self._reply(206, data[int(start) : stop], headers)
        self._reply(200, data, headers)

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status = self._fail()
        if status:
            return self._error(status)
        path = self._file()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
        self._reply(200, headers={"ETag": '"fake"'})


@pytest.fixture(scope="module")
def fake_s3(tmp_path_factory):
    """A FakeS3 holding a small committed cache at ``s3://b/cache`` and an image at ``s3://b/ds``."""
    root = tmp_path_factory.mktemp("fake-s3")
    build_cache(str(root / "cache"), n=6, shard_records=4)
    (root / "ds").mkdir()
    (root / "ds" / "img.png").write_bytes(bytes(100))
    server = FakeS3(root)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def s3_fails(fake_s3, monkeypatch, s3_client):
    """The fake endpoint, reset, with BUDGET attempts and millisecond backoff for this test."""
    monkeypatch.setenv("BUCKETEER_STORAGE_ATTEMPTS", str(BUDGET))
    monkeypatch.setenv("BUCKETEER_STORAGE_RETRY_DELAY", "0.001")
    fake_s3.reset()
    return fake_s3


def options(server: FakeS3) -> dict:
    return {"endpoint_url": server.endpoint, "key": "retry-test-key", "secret": SECRET}


# --- classification -----------------------------------------------------------------------------


def test_transient_and_permanent_are_told_by_type_and_errno_never_by_text():
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError, ReadTimeoutError

    assert is_transient(OSError(errno.EBUSY, "SlowDown"))  # s3fs: SlowDown, ServiceUnavailable, 503
    assert is_transient(OSError(errno.EREMOTEIO, "InternalError"))  # s3fs: InternalError, 500
    assert is_transient(TimeoutError()) and is_transient(ConnectionResetError(errno.ECONNRESET, "reset"))
    assert is_transient(ReadTimeoutError(endpoint_url="http://x"))
    assert is_transient(EndpointConnectionError(endpoint_url="http://x"))
    # message text decides nothing: a SlowDown text without its errno, a file named like a timeout
    assert not is_transient(OSError("An error occurred (SlowDown): reduce your request rate"))
    assert not is_transient(FileNotFoundError(errno.ENOENT, "timeout_503.jpg"))
    # s3fs maps codes it has no errno for to EIO; the botocore error it came from carries the HTTP status
    def s3fs_eio(status: int) -> OSError:
        error = OSError(errno.EIO, "an S3 error s3fs has no errno for")
        error.__cause__ = ClientError({"Error": {"Code": str(status)}, "ResponseMetadata": {"HTTPStatusCode": status}},
                                      "GetObject")  # fmt: skip
        return error

    bad_gateway, bad_request = s3fs_eio(502), s3fs_eio(400)
    assert is_transient(bad_gateway) and not is_transient(bad_request) and is_transient(OSError(errno.EIO, "x"))
    assert is_permanent(PermissionError(errno.EACCES, "Access Denied")) and not is_transient(PermissionError())
    assert is_permanent(NoCredentialsError()) and not is_permanent(FileNotFoundError("NoSuchBucket"))
    # our own errors have been through the layer already
    wrapped = StorageError("reading s3://b/k: still failing")
    wrapped.__cause__ = OSError(errno.EBUSY, "SlowDown")
    assert not is_transient(wrapped) and not is_transient(UsageError("bad option"))


def test_with_retries_makes_exactly_the_attempts_of_its_policy(monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr("manifests.retry.time.sleep", waits.append)
    policy = RetryPolicy(attempts=5, base_delay=0.1, max_delay=0.3)
    calls = []

    def failing():
        calls.append(1)
        raise OSError(errno.EREMOTEIO, "InternalError")

    with pytest.raises(OSError) as e:
        with_retries(failing, policy)
    assert e.value.errno == errno.EREMOTEIO and len(calls) == 5 and len(waits) == 4
    assert all(0 <= w <= cap for w, cap in zip(waits, [0.1, 0.2, 0.3, 0.3]))  # backoff, capped, jittered

    calls.clear()

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError(errno.ECONNRESET, "reset")
        return "ok"

    assert with_retries(flaky, policy) == "ok" and len(calls) == 3
    calls.clear()

    def denied():
        calls.append(1)
        raise PermissionError(errno.EACCES, "denied")

    with pytest.raises(PermissionError):
        with_retries(denied, policy)
    assert len(calls) == 1


def test_the_async_variant_counts_the_same():
    calls = []

    async def failing():
        calls.append(1)
        raise OSError(errno.EREMOTEIO, "InternalError")

    with pytest.raises(OSError):
        asyncio.run(with_retries_async(failing, RetryPolicy(attempts=3, base_delay=0.001)))
    assert len(calls) == 3

    async def fine():
        return 7

    assert asyncio.run(with_retries_async(fine)) == 7


def _client_error(status: int, code: str, headers: dict | None = None) -> OSError:
    """What s3fs raises for an S3 error answer: an OSError whose cause is botocore's ClientError."""
    from botocore.exceptions import ClientError

    error = OSError(errno.EBUSY if status == 503 else errno.EIO, f"an S3 {code}")
    error.__cause__ = ClientError({"Error": {"Code": code}, "ResponseMetadata": {
        "HTTPStatusCode": status, "HTTPHeaders": headers or {}}}, "GetObject")  # fmt: skip
    return error


def test_throttling_is_told_by_status_and_errno_and_retry_after_is_read_from_the_answer():
    from manifests.objstore import translate
    from manifests.retry import is_throttled, retry_after

    assert is_throttled(OSError(errno.EBUSY, "any text"))  # s3fs: SlowDown, ServiceUnavailable, 503
    assert is_throttled(_client_error(429, "TooManyRequests")) and is_throttled(_client_error(503, "SlowDown"))
    assert not is_throttled(_client_error(500, "InternalError")) and not is_throttled(OSError(errno.EIO, "x"))
    assert not is_throttled(OSError("An error occurred (SlowDown): reduce your request rate"))  # text decides nothing
    assert not is_throttled(PermissionError(errno.EACCES, "denied")) and not is_throttled(TimeoutError())
    obstore_429 = translate(OSError("Generic S3 error: ... status code: 429 Too Many Requests"), "b/k")
    assert is_throttled(obstore_429) and is_transient(obstore_429)
    assert retry_after(_client_error(429, "TooManyRequests", {"retry-after": "7"})) == 7.0
    dated = {"retry-after": "Wed, 21 Oct 2026 07:28:30 GMT", "date": "Wed, 21 Oct 2026 07:28:00 GMT"}
    assert retry_after(_client_error(503, "SlowDown", dated)) == 30.0  # against the answer's own clock
    assert retry_after(_client_error(503, "SlowDown")) is None and retry_after(OSError(errno.EBUSY, "x")) is None


class FakeClock:
    """``time.monotonic`` and ``time.sleep`` of manifests.retry: a sleep moves the clock, nothing waits."""

    def __init__(self, monkeypatch):
        self.now, self.sleeps = 1000.0, []
        monkeypatch.setattr("manifests.retry.time.monotonic", lambda: self.now)
        monkeypatch.setattr("manifests.retry.time.sleep", self.sleep)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_throttled_answers_back_off_exponentially_for_the_throttle_time_not_the_attempts(monkeypatch):
    from manifests.retry import throttled_requests

    clock = FakeClock(monkeypatch)
    random.seed(40)  # the jitter: this test's waits are the same every run
    policy = RetryPolicy(attempts=3, base_delay=0.1, throttle_seconds=300.0)
    calls, before = [], throttled_requests()

    def throttled_then_fine():
        calls.append(clock.now)
        if len(calls) <= 12:  # 12 throttled answers: 4 times the attempts, and still not given up
            raise _client_error(503, "SlowDown")
        return "ok"

    assert with_retries(throttled_then_fine, policy) == "ok"
    assert len(calls) == 13 and throttled_requests() - before == 12
    caps = [min(20.0, 0.1 * 2**n) for n in range(12)]  # exponential, capped at 20 s, full jitter under it
    assert all(0 <= wait <= cap for wait, cap in zip(clock.sleeps, caps))
    assert sum(clock.sleeps) > 20  # the waits grew: most of the late ones are seconds (full jitter: uniform)

    calls.clear()

    def throttled_for_good():
        calls.append(clock.now)
        raise _client_error(429, "TooManyRequests")

    start = clock.now
    with pytest.raises(OSError):
        with_retries(throttled_for_good, policy)
    assert clock.now - start == pytest.approx(300.0) and len(calls) > policy.attempts  # the throttle time, no less

    clock.sleeps.clear()
    calls.clear()

    def asks_to_wait():
        calls.append(1)
        if len(calls) < 3:
            raise _client_error(429, "TooManyRequests", {"retry-after": "5"})
        return "ok"

    assert with_retries(asks_to_wait, policy) == "ok" and clock.sleeps == [5.0, 5.0]  # at least what it asked
    start, calls[:] = clock.now, []

    def asks_too_much():
        calls.append(1)
        raise _client_error(503, "SlowDown", {"retry-after": "3600"})

    with pytest.raises(OSError):
        with_retries(asks_too_much, policy)
    assert len(calls) == 1 and clock.now == start  # a Retry-After past the throttle time gives up at once


def test_a_call_that_is_throttled_and_failing_uses_attempts_only_for_the_failures(monkeypatch):
    clock = FakeClock(monkeypatch)
    policy = RetryPolicy(attempts=3, base_delay=0.01)
    answers = [_client_error(503, "SlowDown"), OSError(errno.EREMOTEIO, "InternalError")] * 2 + \
        [_client_error(503, "SlowDown")] * 3 + [OSError(errno.EREMOTEIO, "InternalError")]  # fmt: skip
    calls = []

    def call():
        calls.append(1)
        raise answers[len(calls) - 1]

    with pytest.raises(OSError) as e:
        with_retries(call, policy)
    assert e.value.errno == errno.EREMOTEIO and len(calls) == len(answers)  # the 3rd failure ends it
    assert len(clock.sleeps) == len(answers) - 1


def test_the_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("BUCKETEER_STORAGE_ATTEMPTS", raising=False)
    monkeypatch.delenv("BUCKETEER_STORAGE_RETRY_DELAY", raising=False)
    monkeypatch.delenv("BUCKETEER_STORAGE_THROTTLE_SECONDS", raising=False)
    assert RetryPolicy.from_env() == RetryPolicy(attempts=6, base_delay=0.1, max_delay=5.0)
    monkeypatch.setenv("BUCKETEER_STORAGE_ATTEMPTS", "3")
    monkeypatch.setenv("BUCKETEER_STORAGE_RETRY_DELAY", "0.5")
    assert RetryPolicy.from_env() == RetryPolicy(attempts=3, base_delay=0.5)
    monkeypatch.setenv("BUCKETEER_STORAGE_THROTTLE_SECONDS", "45")
    assert RetryPolicy.from_env() == RetryPolicy(attempts=3, base_delay=0.5, throttle_seconds=45.0)
    monkeypatch.setenv("BUCKETEER_STORAGE_ATTEMPTS", "0")
    with pytest.raises(UsageError, match="BUCKETEER_STORAGE_ATTEMPTS"):
        RetryPolicy.from_env()
    monkeypatch.setenv("BUCKETEER_STORAGE_ATTEMPTS", "3")
    monkeypatch.setenv("BUCKETEER_STORAGE_THROTTLE_SECONDS", "soon")
    with pytest.raises(UsageError, match="BUCKETEER_STORAGE_THROTTLE_SECONDS='soon'"):
        RetryPolicy.from_env()


# --- against an endpoint that fails every request ------------------------------------------------


def test_a_failing_cache_is_asked_exactly_the_budget_then_names_the_object(s3_fails):
    s3_fails.reset(fail_next=-1)
    with pytest.raises(StorageError) as e:
        read_cache_meta("s3://b/cache", options(s3_fails))
    assert len(s3_fails.requests) == BUDGET  # not BUDGET x s3fs's 5 x 5 x botocore's
    message = str(e.value)
    assert "s3://b/cache/_cache.json" in message and f"still failing after {BUDGET} attempts" in message
    assert SECRET not in message


def test_the_trainers_record_reads_are_asked_exactly_the_budget(s3_fails):
    reader = CacheReader("s3://b/cache", {**options(s3_fails), "max_concurrency": 1})  # as the trainer opens it
    sample_id = int(reader.sample_ids[0])
    assert reader.read([sample_id])[0].sample_id == sample_id
    s3_fails.reset(fail_next=-1)
    with pytest.raises(StorageError, match=f"sample {sample_id} from s3://b/cache/shards/"):
        reader.read([sample_id])
    assert len(s3_fails.requests) == BUDGET  # one ranged read: its caption's text is in the reader's LRU
    assert all(method == "GET" for method, *_ in s3_fails.requests)  # ranged reads: never a HEAD


@pytest.mark.parametrize("path", ["header probe", "image fetch", "listing", "write"])
def test_every_storage_path_is_asked_exactly_the_budget(s3_fails, path):
    fs, root = open_url("s3://b/ds", options(s3_fails))
    s3_fails.reset(fail_next=-1)
    if path == "header probe":  # the scan: a transient failure that outlives the budget is a read_failed row
        rows = probe_files(fs, root, [WorkItem("img.png", 100, True)]).to_pydict()
        assert rows["error"] == ["read_failed"] and f"[Errno {errno.EREMOTEIO}]" in rows["message"][0]
    elif path == "image fetch":  # the embed job: the error comes back per image
        (blob,) = fetch_all(fs, [f"{root}/img.png"])
        assert isinstance(blob, OSError) and blob.errno == errno.EREMOTEIO
    elif path == "listing":
        with pytest.raises(OSError):
            list_source(fs, root)
    else:
        with pytest.raises(StorageError, match="writing s3://b/ds/new.json"):
            write_bytes_atomic(fs, f"{root}/new.json", b"{}")
    assert len(s3_fails.requests) == BUDGET


def test_access_denied_is_asked_once_and_named_without_credentials(s3_fails):
    s3_fails.reset(fail_next=-1, status=403)
    with pytest.raises(StorageError) as e:
        read_cache_meta("s3://b/cache", options(s3_fails))
    assert len(s3_fails.requests) == 1
    message = str(e.value)
    assert "reading s3://b/cache/_cache.json: PermissionError" in message and "check the credentials" in message
    assert SECRET not in message


def test_a_transient_error_then_success_reads_the_object(s3_fails):
    s3_fails.reset(fail_next=2, status=500)
    assert read_cache_meta("s3://b/cache", options(s3_fails)).kind == "bucketeer.cache"
    assert s3_fails.failed() == 2 and s3_fails.requests[-1][2] == 200


def test_a_missing_object_is_asked_once_and_stays_a_file_not_found(s3_fails):
    fs, root = open_url("s3://b/cache", options(s3_fails))
    with pytest.raises(FileNotFoundError) as e:
        read_json(fs, f"{root}/nothing.json")
    assert not isinstance(e.value, (StorageError, MissingError))
    statuses = [status for *_, status in s3_fails.requests]
    assert statuses[0] == 404 and statuses.count(404) == 1  # asked once: no retry (newer s3fs then lists the key)
    with pytest.raises(MissingError, match="has no _cache.json"):
        read_cache_meta("s3://b/ds", options(s3_fails))  # a folder that is not a cache


def test_s3fs_and_botocore_make_one_attempt_each_and_a_user_setting_wins(s3_fails):
    fs, _ = open_url("s3://b/cache", options(s3_fails))
    assert fs.retries == 1 and fs.config_kwargs["retries"]["total_max_attempts"] == 1
    mine = {"retries": {"total_max_attempts": 3, "mode": "adaptive"}}
    fs, _ = open_url("s3://b/cache", {**options(s3_fails), "config_kwargs": mine})
    assert fs.config_kwargs["retries"] == mine["retries"]
