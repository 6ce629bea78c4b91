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
  refused (412) by the lock it made; the writer reads its own token there and holds the lock (the same for
  a take-over's ``If-Match`` PUT). A run that fails while taking the lock removes a lock of its own token
  before it stops. Only when the store stays unreachable for that removal too does its lock stay: a whole
  lock naming a run that has ended, taken over at once from this host (its process is gone), and from
  another host when stale, the refusal saying when.
- **Refused**: the second writer gets one line naming the first (host, pid, start time, command), exit 2;
  when that writer is on another host, also its last heartbeat and when its lock is taken over if it is gone.
- **Alive**: the holder rewrites it every :data:`HEARTBEAT_SECONDS` (``heartbeat_at``).
- **Taken over** with a one-line notice when its owner is gone: a process of this host that no longer
  exists (``kill -9`` leaves the file behind), or, from any host, a heartbeat older than
  ``BUCKETEER_LOCK_STALE_SECONDS`` (default :data:`STALE_SECONDS`). The take-over is itself exclusive:
  a rename of the stale file on a local disk (then a check that what was renamed is the version judged
  dead: a lock another writer published meanwhile is given back), a PUT with ``If-Match: <its ETag>`` on
  S3, so two writers that find one dead lock cannot both take it.
- **Judged by the store's clock**, never by this host's (:meth:`LockFile.read`): the heartbeat's age is the
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
- **Released** at the end of the run (also on an exception); a release deletes only the writer's own lock,
  and writes nothing first (no clock probe), so a disk that filled up during the run does not keep it.

A writer that took the lock also removes what a killed writer left on a local disk: the zero-byte or
partial ``*.tmp-*`` siblings of :func:`manifests.storage.write_bytes_atomic`, and an unpublished
``_writer.json.tmp-*`` (never read as a lock: only ``_writer.json`` is).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
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


from manifests import faults
from manifests.errors import UsageError
from manifests.lockfile import LOCK_FILE, LockFile
from manifests.storage import open_url, redact

log = logging.getLogger("bucketeer.lock")

HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 300.0  # a heartbeat older than this: the writer is gone (any host)
TORN_SECONDS = 10.0  # an empty or unreadable lock older than this was never going to be written: taken over
STALE_ENV = "BUCKETEER_LOCK_STALE_SECONDS"
HEARTBEAT_ENV = "BUCKETEER_LOCK_HEARTBEAT_SECONDS"
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
        ``age``: seconds since its lock was last written, by the store's clock (:meth:`LockFile.read`)."""
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


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise UsageError(f"${name} must be a number of seconds, got {os.environ[name]!r}") from None


def _read(lock: LockFile, with_age: bool = True) -> tuple[Writer | None, str | None, float]:
    """The lock's holder, version and age (:meth:`LockFile.read`); a torn or foreign file is a holder nobody can be
    shown as (:attr:`Writer.torn`)."""
    data, version, age = lock.read(with_age)
    if data is None:
        return None, None, 0.0
    try:
        return Writer.from_json(json.loads(data)), version, age
    except (ValueError, KeyError, TypeError):
        return Writer(token="", command="?", host="?", pid=0, process_started=None, started_at="?",
                      heartbeat_at=0.0), version, age  # fmt: skip


def _holds(lock: LockFile, me: Writer) -> bool:
    """Whether the lock is ``me``'s now (writes nothing: safe on a full disk)."""
    holder, _, _ = _read(lock, with_age=False)
    return holder is not None and holder.token == me.token


@contextlib.contextmanager
def writer_lock(url: str, storage_options: Mapping[str, Any] | None, command: str) -> Iterator[Writer]:
    """Hold ``url``'s writer lock for the ``with`` block (see the module docstring).

    Raises :class:`WriterBusyError` (a UsageError: one line, exit 2) naming the writer that holds it.
    """
    fs, root = open_url(url, dict(storage_options or {}))
    lock = LockFile(fs, root, url)
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
            if _holds(lock, me):
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
        if _holds(lock, me):
            lock.remove()
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(root)


def _take(lock: LockFile, me: Writer, url: str, command: str, stale_seconds: float) -> None:
    """Create the lock, or judge its holder and take it over when it is gone. Raises WriterBusyError."""
    for _ in range(5):  # each round: create, or judge the holder and maybe take it over
        if lock.create(me.to_bytes()):
            return
        holder, etag, age = _read(lock)
        if holder is None:  # released between our create and our read: try again
            continue
        if holder.token == me.token:  # our own PUT stored it; its answer was lost and the retry refused
            return
        why = holder.gone(age, stale_seconds)
        if why is None:
            raise WriterBusyError(_refusal(redact(url), holder, age, stale_seconds))
        taken = lock.replace(etag, me.to_bytes())
        if not taken and not lock.local:  # our If-Match PUT may have been stored and its answer lost (the retry: 412)
            taken = _holds(lock, me)
        if taken:
            print(f"bucketeer {command}: note: took over the lock of {redact(url)} from {holder.describe()}: {why}",
                  flush=True)  # fmt: skip
            return
    holder, _, _ = _read(lock)
    raise WriterBusyError(f"{redact(url)} is being written by {holder.describe() if holder else 'another writer'}"
                          "; wait for it to finish")  # fmt: skip


def _refusal(url: str, holder: Writer, age: float, stale_seconds: float) -> str:
    """The one line that refuses a second writer: who holds the lock and, unless its process is seen running on
    this host, when the lock is taken over if that writer is gone. ``age``: seconds since the lock was written."""
    if holder.torn:
        after = min(TORN_SECONDS, stale_seconds)
        return (f"{url} has a torn writer lock ({LOCK_FILE} is empty or unreadable, {age:.0f} s old): a writer is "
                f"creating it now, or one failed while writing it; it is taken over when {after:.0f} s old: run "
                f"again in {max(1, math.ceil(after - age))} s")  # fmt: skip
    line = f"{url} is being written by {holder.describe()}; wait for it to finish, or stop it"
    if holder.host == socket.gethostname():  # gone() found its process running
        return f"{line} (its process is running on this host)"
    return (f"{line} (its last heartbeat was {age:.0f} s ago by the store's clock; if its writer is gone, "
            f"{LOCK_FILE} is taken over when that reaches {stale_seconds:.0f} s: run again in "
            f"{max(1, math.ceil(stale_seconds - age))} s)")  # fmt: skip


def _heartbeat(lock: LockFile, me: Writer, stop: threading.Event) -> None:
    every = _env_seconds(HEARTBEAT_ENV, HEARTBEAT_SECONDS)
    while not stop.wait(every):
        try:
            holder, etag, _ = _read(lock, with_age=False)
            if holder is None or holder.token != me.token:  # taken over (we looked dead): say so, never fight
                log.warning("the writer lock of %s was taken over by %s", redact(lock.url),
                            holder.describe() if holder else "nobody (removed)")  # fmt: skip
                return
            lock.renew(etag, Writer(**{**asdict(me), "heartbeat_at": _clock()}).to_bytes())
        except Exception as e:  # a missed beat is not fatal: the lock only turns stale after STALE_SECONDS
            log.warning("could not renew the writer lock of %s: %s", redact(lock.url), e)
