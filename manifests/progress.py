"""Progress of long jobs: a tqdm bar on a terminal, a plain line every N seconds in logs.

    progress = Progress("embed", "images", total=len(todo), unit="images")
    progress.update(16, written="12.3 MB", errors=0)   # as results arrive
    progress.close()                                    # the final line

Ray job logs, ``kubectl logs``, CI and a trainer's log file are not terminals: a carriage-return
bar is noise there (and a bar that switches itself off there leaves hours of silence). So off a
terminal the reporter writes, to stderr, every ``BUCKETEER_PROGRESS_SECONDS`` (default 30; ``0``:
at every update)::

    embed images: 1,234/10,000 images (12%), 45.6 images/s, ETA 3m12s, written 12.3 MB, errors 0

and a final line with the count, the rate and the wall time (``..., done in 4m01s, ...``). The
rate is the average since the reporter was made (make it when the phase starts, so that model
loading is not counted); the ETA is the rest at that rate. Extras are ``key value`` pairs, shown
in the order first given, each keeping its latest value. On a terminal the same figures go to a
tqdm bar (imported only then). stdout stays free for what a command prints as its result
(``bucketeer plan --json``).

Why here, in manifests/: one implementation for every job. The trainer may not import pipeline/,
and manifests' own long functions (``verify_cache``, ``write_plan``, ``check_plan``) report through
the same object; tqdm is a small pure-Python core dependency, and only a terminal loads it.

Storage that does not answer is no silence either: a reporter listens to the retry layer of its
process (:func:`manifests.retry.add_wait_listener`), and when a storage call fails transiently and
waits to try again it writes its line at once (then at most every 10 s, or every interval if
shorter), ending ``..., waiting for storage (ReadTimeoutError, attempt 2 of 6 failed, 70s)``,
until the next update. On a terminal the bar's postfix says the same. A store that throttles (S3's
``503 SlowDown``, R2's ``429``) is said the same way, ``storage throttling (503, 3 throttled answers, 4s)``,
and the line counts the job's throttled answers so far (``throttled 1,234``: those of every process of the
job, :func:`manifests.retry.counting_throttles`, else this process's since the reporter was made).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from typing import Any, Callable, TextIO

from manifests.errors import UsageError
from manifests.retry import StorageWait, add_wait_listener, remove_wait_listener
from manifests.throttles import ThrottleTally, job_throttles

__all__ = ["INTERVAL_ENV", "DEFAULT_INTERVAL", "Progress", "interval_seconds", "format_duration", "human_bytes"]

INTERVAL_ENV = "BUCKETEER_PROGRESS_SECONDS"
DEFAULT_INTERVAL = 30.0
WAIT_LINE_SECONDS = 10.0  # "waiting for storage" lines at most this often (or every interval, if shorter)


def interval_seconds() -> float:
    """Seconds between plain progress lines: ``$BUCKETEER_PROGRESS_SECONDS`` or 30.

    Raises ValueError naming the variable when it is not a number >= 0.
    """
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_INTERVAL
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or math.isinf(value):
        raise UsageError(f"{INTERVAL_ENV}={text!r}: use seconds between progress lines, e.g. 30 (0: every update)")
    return value


def format_duration(seconds: float) -> str:
    """``45s``, ``3m12s``, ``2h05m``: short enough for a log line."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def human_bytes(n: float | None) -> str:
    """``n`` bytes for people: ``'512 B'``, ``'6.3 kB'``, ``'2.42 MB'`` (decimal units); ``'-'`` for None."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def _extra(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:,.1f}"


class Progress:
    """Reports ``done`` of ``total`` ``unit`` for ``job``'s ``phase``; see the module docstring.

    ``enabled=False`` makes every call a no-op (``--no-progress``, ranks other than the main one).
    ``stream`` defaults to stderr; ``interval`` (seconds) to :func:`interval_seconds`; ``clock``
    (seconds, monotonic) is there for tests. ``total`` may be None (no percentage, no ETA).
    """

    def __init__(
        self,
        job: str,
        phase: str,
        total: int | None = None,
        *,
        unit: str = "items",
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.job, self.phase, self.total, self.unit = job, phase, total, unit
        self.enabled = enabled
        self.done = 0
        self.extra: dict[str, Any] = {}
        self._stream = stream if stream is not None else sys.stderr
        self._interval = interval_seconds() if interval is None and enabled else (interval or 0.0)
        self._clock = clock
        self._start = self._last = clock()
        self._closed = False
        self._bar = None
        self._waiting: StorageWait | None = None  # the last storage retry notice since the last update
        self._throttles = job_throttles() or ThrottleTally()  # the job's, else this process's from now
        self._last_wait_line = -math.inf
        self._lock = threading.Lock()  # notices come from the retrying threads
        if enabled and _isatty(self._stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=f"{job} {phase}", unit=f" {unit}", file=self._stream,
                             dynamic_ncols=True)  # fmt: skip
        if enabled:
            add_wait_listener(self)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.close(final=exc_type is None)

    def update(self, n: int = 1, **extra: Any) -> None:
        """``n`` more units done; ``extra`` replaces the named extras (``written="12.3 MB"``)."""
        if not self.enabled or self._closed:
            return
        self.done += n
        self.extra.update(extra)
        waited, self._waiting = self._waiting, None  # progress again: storage answers
        if self._bar is not None:
            if extra or waited:
                self._bar.set_postfix_str(self._extras(), refresh=False)
            self._bar.update(n)
            return
        now = self._clock()
        if now - self._last >= self._interval:
            self._last = now
            self._write(self.line(now))

    def close(self, final: bool = True) -> None:
        """The final line (or the bar's last state); further calls are ignored.

        ``final=False`` (the job failed): stop without a final line, which would say "done".
        """
        if not self.enabled or self._closed:
            return
        self._closed = True
        self._waiting = None
        remove_wait_listener(self)
        if self._bar is not None:
            self._bar.close()
        elif final:
            self._write(self.line(self._clock(), final=True))

    def on_storage_wait(self, wait: StorageWait) -> None:
        """A storage call of this process failed transiently and waits to try again (called by
        :mod:`manifests.retry`, from the retrying thread): say so now, then at most every 10 s."""
        if not self.enabled or self._closed:
            return
        with self._lock:
            self._waiting = wait
            now = self._clock()
            if now - self._last_wait_line < min(self._interval, WAIT_LINE_SECONDS):
                return
            self._last_wait_line = now
        if self._bar is not None:
            self._bar.set_postfix_str(self._extras(), refresh=True)
        else:
            self._write(self.line(now))

    def rate(self, now: float | None = None) -> float:
        """Units per second since the reporter was made."""
        elapsed = (self._clock() if now is None else now) - self._start
        return self.done / elapsed if elapsed > 0 else 0.0

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left at the average rate; None without a total or before any progress."""
        rate = self.rate(now)
        if self.total is None or rate <= 0:
            return None
        return max(self.total - self.done, 0) / rate

    def line(self, now: float | None = None, final: bool = False) -> str:
        """The plain progress line at time ``now`` (the clock's seconds)."""
        now = self._clock() if now is None else now
        count = f"{self.done:,}"
        if self.total is not None:
            count += f"/{self.total:,} {self.unit}"
            if self.total:
                count += f" ({100 * self.done // self.total}%)"
        else:
            count += f" {self.unit}"
        parts = [count, f"{_number(self.rate(now))} {self.unit}/s"]
        if final:
            parts.append(f"done in {format_duration(now - self._start)}")
        else:
            eta = self.eta(now)
            parts.append(f"ETA {format_duration(eta) if eta is not None else '?'}")
        if self.extra or self._waiting or self._throttles.total:
            parts.append(self._extras())
        return f"{self.job} {self.phase}: " + ", ".join(parts)

    def _extras(self) -> str:
        parts = [f"{k.replace('_', ' ')} {_extra(v)}" for k, v in self.extra.items()]
        throttled = self._throttles.total
        if throttled:
            parts.append(f"throttled {throttled:,}")
        waiting = self._waiting
        if waiting is not None:
            parts.append(waiting.describe())
        return ", ".join(parts)

    def _write(self, line: str) -> None:
        print(line, file=self._stream, flush=True)


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or file-like stream without a terminal
        return False
