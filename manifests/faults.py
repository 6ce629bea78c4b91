"""Fault injection for tests: named points where a test can stall, pause or kill a real job.

    BUCKETEER_FAULTS="scan.task=exit-once:./died"        # the first scan task to finish its reads kills its worker
    BUCKETEER_FAULTS="cache.samples_committed=pause:120"  # embed pauses after its first commit of samples
    BUCKETEER_FAULTS="embed.unit=sleep:0.5"               # every embed unit takes half a second longer
    BUCKETEER_FAULTS="train.checkpoint=pause:300;scan.task=sleep:30"

One variable, ``POINT=ACTION:ARG`` entries separated by ``;``. The points (where the code calls
:func:`hit`) are :data:`POINTS`; the actions:

- ``sleep:SECONDS`` every time the point is reached;
- ``pause:SECONDS`` the first time in this process: print :func:`pause_marker` to stdout, then
  sleep; a SIGTERM ends the pause early (the process's own SIGTERM handler still runs);
- ``exit-once:PATH`` the first process to reach the point, of all processes sharing PATH's
  folder, ends itself with ``os._exit(1)``; PATH, created exclusively, holds its pid.

The variable is read and parsed once per process, at the first :func:`hit`; unset, a hit is one
dict lookup. A bad value is a ValueError naming the variable. It lives in manifests/ because
the pipeline jobs and the trainer both call it, and train/ may not import pipeline/.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

__all__ = ["FAULTS_ENV", "POINTS", "ACTIONS", "Fault", "parse_faults", "hit", "pause_marker"]

FAULTS_ENV = "BUCKETEER_FAULTS"
POINTS = {
    "scan.task": "a scan Ray task, after its reads, before it returns its result",
    "cache.samples_committed": "the cache committer, after a commit that wrote sample index rows (_cache.json written)",
    "embed.unit": "an embed encoder worker, after it wrote a unit's shard, before it returns the unit's index rows",
    "annotate.unit": "an annotate worker, after it wrote a unit's part, before it returns the unit's summary",
    "train.checkpoint": "the trainer, after every rank has saved a checkpoint and latest.json names it",
    "lock.taken": "a job that writes an artifact, right after it took the artifact's writer lock",
}
ACTIONS = {"sleep": "SECONDS", "pause": "SECONDS", "exit-once": "PATH"}


@dataclass(frozen=True)
class Fault:
    action: str  # a key of ACTIONS
    arg: str

    def seconds(self) -> float:
        return float(self.arg)


def _usage() -> str:
    return (f"use {FAULTS_ENV}='POINT=ACTION:ARG[;POINT=ACTION:ARG...]' with POINT one of {', '.join(POINTS)} "
            f"and ACTION:ARG one of {', '.join(f'{a}:{v}' for a, v in ACTIONS.items())}")  # fmt: skip


def parse_faults(text: str) -> dict[str, Fault]:
    """``{point: Fault}`` from a ``BUCKETEER_FAULTS`` value ('' -> {}).

    Raises ValueError naming the variable and the entry for an unknown point or action, a
    missing or non-numeric argument, or a point given twice.
    """
    faults: dict[str, Fault] = {}
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        point, eq, spec = (s.strip() for s in entry.partition("="))
        action, colon, arg = (s.strip() for s in spec.partition(":"))
        problem = None
        if not eq or point not in POINTS:
            problem = f"unknown fault point {point!r}"
        elif action not in ACTIONS or not colon or not arg:
            problem = f"{spec!r} is not ACTION:ARG"
        elif point in faults:
            problem = f"point {point!r} is given twice"
        elif ACTIONS[action] == "SECONDS":
            try:
                if float(arg) < 0:
                    problem = f"{arg!r} is not a number of seconds >= 0"
            except ValueError:
                problem = f"{arg!r} is not a number of seconds"
        if problem:
            raise ValueError(f"{FAULTS_ENV}={text!r}: entry {entry!r}: {problem}; {_usage()}")
        faults[point] = Fault(action, arg)
    return faults


def pause_marker(point: str) -> str:
    """The stdout line a ``pause`` prints when it starts (tests wait for it)."""
    return f"bucketeer-fault: {point} paused"


_faults: dict[str, Fault] | None = None  # parsed at the first hit
_paused: set[str] = set()


def hit(point: str) -> None:
    """Run the fault set for ``point`` in ``$BUCKETEER_FAULTS``, if any (see the module docstring)."""
    global _faults
    if _faults is None:
        _faults = parse_faults(os.environ.get(FAULTS_ENV, ""))
    if not _faults:
        return
    assert point in POINTS, f"unregistered fault point {point!r}"
    fault = _faults.get(point)
    if fault is None:
        return
    if fault.action == "sleep":
        time.sleep(fault.seconds())
    elif fault.action == "pause" and point not in _paused:
        _paused.add(point)
        _pause(point, fault.seconds())
    elif fault.action == "exit-once":
        _exit_once(fault.arg)


def _pause(point: str, seconds: float) -> None:
    """Print the pause marker, then sleep ``seconds`` or until a SIGTERM, which is then handed to the
    handler installed before. The handler is in place before the marker is printed, so a test that
    signals as soon as it reads the marker cannot land its signal outside the pause."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        print(pause_marker(point), flush=True)
        time.sleep(seconds)
        return
    woken = threading.Event()
    before = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame) -> None:
        woken.set()
        if callable(before):
            before(signum, frame)
        elif before == signal.SIG_DFL:  # what the signal would have done: end the process
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        print(pause_marker(point), flush=True)
        deadline = time.monotonic() + seconds
        while not woken.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)  # short sleeps: a handler that only sets a flag does not cut a long one short
    finally:
        if before is not None:  # None: a handler not installed from Python, which stays
            signal.signal(signal.SIGTERM, before)


def _exit_once(path: str) -> None:
    try:
        marker = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(marker, str(os.getpid()).encode())
    os.close(marker)
    os._exit(1)
