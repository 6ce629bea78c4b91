"""``bucketeer review``: serve a page to look at a manifest with its annotations and decide, on this machine.

    bucketeer review MANIFEST --out DECISIONS [--annotations A,D] [--where SQL] [--port 8765]
    bucketeer plan MANIFEST --annotations DECISIONS --where "keep" --out PLAN ...

It prints one URL (with the session's token) and serves until Ctrl-C. Decisions go to ``--out``, an
annotations folder of task ``review`` (:mod:`pipeline.review.decisions`), durable on every decision; the
manifest, the annotations and the dataset are only read. Thumbnails are cached under ``--out``'s
``thumbs/`` when ``--out`` is a local folder, else under ``$BUCKETEER_HOME/review/`` (``~/.cache/bucketeer``).
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import hashlib
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

from manifests.errors import UsageError
from manifests.manifest import read_manifest
from manifests.storage import open_url, parse_storage_options, redact

__all__ = ["ReviewJob", "add_arguments", "job_from_args", "run", "session"]

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True, kw_only=True)
class ReviewJob:
    """``bucketeer review``: serve ``manifest`` (with ``annotations``) and write decisions to ``out``."""

    manifest: str
    out: str
    annotations: tuple[str, ...] = ()
    where: str | None = None  # the filter the page opens with
    host: str = "127.0.0.1"
    port: int = 8765  # 0: any free port
    reviewer: str = field(default_factory=getpass.getuser)  # recorded with each decision
    storage_options: dict[str, Any] = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", help="manifest folder (local path or URL)")
    parser.add_argument("--out", required=True, metavar="DECISIONS",
                        help="annotations folder for the decisions (task review); an existing one is resumed")
    parser.add_argument("--annotations", default=None, metavar="A[,B...]",
                        help="annotations folders whose columns the page shows, filters and sorts by")
    parser.add_argument("--where", default=None, metavar="SQL", help="the filter the page opens with (SQL as "
                        "bucketeer plan --where)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; another "
                        "lets others on the network see the dataset: a warning is printed)")
    parser.add_argument("--port", type=int, default=8765, help="port to listen on (0: any free port)")
    parser.add_argument("--reviewer", default=None, help="name recorded with each decision (default: the login)")
    parser.add_argument("--storage-options", default=None, help="fsspec options as JSON, e.g. an endpoint_url")


def job_from_args(args: argparse.Namespace) -> ReviewJob:
    """The job of ``bucketeer review``'s options; raises UsageError for bad ``--storage-options``."""
    return ReviewJob(manifest=args.manifest, out=args.out, where=args.where, host=args.host, port=args.port,
                     annotations=tuple(a.strip() for a in (args.annotations or "").split(",") if a.strip()),
                     reviewer=args.reviewer or getpass.getuser(),
                     storage_options=parse_storage_options(args.storage_options))  # fmt: skip


def thumbs_folder(out: str, storage_options: dict[str, Any]) -> str:
    """Where the session caches images: ``OUT/thumbs`` for a local ``out``, else ``$BUCKETEER_HOME/review/<hash>``."""
    fs, root = open_url(out, storage_options)
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return os.path.join(root, "thumbs")
    name = hashlib.sha256(redact(out).encode()).hexdigest()[:16]
    home = os.environ.get("BUCKETEER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "bucketeer")
    return os.path.join(home, "review", name)


@contextlib.contextmanager
def session(job: ReviewJob) -> Iterator[tuple[str, Any]]:
    """Read everything, take ``out``'s writer lock and serve: yields ``(url, data)`` for the ``with`` block.
    Raises UsageError for a bad manifest, annotations, filter or port, and WriterBusyError when another
    review writes ``out``."""
    from pipeline.review.data import ReviewData
    from pipeline.review.decisions import DecisionLog
    from pipeline.review.server import serving
    from pipeline.review.thumbs import ThumbCache

    if not 0 <= job.port <= 65535:
        raise UsageError(f"--port {job.port}: give a port from 1 to 65535 (0: any free port)")
    if job.host not in LOCAL_HOSTS:
        print(f"bucketeer review: warning: --host {job.host} serves the dataset's images to whoever reaches this "
              "address and has the URL; use 127.0.0.1 (the default) with an SSH tunnel to share it safely",
              file=sys.stderr, flush=True)  # fmt: skip
    manifest = read_manifest(job.manifest, job.storage_options)
    with DecisionLog.open(job.out, manifest, job.reviewer, job.storage_options) as log:
        data = ReviewData.load(manifest, job.annotations, log, job.storage_options)
        if job.where:
            data.view(job.where)  # a bad filter is refused here, not on the page
        thumbs = ThumbCache(manifest, thumbs_folder(job.out, job.storage_options), job.storage_options,
                            log.image_keys)  # fmt: skip
        with serving(data, thumbs, job.host, job.port, job.where) as url:
            yield url, data


def run(job: ReviewJob, stop: threading.Event | None = None) -> None:
    """Serve until Ctrl-C, SIGTERM or ``stop`` is set, printing the URL to open."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():  # `kill` stops it as Ctrl-C does: the lock released
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with session(job) as (url, data):
        print(f"bucketeer review: {data.manifest.samples.num_rows:,} samples of {redact(job.manifest)}; "
              f"decisions to {redact(job.out)}", flush=True)  # fmt: skip
        print(f"open {url}", flush=True)
        print("(Ctrl-C to stop: every decision is already written)", flush=True)
        try:
            while not stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
