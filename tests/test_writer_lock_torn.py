"""A writer lock is never left torn (manifests/lock.py): a scan onto a real full disk (a small tmpfs this test
mounts) fails and leaves no lock, so the next run starts at once when space is freed; a torn lock an older
version left is named as torn, and taken over once it is old enough; on a real S3-compatible server, a lock PUT
whose answer is lost after the store kept it (tests/fault_proxy.py) leaves the writer holding its own lock,
not refused by it."""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from manifests import lock as lock_module
from manifests.errors import StorageError
from manifests.lock import LOCK_FILE, WriterBusyError, writer_lock
from tests.fault_proxy import FaultProxy


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 2 MiB tmpfs with room for 64 files, mounted for this test (root can mount one, as CI and the development
    machines run); a simulated ENOSPC would not show what a real full filesystem refuses (a new empty file?)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,nr_inodes=64", "tmpfs", str(disk)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): a full disk needs one")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path) -> Path:
    """Fill ``disk`` to the last block; returns the filler file."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while f.write(b"\0" * 4096):
                pass
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def _fill_inodes(disk: Path) -> list[Path]:
    """Create empty files on ``disk`` until it has no room for another one; returns them."""
    made: list[Path] = []
    try:
        while True:
            made.append(disk / f"empty-{len(made)}")
            made[-1].touch()
    except OSError as e:
        assert e.errno == errno.ENOSPC
    return made[:-1]


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.startswith(LOCK_FILE))


def test_a_full_disk_leaves_no_lock_and_the_next_run_starts_at_once(small_disk: Path, capsys) -> None:
    out = small_disk / "out"
    out.mkdir()
    filler = _fill(small_disk)
    with pytest.raises(StorageError, match="No space left on device"):  # the run stops before it writes anything
        with writer_lock(str(out), None, "scan"):
            pass
    assert _left(out) == [], "neither a lock nor its temporary stays behind"
    filler.unlink()
    started = time.monotonic()
    with writer_lock(str(out), None, "scan") as me:
        assert me.command == "scan" and (out / LOCK_FILE).read_bytes().startswith(b"{")
    assert time.monotonic() - started < 5 and "took over" not in capsys.readouterr().out
    assert _left(out) == []


def test_a_run_whose_disk_fills_up_releases_its_lock_and_its_own_error_is_the_one_raised(small_disk: Path) -> None:
    out = small_disk / "out"
    with pytest.raises(RuntimeError, match="the job's own failure"):  # not a StorageError from the release
        with writer_lock(str(out), None, "scan"):
            _fill(small_disk)
            _fill_inodes(small_disk)  # not even an empty file fits: the release must write nothing
            raise RuntimeError("the job's own failure")
    assert not out.exists() or _left(out) == [], "the lock is released on a full disk"


@pytest.mark.ray
def test_a_scan_onto_a_full_disk_fails_in_one_line_and_the_next_scan_runs(small_disk, tmp_path, ray_local, capsys):
    from pipeline.cli import main
    from pipeline.sample_data import make_sample_dataset

    make_sample_dataset(tmp_path / "dataset", n=8, seed=0)
    out = small_disk / "manifest"
    args = ["scan", str(tmp_path / "dataset"), "--out", str(out), "--no-progress"]
    filler = _fill(small_disk)
    capsys.readouterr()
    assert main(args) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "being written" not in err, err
    assert not (out / LOCK_FILE).exists()
    filler.unlink()
    assert main(args) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    assert "being written" not in captured.err and "took over" not in captured.out
    assert (out / "_manifest.json").exists() and not (out / LOCK_FILE).exists()


def test_a_torn_lock_is_named_and_taken_over_once_it_is_old(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).write_bytes(b"")  # what an older bucketeer left on a full disk: created, never written
    with pytest.raises(WriterBusyError) as e:
        with writer_lock(str(out), None, "scan"):
            pass
    message = str(e.value)
    assert "has a torn writer lock" in message and "run again in" in message and "?" not in message, message
    old = time.time() - lock_module.TORN_SECONDS - 5
    os.utime(out / LOCK_FILE, (old, old))
    started = time.monotonic()
    with writer_lock(str(out), None, "embed"):
        pass
    assert time.monotonic() - started < 5
    notice = capsys.readouterr().out
    assert "took over the lock" in notice and "a torn lock" in notice and "never written whole" in notice, notice


def _lock_put(method: str, path: str) -> bool:
    return method == "PUT" and path.split("?")[0].endswith(LOCK_FILE)


@pytest.mark.s3
@pytest.mark.parametrize("fault", ["answer lost after the store kept it", "connection dropped, never stored"])
def test_on_s3_an_interrupted_lock_put_is_held_not_refused(s3, capsys, fault) -> None:
    proxy = FaultProxy(s3.endpoint)
    try:
        url = s3.fresh_url("lost")
        options = {"endpoint_url": proxy.endpoint}
        if fault.startswith("answer lost"):
            proxy.lose_answers(1, match=_lock_put)
        else:
            proxy.drop_requests(1, match=_lock_put)
        started = time.monotonic()
        with writer_lock(url, options, "scan") as me:
            puts = [s for s in proxy.seen() if _lock_put(s.method, s.path)]
            assert len(puts) == 2, "the interrupted PUT was retried once"
            assert puts[1].status == (412 if fault.startswith("answer lost") else 200), puts
            assert me.token.encode() in s3.fs.cat_file(f"{url}/{LOCK_FILE}")
        assert time.monotonic() - started < 30
        assert not s3.fs.exists(f"{url}/{LOCK_FILE}"), "released at the end"
        with writer_lock(url, options, "scan"):  # and the next run starts at once
            pass
        assert "took over" not in capsys.readouterr().out
    finally:
        proxy.close()


@pytest.mark.s3
def test_on_s3_a_torn_lock_object_is_taken_over_once_old(s3, monkeypatch, capsys) -> None:
    monkeypatch.setattr(lock_module, "TORN_SECONDS", 1.0)
    url = s3.fresh_url("torn")
    s3.fs.pipe_file(f"{url}/{LOCK_FILE}", b"")
    time.sleep(2.5)  # LastModified and Date are whole seconds
    with writer_lock(url, s3.storage_options, "scan"):
        pass
    assert "a torn lock" in capsys.readouterr().out
    assert not s3.fs.exists(f"{url}/{LOCK_FILE}")


DIES = """
import sys
from manifests.lock import writer_lock
from manifests.errors import BucketeerError
try:
    with writer_lock(sys.argv[1], {"endpoint_url": sys.argv[2]}, "scan"):
        print("held", flush=True)
except BucketeerError as e:
    print(f"failed: {e}", flush=True)
    sys.exit(2)
"""


@pytest.mark.s3
def test_on_s3_a_run_whose_store_went_away_after_its_lock_put_does_not_block_the_next(s3, monkeypatch, capsys):
    """The lock PUT is stored, and then the store answers nothing more (its retry, the removal of its own lock):
    the run fails in one line and its whole lock stays. From this host the next run takes it over at once (its
    process is gone); from another host the refusal says when it will be taken over."""
    proxy = FaultProxy(s3.endpoint)
    try:
        url = s3.fresh_url("gone")
        proxy.lose_answers(1000)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
               "BUCKETEER_STORAGE_ATTEMPTS": "2", "BUCKETEER_STORAGE_RETRY_DELAY": "0.01"}  # fmt: skip
        dead = subprocess.run([sys.executable, "-c", DIES, url, proxy.endpoint], capture_output=True, text=True,
                              env=env, timeout=120)  # fmt: skip
    finally:
        proxy.close()
    assert dead.returncode == 2 and dead.stdout.startswith("failed: ") and len(dead.stdout.splitlines()) == 1, dead
    left = json.loads(s3.fs.cat_file(f"{url}/{LOCK_FILE}"))
    assert left["pid"] != os.getpid() and left["host"] == socket.gethostname()

    with monkeypatch.context() as m:  # the next run, on another host
        m.setattr(lock_module, "socket", SimpleNamespace(gethostname=lambda: "login-node"))
        with pytest.raises(WriterBusyError) as e:
            with writer_lock(url, s3.storage_options, "scan"):
                pass
        assert re.search(rf"being written by `bucketeer scan` on host {re.escape(socket.gethostname())}, pid "
                         rf"{left['pid']}, .*its last heartbeat was \d+ s ago by the store's clock; if its writer is "
                         r"gone, _writer.json is taken over when that reaches 300 s: run again in \d+ s\)$",
                         str(e.value)), str(e.value)  # fmt: skip

    started = time.monotonic()
    with writer_lock(url, s3.storage_options, "scan"):
        pass
    assert time.monotonic() - started < 10
    notice = capsys.readouterr().out
    assert f"pid {left['pid']}" in notice and "no longer exists" in notice, notice
    assert not s3.fs.exists(f"{url}/{LOCK_FILE}")
