"""One writer per artifact: ``ROOT/_writer.json``, created exclusively before a job writes, removed after.

Two scans (or rebuckets, embeds, plans) started on one ``--out`` would each delete the other's parts
and commit a root JSON naming parts that no longer exist. So every job that writes an artifact holds
its writer lock for the whole run (:func:`writer_lock`):

- **Taken** by an exclusive create of a whole file: on a local disk the lock is written and synced to a
  ``_writer.json.tmp-*`` sibling first and then published with ``link``, which fails when the lock exists
  (where a filesystem has no hard links: ``O_CREAT | O_EXCL``, and a lock that could not be written whole
  is removed by the run that made it); on S3 a PUT with ``If-None-Match: *`` (which AWS S3, R2 and moto
  honour: a second PUT fails with 412), atomic by itself. Exactly one of two writers started at once gets
  it, and a full disk or a failed write leaves no lock behind.
- **Our own PUT, answered late**: when a lock PUT reached the store but its answer was lost, the retry is
  refused (412) by the lock it made; the writer reads its own token there and holds the lock. A run that
  fails while taking the lock removes a lock of its own token before it stops.
- **Refused**: the second writer gets one line naming the first (host, pid, start time, command), exit 2.
- **Alive**: the holder rewrites it every :data:`HEARTBEAT_SECONDS` (``heartbeat_at``).
- **Taken over** with a one-line notice when its owner is gone: a process of this host that no longer
  exists (``kill -9`` leaves the file behind), or, from any host, a heartbeat older than
  ``BUCKETEER_LOCK_STALE_SECONDS`` (default :data:`STALE_SECONDS`). The take-over is itself exclusive:
  a rename of the stale file on a local disk, a PUT with ``If-Match: <its ETag>`` on S3, so two
  writers that find one dead lock cannot both take it.
- **Judged by the store's clock**, never by this host's (:meth:`_Lock.read`): the heartbeat's age is the
  time since the lock object was last written, both ends read from the store: on S3 the ``Date`` of the
  HEAD answer less the object's ``LastModified`` (a fresh probe object's ``LastModified`` where an answer
  has no ``Date``), on a folder a fresh probe file's mtime less the lock file's (a network filesystem's
  server sets both). A host whose clock runs 10 minutes fast does not steal a live lock, nor does one
  10 minutes slow keep a dead one 10 minutes longer; ``heartbeat_at`` in the file (this host's clock,
  :data:`_clock`) is for people reading it.
- **Torn** (an empty or unreadable ``_writer.json``: written by an older bucketeer that created it before
  writing it, or by another tool): taken over with a notice once it is :data:`TORN_SECONDS` old by the
  store's clock (a writer fills its lock within milliseconds), refused before then with one line saying
  when it will be taken over.
- **Released** at the end of the run (also on an exception); a release deletes only the writer's own lock.

A writer that took the lock also removes what a killed writer left on a local disk: the zero-byte or
partial ``*.tmp-*`` siblings of :func:`manifests.storage.write_bytes_atomic`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import email.utils
import errno
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Mapping

from fsspec import AbstractFileSystem

from manifests import faults
from manifests.errors import UsageError
from manifests.storage import call_storage, is_local, join, open_url, redact

log = logging.getLogger("bucketeer.lock")

LOCK_FILE = "_writer.json"
HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 300.0  # a heartbeat older than this: the writer is gone (any host)
TORN_SECONDS = 10.0  # an empty or unreadable lock older than this was never going to be written: taken over
STALE_ENV = "BUCKETEER_LOCK_STALE_SECONDS"
HEARTBEAT_ENV = "BUCKETEER_LOCK_HEARTBEAT_SECONDS"
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS}  # a filesystem without links
_clock = time.time  # this host's clock: only what the file says for people (tests set it 10 minutes off)


class WriterBusyError(UsageError):
    """Another writer holds the artifact: wait for it, or stop it."""


@dataclass(frozen=True)
class Writer:
    """Who holds an artifact's lock (the content of ``_writer.json``)."""

    token: str  # this holding's identity: a release or heartbeat touches only its own lock
    command: str  # "scan", "embed", ...
    host: str
    pid: int
    process_started: float | None  # the pid's start time (seconds since the epoch): a reused pid is not the owner
    started_at: str  # ISO time the lock was taken
    heartbeat_at: float  # seconds since the epoch

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Writer:
        return cls(token=str(d["token"]), command=str(d["command"]), host=str(d["host"]), pid=int(d["pid"]),
                   process_started=d.get("process_started"), started_at=str(d["started_at"]),
                   heartbeat_at=float(d["heartbeat_at"]))  # fmt: skip

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode()

    @property
    def torn(self) -> bool:
        """Whether this stands for a lock file that is empty or unreadable (no writer can be named)."""
        return not self.token

    def describe(self) -> str:
        if self.torn:
            return f"a torn lock (an empty or unreadable {LOCK_FILE}, never written whole)"
        return f"`bucketeer {self.command}` on host {self.host}, pid {self.pid}, started {self.started_at}"

    def gone(self, age: float, stale_seconds: float) -> str | None:
        """Why this writer is gone (a line for the take-over notice), or None while it may still run.
        ``age``: seconds since its lock was last written, by the store's clock (:meth:`_Lock.read`)."""
        if self.torn:
            if age > min(TORN_SECONDS, stale_seconds):
                return (f"it is {age:.0f} s old and was never written whole (a run that failed while writing it, "
                        "e.g. on a full disk)")  # fmt: skip
            return None
        if self.host == socket.gethostname():
            started = _process_started(self.pid)
            if started is None:
                return f"its process {self.pid} no longer exists"
            if self.process_started is not None and abs(started - self.process_started) > 1.0:  # NaN: False
                return f"its process {self.pid} no longer exists (the pid now belongs to another process)"
        if age > stale_seconds:
            return f"its last heartbeat was {age:.0f} s ago by the store's clock (stale after {stale_seconds:.0f} s)"
        return None


def _process_started(pid: int) -> float | None:
    """The start time of process ``pid`` on this host (seconds since the epoch); None when there is none,
    NaN when it exists but may not be inspected (another user's)."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None
    except psutil.AccessDenied:
        return float("nan")


def _answer_date(head: Mapping[str, Any]) -> _dt.datetime | None:
    """The ``Date`` header of an S3 answer (the store's clock when it answered), or None without one."""
    text = head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return email.utils.parsedate_to_datetime(text) if text else None
    except (TypeError, ValueError):
        return None


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise UsageError(f"${name} must be a number of seconds, got {os.environ[name]!r}") from None


class _Lock:
    """The mechanics of one artifact's ``_writer.json`` on one filesystem."""

    def __init__(self, fs: AbstractFileSystem, root: str, url: str):
        self.fs, self.root, self.url = fs, root, url
        self.path = join(root, LOCK_FILE)
        self.local = is_local(fs)

    def create(self, data: bytes) -> bool:
        """Create the lock file if there is none; False when there is one."""
        if self.local:
            return call_storage(self.fs, "locking", self.path, lambda: self._create_local(data))

        def create_remote() -> bool:
            return self._put(data, IfNoneMatch="*")

        return call_storage(self.fs, "locking", self.path, create_remote)

    def _create_local(self, data: bytes) -> bool:
        """Write the lock whole to a temporary sibling, then publish it with ``link`` (no-replace): a lock is
        visible whole or not at all. A failed write (ENOSPC) leaves neither file."""
        self.fs.makedirs(self.root, exist_ok=True)
        tmp = f"{self.path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except FileNotFoundError:  # our temporary was removed by the holder's clean-up (remove_temporaries)
            return False
        except OSError as e:
            if e.errno not in _NO_LINKS:
                raise
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        return self._create_exclusive(data)

    def _create_exclusive(self, data: bytes) -> bool:
        """``O_EXCL`` create and write, for a filesystem without hard links; a lock not written whole is removed."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(self.path)
            raise
        return True

    def read(self) -> tuple[Writer | None, str | None, float]:
        """The current holder, a version tag for a conditional take-over, and the seconds since the lock was
        last written by the store's clock (None, None, 0: no lock)."""
        def read_it() -> tuple[bytes, str | None, float]:
            if self.local:
                with open(self.path, "rb") as f:
                    written = os.fstat(f.fileno()).st_mtime
                    return f.read(), None, self._local_now() - written
            bucket, key, _ = self.fs.split_path(self.path)
            head = self.fs.call_s3("head_object", Bucket=bucket, Key=key)  # before the read: a newer object
            etag, written = head.get("ETag"), head["LastModified"]  # fails the If-Match
            now = _answer_date(head) or self._remote_now()
            return self.fs.cat_file(self.path), etag, (now - written).total_seconds()

        try:
            self.fs.invalidate_cache(self.path)
            data, etag, age = call_storage(self.fs, "reading", self.path, read_it)
        except FileNotFoundError:
            return None, None, 0.0
        try:
            return Writer.from_json(json.loads(data)), etag, age
        except (ValueError, KeyError, TypeError):  # a torn or foreign file: nobody can be shown as its owner
            return Writer(token="", command="?", host="?", pid=0, process_started=None, started_at="?",
                          heartbeat_at=0.0), etag, age  # fmt: skip

    def _local_now(self) -> float:
        """The folder's time now: the mtime of a probe file written here, which a network filesystem's
        server sets as it sets the lock file's."""
        probe = f"{self.path}.clock-{uuid.uuid4().hex}"
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            return os.fstat(fd).st_mtime
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.remove(probe)

    def _remote_now(self) -> _dt.datetime:
        """The store's time now, for an endpoint whose answers carry no ``Date``: a probe object's ``LastModified``."""
        probe = f"{self.path}.clock-{uuid.uuid4().hex}"
        bucket, key, _ = self.fs.split_path(probe)
        self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"")
        try:
            return self.fs.call_s3("head_object", Bucket=bucket, Key=key)["LastModified"]
        finally:
            with contextlib.suppress(OSError):
                self.fs.call_s3("delete_object", Bucket=bucket, Key=key)

    def replace(self, stale: Writer, etag: str | None, data: bytes) -> bool:
        """Take over ``stale``'s lock; False when another writer took it first."""
        if self.local:
            aside = f"{self.path}.stale-{uuid.uuid4().hex}"
            try:
                os.rename(self.path, aside)  # atomic: of two writers, one renames it, the other finds none
            except FileNotFoundError:
                return False
            with contextlib.suppress(OSError):
                os.remove(aside)
            return self.create(data)

        def put_if_match() -> bool:
            return self._put(data, **({"IfMatch": etag} if etag else {}))

        return call_storage(self.fs, "locking", self.path, put_if_match)

    def renew(self, etag: str | None, data: bytes) -> None:
        """Rewrite our own lock (its heartbeat); on S3 only if it is still the version we read."""
        if self.local:
            tmp = f"{self.path}.tmp-{uuid.uuid4().hex}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.path)
            except BaseException:  # a full disk: the old heartbeat stays, whole
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                raise
        else:
            self._put(data, **({"IfMatch": etag} if etag else {}))

    def _put(self, data: bytes, **condition: str) -> bool:
        """One conditional PUT of the lock object (S3's ``If-None-Match: *`` or ``If-Match: <ETag>``, which AWS,
        R2 and moto honour); False when the condition failed (412, or 404 for an If-Match on a gone object).
        The request is made here rather than through ``pipe_file``, whose conditional modes older s3fs lack."""
        bucket, key, _ = self.fs.split_path(self.path)
        try:
            self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except FileExistsError:  # newer s3fs: a failed If-None-Match
            return False
        except OSError as e:  # older s3fs: 412 Precondition Failed is EINVAL; 404 is FileNotFoundError
            if isinstance(e, FileNotFoundError) or e.errno == errno.EINVAL:
                return False
            raise
        finally:
            self.fs.invalidate_cache(self.path)
        return True

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            call_storage(self.fs, "unlocking", self.path, lambda: self.fs.rm_file(self.path))

    def remove_temporaries(self) -> int:
        """Delete the ``*.tmp-*`` files a killed writer left under the root (local disks only)."""
        if not self.local or not os.path.isdir(self.root):
            return 0
        removed = 0
        for folder, _, files in os.walk(self.root):
            for name in files:
                if ".tmp-" in name:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(folder, name))
                        removed += 1
        return removed


@contextlib.contextmanager
def writer_lock(url: str, storage_options: Mapping[str, Any] | None, command: str) -> Iterator[Writer]:
    """Hold ``url``'s writer lock for the ``with`` block (see the module docstring).

    Raises :class:`WriterBusyError` (a UsageError: one line, exit 2) naming the writer that holds it.
    """
    fs, root = open_url(url, dict(storage_options or {}))
    lock = _Lock(fs, root, url)
    created = lock.local and not os.path.exists(root)  # a run that writes nothing leaves no empty folder behind
    stale_seconds = _env_seconds(STALE_ENV, STALE_SECONDS)
    me = Writer(token=uuid.uuid4().hex, command=command, host=socket.gethostname(), pid=os.getpid(),
                process_started=_process_started(os.getpid()),
                started_at=_dt.datetime.fromtimestamp(_clock(), _dt.timezone.utc).isoformat(timespec="seconds"),
                heartbeat_at=_clock())  # fmt: skip
    try:
        _take(lock, me, url, command, stale_seconds)
    except BaseException:  # a PUT that reached the store before its answer failed: no lock of ours stays behind
        with contextlib.suppress(Exception):
            holder, _, _ = lock.read()
            if holder is not None and holder.token == me.token:
                lock.remove()
        raise
    faults.hit("lock.taken")
    removed = lock.remove_temporaries()
    if removed:
        log.info("removed %d temporary file(s) a killed run left under %s", removed, redact(url))
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(lock, me, stop), daemon=True, name="bucketeer-lock")
    beat.start()
    try:
        yield me
    finally:
        stop.set()
        beat.join(timeout=5)
        holder, _, _ = lock.read()
        if holder is not None and holder.token == me.token:
            lock.remove()
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(root)


def _take(lock: _Lock, me: Writer, url: str, command: str, stale_seconds: float) -> None:
    """Create the lock, or judge its holder and take it over when it is gone. Raises WriterBusyError."""
    for _ in range(5):  # each round: create, or judge the holder and maybe take it over
        if lock.create(me.to_bytes()):
            return
        holder, etag, age = lock.read()
        if holder is None:  # released between our create and our read: try again
            continue
        if holder.token == me.token:  # our own PUT stored it; its answer was lost and the retry refused
            return
        why = holder.gone(age, stale_seconds)
        if why is None and holder.torn:
            wait = max(1, math.ceil(min(TORN_SECONDS, stale_seconds) - age))
            raise WriterBusyError(f"{redact(url)} has a torn writer lock ({LOCK_FILE} is empty or unreadable, "
                                  f"{age:.0f} s old): a writer is creating it now, or one failed while writing it; "
                                  f"it is taken over when {min(TORN_SECONDS, stale_seconds):.0f} s old: run again "
                                  f"in {wait} s")  # fmt: skip
        if why is None:
            raise WriterBusyError(f"{redact(url)} is being written by {holder.describe()}; wait for it to finish, "
                                  f"or stop it (a lock whose writer is gone is taken over: {LOCK_FILE})")  # fmt: skip
        if lock.replace(holder, etag, me.to_bytes()):
            print(f"bucketeer {command}: note: took over the lock of {redact(url)} from {holder.describe()}: {why}",
                  flush=True)  # fmt: skip
            return
    holder, _, _ = lock.read()
    raise WriterBusyError(f"{redact(url)} is being written by {holder.describe() if holder else 'another writer'}"
                          "; wait for it to finish")  # fmt: skip


def _heartbeat(lock: _Lock, me: Writer, stop: threading.Event) -> None:
    every = _env_seconds(HEARTBEAT_ENV, HEARTBEAT_SECONDS)
    while not stop.wait(every):
        holder, etag, _ = lock.read()
        if holder is None or holder.token != me.token:  # taken over (we looked dead): say so, never fight for it
            log.warning("the writer lock of %s was taken over by %s", redact(lock.url),
                        holder.describe() if holder else "nobody (removed)")  # fmt: skip
            return
        try:
            lock.renew(etag, Writer(**{**asdict(me), "heartbeat_at": _clock()}).to_bytes())
        except Exception as e:  # a missed beat is not fatal: the lock only turns stale after STALE_SECONDS
            log.warning("could not renew the writer lock of %s: %s", redact(lock.url), e)
