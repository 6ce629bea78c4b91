"""One writer per artifact (manifests/lock.py): two processes started at once, a writer killed with -9,
a stale lock from another host, and the same on a real S3-compatible server (moto) through If-None-Match
and If-Match conditional PUTs; staleness judged by the store's clock, with this host's clock 10 minutes off."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from manifests.lock import LOCK_FILE, Writer, WriterBusyError, writer_lock

HOLDER = textwrap.dedent("""
    import sys, time
    from manifests.lock import writer_lock
    from manifests.errors import BucketeerError
    url, seconds = sys.argv[1], float(sys.argv[2])
    so = {"endpoint_url": sys.argv[3]} if len(sys.argv) > 3 else {}
    try:
        with writer_lock(url, so, "scan"):
            print("held", flush=True)
            time.sleep(seconds)
    except BucketeerError as e:
        print(f"refused: {e}", flush=True)
        sys.exit(2)
""")


def _start(url: str, seconds: float, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    return subprocess.Popen([sys.executable, "-c", HOLDER, url, str(seconds), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip


def _two_at_once(url: str, *extra: str) -> list[tuple[int, str]]:
    procs = [_start(url, 3, *extra) for _ in range(2)]
    return sorted((p.wait(timeout=60), p.stdout.read()) for p in procs)


def test_two_writers_started_at_once_one_is_refused_naming_the_other(tmp_path: Path) -> None:
    (ok, out_ok), (refused, out_refused) = _two_at_once(str(tmp_path / "out"))
    assert (ok, refused) == (0, 2), (out_ok, out_refused)
    assert "held" in out_ok
    line = out_refused.strip().splitlines()[-1]
    assert line.startswith("refused: ") and "is being written by `bucketeer scan`" in line
    assert f"host {socket.gethostname()}" in line and "pid " in line and "started " in line
    assert not (tmp_path / "out" / LOCK_FILE).exists(), "the holder releases its lock"


def test_a_lock_left_by_kill_9_is_taken_over_with_a_notice(tmp_path: Path, capsys) -> None:
    url = str(tmp_path / "out")
    proc = _start(url, 60)
    assert proc.stdout.readline().strip() == "held"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = json.loads((tmp_path / "out" / LOCK_FILE).read_text())
    assert left["pid"] == proc.pid
    (tmp_path / "out" / "samples").mkdir()
    (tmp_path / "out" / "samples" / "part-0.parquet.tmp-0123abcd").write_bytes(b"")  # what a kill leaves
    with writer_lock(url, None, "rebucket") as me:
        assert json.loads((tmp_path / "out" / LOCK_FILE).read_text())["token"] == me.token
        assert not list((tmp_path / "out").rglob("*.tmp-*")), "the next writer removes a killed run's temporaries"
    notice = capsys.readouterr().out
    assert f"took over the lock of {url}" in notice and f"pid {proc.pid}" in notice and "no longer exists" in notice
    assert not (tmp_path / "out" / LOCK_FILE).exists()


def _foreign_lock() -> bytes:
    """The lock of a writer on another host, whose clock (``heartbeat_at``) says it beat just now."""
    return json.dumps({"token": "x", "command": "embed", "host": "gpu-node-7", "pid": 4242,
                       "process_started": 1.0, "started_at": "2026-01-01T00:00:00+00:00",
                       "heartbeat_at": time.time()}).encode()  # fmt: skip


def _write_local_lock(out: Path, written_ago: float) -> None:
    """A foreign lock whose file the folder last wrote ``written_ago`` seconds ago (its mtime: the store's time)."""
    (out / LOCK_FILE).write_bytes(_foreign_lock())
    os.utime(out / LOCK_FILE, (time.time() - written_ago,) * 2)


def test_another_hosts_lock_is_refused_while_it_beats_and_taken_over_when_stale(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    _write_local_lock(out, written_ago=5)
    with pytest.raises(WriterBusyError, match="being written by `bucketeer embed` on host gpu-node-7, pid 4242") as e:
        with writer_lock(str(out), None, "embed"):
            pass
    assert re.search(
        r"its last heartbeat was [4-7] s ago by the store's clock; if its writer is gone, _writer.json "
        r"is taken over when that reaches 300 s: run again in 29[3-6] s\)$",
        str(e.value),
    ), str(e.value)
    monkeypatch.setenv("BUCKETEER_LOCK_STALE_SECONDS", "60")
    _write_local_lock(out, written_ago=61)
    with writer_lock(str(out), None, "embed"):
        pass
    assert "last heartbeat was 61 s ago by the store's clock" in capsys.readouterr().out
    assert not [p for p in out.iterdir() if ".clock-" in p.name], "the clock probe is removed"


def test_of_two_writers_that_find_one_dead_lock_the_later_one_gives_back_what_the_first_published(
    tmp_path: Path, monkeypatch
) -> None:
    """The local take-over renames the dead lock aside. Here B judges the dead lock, then A takes it over and
    publishes its own before B renames: B renamed A's live lock, so it must see that and give it back."""
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("BUCKETEER_LOCK_STALE_SECONDS", "60")
    _write_local_lock(out, written_ago=61)
    b_judged, a_holds, b_done = threading.Event(), threading.Event(), threading.Event()
    judge = Writer.gone

    def gone(self: Writer, age: float, stale_seconds: float) -> str | None:
        why = judge(self, age, stale_seconds)
        if threading.current_thread().name == "B" and not a_holds.is_set():
            b_judged.set()
            a_holds.wait(10)  # B has judged the dead lock; A takes it over before B acts on that
        return why

    monkeypatch.setattr(Writer, "gone", gone)
    seen: dict[str, object] = {}

    def a() -> None:
        b_judged.wait(10)
        with writer_lock(str(out), None, "embed") as me:
            a_holds.set()
            b_done.wait(10)
            seen["a kept its lock"] = json.loads((out / LOCK_FILE).read_text())["token"] == me.token

    def b() -> None:
        try:
            with writer_lock(str(out), None, "scan"):
                seen["b"] = "held"
        except WriterBusyError as e:
            seen["b"] = str(e)
        b_done.set()

    threads = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen["a kept its lock"] is True
    assert "is being written by `bucketeer embed`" in str(seen["b"]) and "running on this host" in str(seen["b"])
    assert not [p.name for p in out.iterdir() if p.name.startswith(LOCK_FILE)], "released, nothing set aside"


def test_the_holder_renews_its_heartbeat(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BUCKETEER_LOCK_HEARTBEAT_SECONDS", "0.2")
    with writer_lock(str(tmp_path / "out"), None, "plan"):
        first = json.loads((tmp_path / "out" / LOCK_FILE).read_text())["heartbeat_at"]
        time.sleep(1.0)
        later = json.loads((tmp_path / "out" / LOCK_FILE).read_text())["heartbeat_at"]
    assert later > first


@pytest.mark.s3
def test_on_s3_two_writers_at_once_and_a_stale_lock(s3, monkeypatch, capsys) -> None:
    url = s3.fresh_url("lock")
    (ok, out_ok), (refused, out_refused) = _two_at_once(url, s3.endpoint)
    assert (ok, refused) == (0, 2), (out_ok, out_refused)
    assert "is being written by `bucketeer scan`" in out_refused
    assert not s3.fs.exists(f"{url}/{LOCK_FILE}")

    monkeypatch.setenv("BUCKETEER_LOCK_STALE_SECONDS", "1")
    s3.fs.pipe_file(f"{url}/{LOCK_FILE}", _foreign_lock())
    time.sleep(3)  # stale by the store's clock (LastModified and Date are whole seconds)
    winners = []

    def take() -> None:
        try:
            with writer_lock(url, s3.storage_options, "embed"):
                winners.append(1)
                time.sleep(1.5)
        except WriterBusyError:
            pass

    threads = [threading.Thread(target=take) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert winners == [1], "one of two writers that find one stale lock takes it over (If-Match)"
    assert "took over the lock" in capsys.readouterr().out
    assert not s3.fs.exists(f"{url}/{LOCK_FILE}")


SKEW = 600.0  # this host's clock, 10 minutes off


@pytest.fixture(params=["local", "s3"])
def lock_store(request, tmp_path):
    """``(url, storage_options, write_foreign_lock)`` on a local folder or on moto (marked s3)."""
    if request.param == "local":
        out = tmp_path / "out"
        out.mkdir()
        return str(out), None, lambda: (out / LOCK_FILE).write_bytes(_foreign_lock())
    request.applymarker(pytest.mark.s3)
    s3 = request.getfixturevalue("s3")
    url = s3.fresh_url("skew")
    return url, s3.storage_options, lambda: s3.fs.pipe_file(f"{url}/{LOCK_FILE}", _foreign_lock())


def test_a_host_whose_clock_runs_fast_does_not_steal_a_live_lock(lock_store, monkeypatch):
    url, options, write_lock = lock_store
    monkeypatch.setenv("BUCKETEER_LOCK_STALE_SECONDS", "300")
    monkeypatch.setattr("manifests.lock._clock", lambda: time.time() + SKEW)  # its heartbeat looks 600 s old here
    write_lock()
    with pytest.raises(WriterBusyError, match="on host gpu-node-7"):
        with writer_lock(url, options, "embed"):
            pass


def test_a_host_whose_clock_runs_slow_takes_over_a_dead_lock_when_it_is_stale(lock_store, monkeypatch, capsys):
    url, options, write_lock = lock_store
    stale = 2.0
    monkeypatch.setenv("BUCKETEER_LOCK_STALE_SECONDS", str(stale))
    monkeypatch.setattr("manifests.lock._clock", lambda: time.time() - SKEW)  # its heartbeat looks 600 s ahead here
    write_lock()  # the writer on gpu-node-7 beats once, then dies
    written, refused = time.monotonic(), 0
    while True:
        try:
            with writer_lock(url, options, "embed"):
                break
        except WriterBusyError:
            refused += 1
            assert time.monotonic() - written < stale + 10, "a dead lock kept past its stale time"
            time.sleep(0.5)
    took = time.monotonic() - written
    assert refused >= 1 and took >= stale  # live until stale, by the store's clock, not a moment longer than ~2 s
    assert "took over the lock" in capsys.readouterr().out
    print(f"dead lock taken over {took:.1f} s after its last write (stale after {stale:.0f} s, clock {SKEW:.0f} s "
          "slow)")  # fmt: skip
