"""One scan task's I/O: the first bytes of many images and their sidecar captions, then the probes.

:func:`probe_files` reads, for every :class:`~pipeline.sources.listing.WorkItem`, the image's first
``first_read`` bytes (one ranged read; sized to hold a typical JPEG/PNG/WebP header, so most
images cost exactly one request) and its sidecar caption (one more), and probes the header
(:func:`pipeline.sources.headers.probe_header`) in this thread as the reads come back. How the reads
are made depends on the filesystem, all through :mod:`manifests.retry`:

- a local disk: ``os.pread`` on one open descriptor per file, in order (page-cache reads take
  microseconds; threads would only fight over the GIL);
- an asynchronous filesystem (s3fs, and any fsspec ``AsyncFileSystem``): up to ``in_flight``
  requests on its event loop (``_cat_file`` with a byte range, never a HEAD first), with the
  async retry layer;
- any other filesystem, and an asynchronous one whose ``blocking_reads`` says its blocking reads cost
  less (obstore's, :class:`manifests.objstore.ObstoreS3FileSystem`): ``in_flight`` threads calling
  ``cat_file``.

Reads that finished but were not probed yet are bounded by ``in_flight`` too, so a task's memory
stays near ``in_flight x first_read`` whatever its batch size. A sidecar is read as listed (an empty
one not at all: S3 refuses a byte range of an empty object), at most its first :data:`SIDECAR_LIMIT`
bytes (a caption longer than that is cut there).

The result is one Arrow table per task (:data:`PROBE_SCHEMA`): Ray ships it without per-row
objects and the driver assembles the manifest column by column.
"""

from __future__ import annotations

import asyncio
import os
import queue
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from manifests.errors import StorageError
from manifests.retry import is_permanent, with_retries, with_retries_async
from manifests.schema import MAX_PIXELS
from manifests.storage import join, redact
from pipeline.sources.captions import decode_caption
from pipeline.sources.headers import FIRST_READ, StorageFailure, probe_header
from pipeline.sources.listing import WorkItem
from pipeline.sources.results import Header, Probe, checked

__all__ = ["PROBE_SCHEMA", "SIDECAR_LIMIT", "probe_files"]

SIDECAR_LIMIT = 1 << 20  # bytes of a sidecar caption read at most
PROBE_SCHEMA = pa.schema(
    [
        pa.field("name", pa.string(), nullable=False),
        pa.field("probed", pa.bool_(), nullable=False),  # False: a sidecar-only item (a reused row's caption)
        pa.field("width", pa.int32()),  # checked: pipeline/sources/results.py
        pa.field("height", pa.int32()),
        pa.field("format", pa.string()),
        pa.field("orientation", pa.int8()),
        pa.field("error", pa.string()),
        pa.field("message", pa.string()),
        pa.field("bytes_read", pa.int64()),  # of the image
        pa.field("requests", pa.int32(), nullable=False),  # image and sidecar reads
        pa.field("caption", pa.string()),
        pa.field("caption_read", pa.bool_()),  # null: no sidecar; False: it could not be read
        pa.field("sidecar", pa.string()),  # the sidecar the caption was read from (an image may have several)
        pa.field("alpha", pa.bool_()),  # the header declares an alpha channel (scan --masks alpha)
    ]
)


@dataclass
class _Fetched:
    """The reads of one work item, as they came back: bytes, or the exception that outlived retries."""

    item: WorkItem
    head: bytes | BaseException | None  # the image's first read (None: not probed, or an empty file)
    sidecar: bytes | BaseException | None  # the sidecar's bytes (None: no sidecar)
    read_range: Callable[[int, int], bytes]  # more of the image, for a header past the first read


def probe_files(
    fs,
    root: str,
    items: list[WorkItem],
    *,
    max_pixels: int = MAX_PIXELS,
    first_read: int = FIRST_READ,
    in_flight: int = 64,
) -> pa.Table:
    """Probe ``items`` (names relative to ``root`` on ``fs``) with up to ``in_flight`` reads at once.

    Returns a :data:`PROBE_SCHEMA` table, one row per item, in no particular order. A transient
    storage error is retried; when retries run out the file becomes a ``read_failed`` row (and a
    sidecar an unread caption). Raises StorageError (message redacted) for a permanent failure of
    an object store, such as access denied; on a local disk that is the file's ``read_failed`` row.
    """
    local = type(fs) is LocalFileSystem  # a subclass may override its reads: it gets the generic path
    if local:
        reads = _local_reads(root, items, first_read)
    elif getattr(fs, "async_impl", False) and not getattr(fs, "blocking_reads", False):
        reads = _async_reads(fs, root, items, first_read, max(1, in_flight))
    else:
        reads = _threaded_reads(fs, root, items, first_read, max(1, in_flight))
    columns: dict[str, list] = {name: [] for name in PROBE_SCHEMA.names}
    for fetched in reads:
        item = fetched.item
        probe = _probe(fetched, max_pixels, first_read, local) if item.probe else None
        caption, caption_read = _caption(fetched, local)
        requests = (probe.requests if probe else 0) + (isinstance(fetched.sidecar, bytes) and item.sidecar_size > 0)
        row = (item.name, probe is not None, probe and probe.width, probe and probe.height, probe and probe.format,
               probe and probe.orientation, probe and probe.error, probe and probe.message,
               probe and probe.bytes_read, requests, caption, caption_read, item.sidecar,
               probe is not None and probe.alpha)  # fmt: skip
        for column, value in zip(columns.values(), row):
            column.append(value)
    return pa.table(columns, schema=PROBE_SCHEMA)


def _probe(fetched: _Fetched, max_pixels: int, first_read: int, local: bool) -> Probe:
    item = fetched.item
    try:
        if isinstance(fetched.head, BaseException):
            raise StorageFailure(fetched.head)
        return probe_header(fetched.read_range, item.size, max_pixels=max_pixels, first_read=first_read,
                            head=fetched.head, name=item.name)  # fmt: skip
    except StorageFailure as failure:
        cause = failure.cause
        if is_permanent(cause) and not local:
            raise StorageError(f"reading {item.name}: {redact(str(cause))}") from None
        message = redact(f"{type(cause).__name__}: {cause}")
        return checked(Header(error="read_failed", message=message), max_pixels)


def _caption(fetched: _Fetched, local: bool) -> tuple[str | None, bool | None]:
    item, data = fetched.item, fetched.sidecar
    if item.sidecar is None:
        return None, None
    if isinstance(data, BaseException):
        if is_permanent(data) and not local:
            raise StorageError(f"reading {item.sidecar}: {redact(str(data))}") from None
        return None, False  # counted as a caption that could not be read; the image stays usable
    return decode_caption(data or b""), True


def _retried(first: BaseException, call: Callable[[], bytes]) -> bytes | BaseException:
    """``call()`` through the retry layer, its failed first attempt (``first``) counted as attempt one."""
    failed = [first]

    def attempt() -> bytes:
        if failed:
            raise failed.pop()
        return call()

    try:
        return with_retries(attempt)
    except Exception as e:  # the item's own outcome
        return e


def _local_reads(root: str, items: list[WorkItem], first_read: int) -> Iterator[_Fetched]:
    for item in items:
        path = os.path.join(root, item.name)
        fd = -1
        head: bytes | BaseException | None = None
        if item.probe and item.size > 0:
            try:
                fd = os.open(path, os.O_RDONLY)
                head = os.pread(fd, min(first_read, item.size), 0)
            except OSError as e:
                head = _retried(e, lambda: _read_file(path, min(first_read, item.size)))
        sidecar: bytes | BaseException | None = None
        if item.sidecar is not None:
            sidecar_path = os.path.join(root, item.sidecar)
            limit = _sidecar_bytes(item)
            try:
                sidecar = _read_file(sidecar_path, limit) if limit else b""
            except OSError as e:
                sidecar = _retried(e, lambda: _read_file(sidecar_path, limit))
        descriptor = fd
        try:
            yield _Fetched(item, head, sidecar,
                           lambda start, end: with_retries(lambda: os.pread(descriptor, end - start, start)))
        finally:
            if fd >= 0:
                os.close(fd)


def _sidecar_bytes(item: WorkItem) -> int:
    """How much of the sidecar to read: its listed size (one request, no HEAD), at most SIDECAR_LIMIT."""
    return min(max(0, item.sidecar_size), SIDECAR_LIMIT)


def _read_file(path: str, limit: int) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read(limit)


def _threaded_reads(fs, root: str, items: list[WorkItem], first_read: int, in_flight: int) -> Iterator[_Fetched]:
    def read(path: str, end: int) -> bytes | BaseException:
        try:
            return with_retries(lambda: fs.cat_file(path, start=0, end=end))
        except Exception as e:
            return e

    def fetch(item: WorkItem) -> _Fetched:
        path = join(root, item.name)
        head = read(path, min(first_read, item.size)) if item.probe and item.size > 0 else None
        sidecar = None
        if item.sidecar is not None:
            sidecar = read(join(root, item.sidecar), _sidecar_bytes(item)) if item.sidecar_size > 0 else b""
        return _Fetched(item, head, sidecar,
                        lambda start, end: with_retries(lambda: fs.cat_file(path, start=start, end=end)))

    with ThreadPoolExecutor(max_workers=min(in_flight, max(1, len(items))), thread_name_prefix="probe") as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(fetch, item))
            if len(pending) >= in_flight:  # read-ahead bounded by in_flight items
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _async_reads(fs, root: str, items: list[WorkItem], first_read: int, in_flight: int) -> Iterator[_Fetched]:
    done: queue.Queue = queue.Queue()
    slots: list[asyncio.Semaphore] = []

    async def read(path: str, end: int) -> bytes | BaseException:
        try:
            return await with_retries_async(lambda: fs._cat_file(path, start=0, end=end))
        except Exception as e:
            return e

    async def fetch(item: WorkItem) -> None:
        path = join(root, item.name)
        head = sidecar = None
        try:
            if item.probe and item.size > 0:
                head = await read(path, min(first_read, item.size))
            if item.sidecar is not None:
                sidecar = await read(join(root, item.sidecar), _sidecar_bytes(item)) if item.sidecar_size > 0 else b""
        finally:
            done.put(_Fetched(item, head, sidecar,
                              lambda start, end: with_retries(lambda: fs.cat_file(path, start=start, end=end))))

    async def produce() -> None:
        slots.append(asyncio.Semaphore(in_flight))  # taken per item, given back once it is probed
        tasks = []
        for item in items:
            await slots[0].acquire()
            tasks.append(asyncio.ensure_future(fetch(item)))
        await asyncio.gather(*tasks)

    producer = asyncio.run_coroutine_threadsafe(produce(), fs.loop)
    try:
        for _ in items:
            while True:
                try:
                    fetched = done.get(timeout=1.0)
                    break
                except queue.Empty:
                    if producer.done():
                        producer.result()  # a bug in the producer: raise it here
            fs.loop.call_soon_threadsafe(slots[0].release)
            yield fetched
    finally:
        producer.cancel()
