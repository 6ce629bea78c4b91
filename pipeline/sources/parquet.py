"""Scan parquet files with an image-bytes column: only the needed columns, row group by row group.

One file (:func:`scan_parquet_file`): the footer is read, then for each row group only the image
column (and the caption column, when given) through :class:`manifests.storage.RangedFile` (every
read a retried ranged GET, never a whole-object download of the other columns). The image column
is raw ``binary``/``large_binary`` or HuggingFace ``datasets``' ``Image`` struct ``{"bytes", "path"}``.
Each image's header is probed from the bytes already in hand (:func:`pipeline.sources.headers.probe_header`
and the checks of :mod:`pipeline.sources.results`), so the scan reads the image column whole: a parquet
file cannot give an image's first bytes without its column chunk. ``bytes_read`` of a row is the
image's size for that reason.

Rows: ``filename`` is ``<file>/<row>``, the file relative to the root and the row's 0-based number
in the whole file (over all row groups: what ``pandas.read_parquet(file).iloc[row]`` shows), unique
and stable while the file is unchanged; ``row_group`` and ``row_index`` (within the row group) say
where embed finds the bytes; ``size`` is the image's byte length. A null, empty or broken image is
an error row whose message names the file and the row; a struct row with only a ``path`` (an image
stored outside the file) is ``empty``. A file that is not parquet, or whose row group cannot be
decoded, is one ``corrupt_container`` row named after the file (rows before that point are kept);
a file whose reads fail after the retries one ``read_failed`` row, read again by the next scan.
A missing or mistyped ``--image-column``/``--caption-column`` stops the scan (UsageError).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from manifests.errors import StorageError, UsageError
from manifests.retry import is_permanent, is_storage_failure
from manifests.schema import MASK_ALPHA, MAX_PIXELS
from manifests.storage import RangedFile, join, redact
from pipeline.sources.captions import normalise_caption
from pipeline.sources.headers import probe_header
from pipeline.sources.listing import FileEntry
from pipeline.sources.masks import mask_column
from pipeline.sources.results import Header, checked
from pipeline.sources.shards import combine_scans, open_work, read_failed_row

__all__ = ["PARQUET_ROWS", "VIDEO_PARQUET_ROWS", "ParquetScan", "image_bytes", "image_column_error", "row_name",
           "scan_parquet_file", "scan_parquet_files", "scan_parquet_batch", "scan_video_parquet_batch"]  # fmt: skip

PARQUET_THREADS = 8  # files read at once per task on an object store: each holds one row group's images

PARQUET_ROWS = pa.schema(
    [
        pa.field("filename", pa.string(), nullable=False),  # <file>/<row>, or <file> for the file's own row
        pa.field("container", pa.string(), nullable=False),
        pa.field("container_size", pa.int64()),
        pa.field("etag", pa.string()),  # the file's
        pa.field("mtime", pa.float64()),
        pa.field("row_group", pa.int32()),
        pa.field("row_index", pa.int64()),
        pa.field("size", pa.int64()),  # bytes of the image
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
        pa.field("format", pa.string()),
        pa.field("orientation", pa.int8()),
        pa.field("error", pa.string()),
        pa.field("message", pa.string()),
        pa.field("bytes_read", pa.int64()),
        pa.field("caption", pa.string()),
        pa.field("caption_source", pa.string()),
        pa.field("mask", pa.string()),  # scan --masks: "column:NAME" (its bytes in that column) or "alpha"
        pa.field("mask_size", pa.int64()),  # bytes of the mask value
    ]
)


def row_name(container: str, row: int) -> str:
    """``filename`` of row ``row`` (0-based, over the whole file) of parquet file ``container``."""
    return f"{container}/{row}"


def image_column_error(schema: pa.Schema, column: str) -> str | None:
    """Why ``column`` of ``schema`` cannot hold image bytes (None when it can)."""
    if column not in schema.names:
        return f"has no column {column!r} (columns: {', '.join(schema.names[:20])})"
    kind = schema.field(column).type
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return None
    if pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0:
        inner = kind.field(kind.get_field_index("bytes")).type
        if pa.types.is_binary(inner) or pa.types.is_large_binary(inner):
            return None
    return f"column {column!r} is {kind}, not image bytes (binary, or a struct with a binary 'bytes' field)"


def image_bytes(column: pa.ChunkedArray | pa.Array) -> list[bytes | None]:
    """The image bytes of an image column (binary, or the ``bytes`` field of a ``{"bytes", "path"}`` struct)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_struct(column.type):
        # a null struct's child may hold a value: the struct's validity decides
        values = column.field("bytes").to_pylist()
        valid = column.is_valid().to_pylist()
        return [v if ok else None for v, ok in zip(values, valid)]
    return column.to_pylist()


def _paths(column: pa.ChunkedArray) -> list[str | None]:
    column = column.combine_chunks()
    if not pa.types.is_struct(column.type) or column.type.get_field_index("path") < 0:
        return [None] * len(column)
    return column.field("path").cast(pa.string()).to_pylist()


@dataclass
class ParquetScan:
    """What scanning one parquet file found: rows (columns of :data:`PARQUET_ROWS`) and counts."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    requests: int = 0
    bytes_read: int = 0  # every byte fetched from the file: footer and column chunks
    images: int = 0


class _CountingFile(RangedFile):
    """:class:`~manifests.storage.RangedFile` counting requests and bytes."""

    def __init__(self, fs, path: str, size: int):
        super().__init__(fs, path, size)
        self.requests = 0
        self.bytes = 0

    def read(self, n: int = -1) -> bytes:
        data = super().read(n)
        self.requests += 1
        self.bytes += len(data)
        return data


VIDEO_PARQUET_ROWS = pa.schema([*PARQUET_ROWS, pa.field("frames", pa.int32()), pa.field("fps", pa.float64()),
                                pa.field("duration", pa.float64()), pa.field("codec", pa.string()),
                                pa.field("frame_count_from", pa.string())])  # scan --frames: a column of videos


def _describe_video(blob: bytes | None, path: str | None) -> dict[str, Any]:
    """A video value's columns, from its container header (:func:`pipeline.sources.video.probe_video` over
    the bytes in hand); ``bytes_read`` stays the value's size: its row group's column chunk was read."""
    from pipeline.sources.video import probe_video

    if blob is None:
        where = f" (only a path, {path!r}: the video is stored outside the file)" if path else ""
        return {"error": "empty", "message": f"the video column is null{where}"}
    probe = probe_video(lambda start, end: blob[start:end], len(blob))
    found = {k: v for k, v in probe.__dict__.items() if k in VIDEO_PARQUET_ROWS.names and k != "bytes_read"}
    return {**found, "format": probe.format.split(",")[0] if probe.format else None}


def _describe_image(blob: bytes | None, path: str | None, max_pixels: int) -> dict[str, Any]:
    probe = _probe(blob, path, max_pixels)
    return {"width": probe.width, "height": probe.height, "format": probe.format, "orientation": probe.orientation,
            "error": probe.error, "message": probe.message, "alpha": probe.alpha}  # fmt: skip


def _probe(blob: bytes | None, path: str | None, max_pixels: int):
    if blob is None:
        where = f" (only a path, {path!r}: the image is stored outside the file)" if path else ""
        return checked(Header(error="empty", message=f"the image column is null{where}"), max_pixels)
    return probe_header(lambda start, end: blob[start:end], len(blob), max_pixels=max_pixels,
                        first_read=max(16, len(blob)), head=blob)  # fmt: skip


def scan_parquet_file(
    fs,
    root: str,
    entry: FileEntry,
    *,
    image_column: str,
    caption_column: str | None = None,
    max_pixels: int = MAX_PIXELS,
    masks: str | None = None,
    video: bool = False,
) -> ParquetScan:
    """Scan the parquet file ``entry`` (name relative to ``root`` on ``fs``, size in bytes).

    Returns its rows (see the module docstring). ``video`` (``scan --frames``): the column holds videos,
    each probed from its container header in the bytes in hand (:data:`VIDEO_PARQUET_ROWS`).
    ``masks`` (``scan --masks``): ``column:NAME`` reads that column of mask bytes too (a null value: no
    mask), ``alpha`` takes an image with alpha as its own mask.
    Raises UsageError when the file lacks the image, caption or mask column, or they hold no image bytes /
    text; storage failures (after the retries of
    :func:`manifests.storage.read_bytes`) propagate as StorageError.
    """
    out = ParquetScan()
    base = {"container": entry.name, "container_size": entry.size, "etag": entry.etag, "mtime": entry.mtime}
    file = _CountingFile(fs, join(root, entry.name), entry.size)
    try:
        try:
            parquet = pq.ParquetFile(file)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
            if isinstance(e, StorageError) or (isinstance(e, OSError) and is_storage_failure(e)):
                raise
            out.rows.append({**base, "filename": entry.name, "size": entry.size, "error": "corrupt_container",
                             "message": f"not a readable parquet file: {e}"})  # fmt: skip
            return out
        schema = parquet.schema_arrow
        problem = image_column_error(schema, image_column)
        if problem:
            raise UsageError(f"{entry.name} {problem}; pass the column of image bytes as --image-column")
        columns = [image_column]
        if caption_column is not None:
            if caption_column not in schema.names:
                raise UsageError(f"{entry.name} has no column {caption_column!r} (columns: "
                                 f"{', '.join(schema.names[:20])}); pass --caption-column, or leave it out")
            kind = schema.field(caption_column).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise UsageError(f"--caption-column {caption_column!r} of {entry.name} is {kind}, not text")
            columns.append(caption_column)
        masked = mask_column(masks)
        if masked is not None:
            problem = image_column_error(schema, masked)
            if problem:
                raise UsageError(f"{entry.name} {problem}; --masks column:NAME names the column of mask bytes")
            columns.append(masked)
        source = f"column:{entry.name}:{caption_column}" if caption_column else None
        row = 0
        for group in range(parquet.num_row_groups):
            try:
                table = parquet.read_row_group(group, columns=columns)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
                if isinstance(e, StorageError) or (isinstance(e, OSError) and is_storage_failure(e)):
                    raise
                out.rows.append({**base, "filename": entry.name, "size": entry.size, "error": "corrupt_container",
                                 "message": f"row group {group} cannot be decoded: {e}; {row} rows before it were "
                                 "scanned, nothing after it (re-create or re-download the file)"})  # fmt: skip
                break
            images = image_bytes(table.column(image_column))
            paths = _paths(table.column(image_column))
            captions = (table.column(caption_column).to_pylist() if caption_column is not None
                        else [None] * table.num_rows)  # fmt: skip
            mask_blobs = image_bytes(table.column(masked)) if masked is not None else [None] * table.num_rows
            for index, (blob, path, caption, mask) in enumerate(zip(images, paths, captions, mask_blobs)):
                found = _describe_video(blob, path) if video else _describe_image(blob, path, max_pixels)
                alpha = found.pop("alpha", False)
                caption = normalise_caption(caption) if caption is not None else None
                if found.get("message") is not None:
                    where = f"row {row} (row group {group}, index {index}) of {entry.name}"
                    found["message"] = f"{where}: {found['message']}"
                out.rows.append({**base, "filename": row_name(entry.name, row), "row_group": group,
                                 "row_index": index, "size": len(blob) if blob is not None else 0, **found,
                                 "bytes_read": len(blob) if blob is not None else 0, "caption": caption,
                                 "caption_source": source if caption is not None else None})  # fmt: skip
                if mask is not None:
                    out.rows[-1].update(mask=f"column:{masked}", mask_size=len(mask))
                elif masks and "alpha" in masks.split(",") and alpha:
                    out.rows[-1]["mask"] = MASK_ALPHA
                out.images += 1
                row += 1
    finally:
        out.requests, out.bytes_read = file.requests, file.bytes
    return out


def _scan_one(fs, root: str, entry: FileEntry, config: Any, video: bool = False) -> ParquetScan:
    try:
        return scan_parquet_file(fs, root, entry, image_column=config.image_column,
                                 caption_column=config.caption_column, max_pixels=config.max_pixels,
                                 masks=getattr(config, "masks", None), video=video)  # fmt: skip
    except FileNotFoundError as e:  # gone since the listing
        cause: BaseException = e
    except StorageError as e:
        cause = e.__cause__ or e
        if is_permanent(cause) and type(fs) is not LocalFileSystem:
            raise StorageError(f"reading {entry.name}: {redact(str(cause))}") from None
    return ParquetScan(rows=[read_failed_row(entry, cause)])


def scan_parquet_files(fs, root: str, files: list[FileEntry], config: Any, *, video: bool = False) -> pa.Table:
    """Scan ``files`` (names relative to ``root`` on ``fs``), up to :data:`PARQUET_THREADS` at once
    on an object store. Returns a :data:`PARQUET_ROWS` table (``video``: :data:`VIDEO_PARQUET_ROWS`); its
    schema metadata ``stats`` holds the summed counts, as :func:`pipeline.sources.shards.scan_shards` does."""
    threads = 1 if type(fs) is LocalFileSystem else max(1, min(PARQUET_THREADS, len(files)))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="parquet") as pool:
        scans = list(pool.map(lambda f: _scan_one(fs, root, f, config, video), files))
    return combine_scans(scans, VIDEO_PARQUET_ROWS if video else PARQUET_ROWS)


def scan_parquet_batch(target: tuple, batch: pa.Table, config: Any) -> pa.Table:
    """One Ray task: :func:`scan_parquet_files` over the files of ``batch`` (a ``shard_work`` table)."""
    fs, root, files = open_work(target, batch)
    return scan_parquet_files(fs, root, files, config)


def scan_video_parquet_batch(target: tuple, batch: pa.Table, config: Any) -> pa.Table:
    """One Ray task of ``scan --frames --format parquet``: :func:`scan_parquet_files` of a column of videos."""
    fs, root, files = open_work(target, batch)
    return scan_parquet_files(fs, root, files, config, video=True)
