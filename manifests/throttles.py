"""A job's throttled storage answers, counted over every process it runs in.

:mod:`manifests.retry` counts the throttled answers (S3's ``503 SlowDown``, R2's ``429``) of the process it
runs in (:func:`~manifests.retry.throttled_requests`). A job runs in many: its driver, Ray tasks and actors
on several nodes, threads. So each task takes a :func:`throttle_mark` before its work and returns a
:func:`throttle_span` with its result (rows carry them from stage to stage); the driver adds them to the
job's :class:`ThrottleTally`, which keeps each process's lowest and highest count, never a sum of
differences, so that a span given twice, or tasks that ran at once in one process, count once. The tally
of the job running in this thread is :func:`job_throttles` (:func:`counting_throttles` sets it): the
progress line (:class:`~manifests.progress.Progress`) shows its total, and the job writes it into its
summary.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import socket
import threading
from typing import Iterator

import pyarrow as pa

from manifests.retry import throttled_requests

__all__ = ["SPANS", "throttle_mark", "throttle_span", "carry_spans", "ThrottleTally", "counting_throttles",
           "job_throttles"]  # fmt: skip

SPANS = pa.list_(pa.string())  # the column of spans a stage's rows carry to the next stage and the driver


def throttle_mark() -> tuple[str, int]:
    """``(process, count)``: this process (host and pid) and its :func:`throttled_requests` now. A task
    takes one before its work and returns :func:`throttle_span` of it after."""
    return f"{socket.gethostname()}:{os.getpid()}", throttled_requests()


def throttle_span(before: tuple[str, int]) -> str:
    """What a task returns for the throttled answers of its process since ``before`` (a :func:`throttle_mark`):
    a short JSON text, for :meth:`ThrottleTally.add`."""
    return json.dumps([before[0], before[1], throttled_requests()])


def carry_spans(carried: list[str] | None, before: tuple[str, int]) -> list[str]:
    """The spans a row carries on: those it came with (None: none), and this stage's since ``before``."""
    return sorted({*(carried or ()), throttle_span(before)})


class ThrottleTally:
    """The throttled answers of one job, over every process it ran in: this process's from the tally's making
    (the driver's own reads, and workers that run in it), and each other process's from the lowest count to
    the highest its tasks' spans (:func:`throttle_span`) report. A span given twice, or spans of tasks that ran
    at once in one process, count once: the tally keeps each process's range, never a sum of differences."""

    def __init__(self) -> None:
        self._here = throttle_mark()
        self._ranges: dict[str, tuple[int, int]] = {}
        self._guard = threading.Lock()

    def add(self, *spans: str) -> None:
        """Take in the spans the job's tasks returned."""
        with self._guard:
            for span in spans:
                process, low, high = json.loads(span)
                known = self._ranges.get(process)
                self._ranges[process] = (low, high) if known is None else (min(known[0], low), max(known[1], high))

    @property
    def total(self) -> int:
        """The job's throttled answers so far."""
        with self._guard:
            ranges = {**self._ranges, self._here[0]: (self._here[1], throttled_requests())}
        return sum(high - low for low, high in ranges.values())


_tally: contextvars.ContextVar[ThrottleTally | None] = contextvars.ContextVar("bucketeer_throttles", default=None)


@contextlib.contextmanager
def counting_throttles() -> Iterator[ThrottleTally]:
    """Count a job's throttled answers (a :class:`ThrottleTally`) for the ``with`` block: its progress lines
    (:class:`~manifests.progress.Progress`) and its summary read it; its driver adds its tasks' spans."""
    tally = ThrottleTally()
    token = _tally.set(tally)
    try:
        yield tally
    finally:
        _tally.reset(token)


def job_throttles() -> ThrottleTally | None:
    """The :class:`ThrottleTally` of the job this code runs in (:func:`counting_throttles`), or None."""
    return _tally.get()
