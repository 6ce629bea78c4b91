"""A hung endpoint: storage that accepts connections and never answers (a frozen proxy).

Every S3 request has a connect and a read timeout, uploads (PUT with ``Expect: 100-continue``)
included, so a read, an upload and a whole command fail with a one-line StorageError naming the
endpoint within ``attempts x (connect + read) + backoff`` seconds, the bound the README states,
instead of hanging. A TCP proxy on 127.0.0.1 stands in front of the session's moto server and is
frozen on purpose; the timeouts here are a second or less, so the file runs in ~15 s.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from manifests.errors import StorageError
from manifests.progress import Progress
from manifests.retry import StorageWait, is_timeout, is_transient
from manifests.storage import open_url, read_bytes, write_bytes_atomic

pytestmark = pytest.mark.s3

ROOT = Path(__file__).resolve().parents[1]
ATTEMPTS, CONNECT, READ, DELAY = 2, 0.5, 1.0, 0.01
BOUND = ATTEMPTS * (CONNECT + READ) + DELAY  # the README's formula, with this file's settings
SLACK = 2.0  # scheduling on a loaded machine; the bound itself is a few seconds
ENV = {"BUCKETEER_STORAGE_ATTEMPTS": str(ATTEMPTS), "BUCKETEER_STORAGE_RETRY_DELAY": str(DELAY),
       "BUCKETEER_STORAGE_CONNECT_TIMEOUT": str(CONNECT), "BUCKETEER_STORAGE_READ_TIMEOUT": str(READ)}  # fmt: skip
SECRET = "hang-test-secret-value"


class FrozenProxy:
    """Forwards TCP connections on 127.0.0.1 to ``target_port`` until :meth:`freeze`; from then on
    it still accepts connections, and reads what they send unless ``deaf`` (then the sender's
    socket fills up), but answers nothing and passes nothing on. ``rate`` (bytes/s) slows what
    clients send down to a slow link. ``heads`` holds the first bytes of every request seen."""

    def __init__(self, target_port: int, deaf: bool = False, rate: float | None = None):
        self.target_port, self.deaf, self.rate = target_port, deaf, rate
        self.frozen, self.closed = threading.Event(), threading.Event()
        self.heads: list[bytes] = []
        self.sockets: list[socket.socket] = []
        self.listener = socket.socket()
        if rate:  # a slow link has no megabytes of loopback buffers to hide in
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> float:
        """Stop answering; returns the moment (``time.monotonic()``)."""
        self.frozen.set()
        return time.monotonic()

    def close(self) -> None:
        self.closed.set()
        for s in [self.listener, *self.sockets]:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.sockets.append(client)
            upstream = None if self.frozen.is_set() else socket.create_connection(("127.0.0.1", self.target_port))
            if upstream is not None:
                self.sockets.append(upstream)
                threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket | None, requests: bool) -> None:
        while not self.closed.is_set():
            if self.frozen.is_set() and self.deaf:
                self.closed.wait()  # read nothing more: the peer's writes back up
                return
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                return
            if requests and data[:4] in (b"GET ", b"PUT ", b"HEAD", b"POST"):
                self.heads.append(data[:4096])
            if not self.frozen.is_set() and sink is not None:
                try:
                    sink.sendall(data)
                except OSError:
                    return
                if requests and self.rate:
                    time.sleep(len(data) / self.rate)


@pytest.fixture
def hang(s3, monkeypatch):
    """A FrozenProxy in front of the moto server (not frozen yet), and this file's timeouts."""
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    proxies: list[FrozenProxy] = []

    def make(deaf: bool = False, rate: float | None = None) -> FrozenProxy:
        proxies.append(FrozenProxy(int(s3.endpoint.rsplit(":", 1)[1]), deaf=deaf, rate=rate))
        return proxies[-1]

    yield make
    for proxy in proxies:
        proxy.close()


def options(proxy: FrozenProxy) -> dict:
    return {"endpoint_url": proxy.endpoint, "key": "testing-key-id", "secret": SECRET}


def assert_gave_up(error: StorageError, proxy: FrozenProxy, action: str, waited: float) -> None:
    message = str(error)
    assert "\n" not in message and SECRET not in message
    assert message.startswith(action) and f"storage at {proxy.endpoint} did not answer in time" in message
    assert f"after {ATTEMPTS} attempts over" in message
    assert is_timeout(error.__cause__) and is_transient(error.__cause__)
    assert waited <= BOUND + SLACK, f"gave up after {waited:.1f} s, the bound is {BOUND:.1f} s"


def test_a_read_from_a_frozen_endpoint_gives_up_within_the_bound(s3, hang, s3_client):
    url = s3.fresh_url("hang")
    s3.fs.pipe_file(f"{url}/blob", b"x" * 1000)
    proxy = hang()
    fs, root = open_url(url, options(proxy))
    assert read_bytes(fs, f"{root}/blob") == b"x" * 1000  # through the proxy while it answers
    frozen = proxy.freeze()
    with pytest.raises(StorageError) as e:
        read_bytes(fs, f"{root}/blob")
    waited = time.monotonic() - frozen
    print(f"read: frozen to StorageError in {waited:.2f} s (bound {BOUND:.2f} s)")
    assert_gave_up(e.value, proxy, f"reading {url}/blob", waited)
    assert waited >= ATTEMPTS * READ * 0.9  # each attempt waited its read timeout, no shorter


@pytest.mark.parametrize("deaf", [False, True], ids=["never-answers", "stops-reading"])
def test_an_upload_to_a_frozen_endpoint_gives_up_within_the_bound(s3, hang, deaf, s3_client):
    url = s3.fresh_url("hang")
    proxy = hang(deaf=deaf)
    fs, root = open_url(url, options(proxy))
    data = os.urandom(8 << 20)  # one PUT with a body bigger than the sockets' buffers
    write_bytes_atomic(fs, f"{root}/before", data)  # uploads through the proxy while it answers
    assert s3.fs.cat_file(f"{url}/before") == data
    puts = [h for h in proxy.heads if h.startswith(b"PUT ")]
    assert puts  # botocore's carry "Expect: 100-continue": what aiohttp's sock_read never covered
    assert s3_client == "obstore" or all(b"expect: 100-continue" in h.lower() for h in puts)
    frozen = proxy.freeze()
    with pytest.raises(StorageError) as e:
        write_bytes_atomic(fs, f"{root}/after", data)
    waited = time.monotonic() - frozen
    print(f"upload ({'stops reading' if deaf else 'never answers'}): frozen to StorageError in {waited:.2f} s "
          f"(bound {BOUND:.2f} s)")  # fmt: skip
    assert_gave_up(e.value, proxy, f"writing {url}/after", waited)


def test_a_slow_upload_that_makes_progress_is_not_cut_off(s3, hang, monkeypatch, s3_client):
    # aiohttp's own read timer starts once the body is handed to the kernel, whose send buffer
    # (megabytes on loopback) still has to drain at the link's rate: a read timeout of 2 s covers that here
    read = 2.0
    monkeypatch.setenv("BUCKETEER_STORAGE_READ_TIMEOUT", str(read))
    url = s3.fresh_url("hang")
    proxy = hang(rate=4e6)  # 4 MB/s: the upload takes longer than connect + read timeout, moving all along
    fs, root = open_url(url, options(proxy))
    data = os.urandom(16 << 20)
    started = time.monotonic()
    write_bytes_atomic(fs, f"{root}/slow", data)
    took = time.monotonic() - started
    print(f"slow upload: {len(data) >> 20} MiB in {took:.1f} s, no retry (stall limit {CONNECT + read:.1f} s)")
    assert s3.fs.cat_file(f"{url}/slow") == data
    puts = [h.split(b"\r\n", 1)[0] for h in proxy.heads if h.startswith(b"PUT ")]
    if s3_client == "fsspec":
        assert took > CONNECT + read and len(puts) == 1  # one attempt: no timeout, no retry
    else:  # obstore: 5 MiB parts, each within the read timeout (manifests.objstore._put_parts); none retried
        assert len(puts) == len(set(puts)) == -(-len(data) // (5 << 20))


def test_the_timeouts_come_from_the_environment_and_a_users_setting_wins(s3, hang):
    proxy = hang()
    fs, _ = open_url("s3://b/x", options(proxy))
    assert (fs.config_kwargs["connect_timeout"], fs.config_kwargs["read_timeout"]) == (CONNECT, READ)
    mine = {"read_timeout": 300, "retries": {"total_max_attempts": 2}}
    fs, _ = open_url("s3://b/x", {**options(proxy), "config_kwargs": mine})
    assert fs.config_kwargs["read_timeout"] == 300 and fs.config_kwargs["connect_timeout"] == CONNECT


def test_progress_says_waiting_for_storage_while_a_call_retries():
    from io import StringIO

    from manifests.retry import with_retries

    out = StringIO()
    calls = []

    def hung():
        calls.append(1)
        if len(calls) < 3:
            raise TimeoutError("no answer")
        return "ok"

    with Progress("embed", "images", total=10, unit="images", stream=out, interval=30) as progress:
        progress.update(1)
        assert with_retries(hung) == "ok"
        assert "waiting for storage (TimeoutError, attempt 1 of" in out.getvalue()
        assert out.getvalue().count("waiting for storage") == 1  # the second notice came within 10 s
        progress._waiting = StorageWait("TimeoutError", 2, 6, 70.0)
        assert progress.line().endswith("waiting for storage (TimeoutError, attempt 2 of 6 failed, 70s)")
        progress.update(1)  # progress again: storage answers
        assert "waiting" not in progress.line()


def test_a_command_against_a_frozen_endpoint_exits_2_with_one_line_within_the_bound(s3, hang):
    proxy = hang()
    frozen = proxy.freeze()  # frozen from the start: the command's first request gets no answer
    command = ["verify", f"s3://{s3.bucket}/cache", "--storage-options", json.dumps(options(proxy))]
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", *command], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **ENV}, timeout=60)  # fmt: skip
    waited = time.monotonic() - frozen
    print(f"`bucketeer {' '.join(command[:2])}` against a frozen endpoint: exit {done.returncode} "
          f"{waited:.2f} s after the freeze (bound {BOUND:.2f} s + start-up)")  # fmt: skip
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0] == done.stderr.strip().splitlines()[-1], done.stderr
    line = errors[0]
    assert line.startswith(f"bucketeer verify: error: reading s3://{s3.bucket}/cache/_cache.json")
    assert f"storage at {proxy.endpoint} did not answer in time after {ATTEMPTS} attempts over" in line
    assert "Traceback" not in done.stderr and SECRET not in done.stderr
    # said while it waited (botocore's ReadTimeoutError, or the TimeoutError obstore's timeout becomes)
    assert re.search(r"waiting for storage \((Read)?TimeoutError, attempt 1 of 2 failed", done.stderr)
    storage_seconds = float(line.split(" attempts over ")[1].split(" s")[0])
    assert storage_seconds <= BOUND + SLACK and waited <= BOUND + SLACK + 10  # + interpreter start-up
