"""Header-only Ray scan of a local folder or s3:// prefix into a parquet manifest.

    bucketeer scan s3://bucket/ds --out s3://bucket/manifests/ds --storage-options '{"endpoint_url": "…"}'
    ray job submit --working-dir . -- python -m pipeline.scan s3://bucket/ds --out s3://bucket/manifests/ds

The source is listed once (on the driver, key ranges in parallel); the files to read are cut into
batches, one Ray task per batch, and each task keeps many ranged reads in flight
(:func:`pipeline.sources.reading.probe_files`: ``os.pread`` on a local disk, s3fs's async API on an
object store) and probes each header as its first bytes arrive. Only the first bytes of each image
are read, with its sidecar caption in the same pass. A task returns an Arrow table; the driver
assembles the rows column by column, buckets them through :func:`manifests.manifest.apply_buckets`
and commits them with :func:`manifests.manifest.write_manifest` (parts first, ``_manifest.json``
last), so a killed scan leaves the previous manifest readable and a re-run gives the same manifest
as a clean run. No file can fail the scan: every value read from a file is checked before it
reaches a row (:mod:`pipeline.sources.results`), and a file's problem is its error row.
Files probed are reported as they come back (:class:`manifests.progress.Progress`: a bar on a
terminal, a plain line every 30 s in a Ray job's log; ``--no-progress`` for neither).

Incremental: rows of the manifest already at ``--out`` (or ``--previous``) whose file size and
ETag (mtime when the store has no ETag) are unchanged are reused without reading the file; their
sidecar caption is read again only when the listed sidecar is not the version recorded in the
row's ``caption_source`` (see manifests/schema.py). An image with numbered sidecars (``img.1.txt``,
...: :func:`pipeline.sources.listing.image_sidecars`) gets one work item per further sidecar, read in
its task; all of them are read again when any one changed.
A source of WebDataset ``.tar`` shards is scanned by :mod:`pipeline.sources.containers` (member
headers walked by ranged reads, reuse per shard); shards mixed with loose images, and compressed
shards, are refused there with what to do. ``--format parquet`` scans the ``.parquet`` files of the
source instead (:mod:`pipeline.sources.parquet`: the ``--image-column`` and ``--caption-column``
of each row group, reuse per file); without it, a source of nothing but parquet files is refused
with the options to pass, and parquet files beside images are counted as ignored.
``--conditioning`` pairs each sample with a conditioning image (:mod:`pipeline.scan.conditioning`):
its header is probed by the same tasks after the images', and a bad pair is an error row.
Without ``--ray-address`` (or ``RAY_ADDRESS``) Ray starts in-process on this machine.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests import faults
from manifests.buckets import BucketSpec, add_bucket_arguments, spec_from_args
from manifests.manifest import apply_buckets, conform, write_manifest
from manifests.errors import StorageError, UsageError
from manifests.schema import ERRORS_SCHEMA, MAX_PIXELS, sample_ids
from manifests.storage import open_url, parse_storage_options, redact
from pipeline.formats import IMAGE_EXTENSIONS, missing_format_hint, register_plugins
from pipeline.sources.captions import CaptionTable, caption_list, load_caption_table
from pipeline.scan.conditioning import pair, probe_target, resolve
from pipeline.sources.headers import FIRST_READ
from pipeline.sources.listing import (
    IMAGE_SCHEMA,
    Listing,
    RescanPlan,
    caption_source,
    image_sidecars,
    list_source,
    plan_rescan,
    work_items,
    work_table,
)
from pipeline.sources.reading import PROBE_SCHEMA, probe_files
from pipeline.sources.tasks import run_tasks
from pipeline.sources.tar import SHARD_WINDOW
from manifests.retry import is_storage_failure

log = logging.getLogger("bucketeer.scan")
FORMATS = ("auto", "parquet")  # --format


@dataclass(frozen=True)
class ScanConfig:
    """Tuning of the scan; the defaults suit a 2-64 core cluster reading from S3."""

    max_pixels: int = MAX_PIXELS  # declared pixel count above this -> too_many_pixels (recorded in the manifest)
    header_bytes: int = FIRST_READ  # first ranged read per image
    reads_in_flight: int = 128  # storage requests in flight per Ray task (object stores)
    files_per_task: int | None = None  # None: enough tasks to keep every CPU busy 4 times over
    progress: bool = True  # a bar on a terminal, else a line every $BUCKETEER_PROGRESS_SECONDS
    shard_window: int = SHARD_WINDOW  # tar shards: bytes read at each member header
    caption_field: str = "caption"  # tar shards: the field of a key's .json member that holds its caption
    format: str = "auto"  # auto: loose images or tar shards, found by extension; parquet: .parquet files
    image_column: str = "image"  # parquet: the column of image bytes (binary, or HF's {"bytes", "path"} struct)
    caption_column: str | None = None  # parquet: the column of captions (None: no captions)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="dataset root: a local folder or s3://bucket/prefix")
    parser.add_argument("--out", required=True, help="manifest folder to write (an existing manifest there is reused)")
    parser.add_argument("--captions", default=None, metavar="URL",
                        help="caption table (parquet, jsonl or csv with filename + caption columns; the caption "
                        "column may be a list of strings: several captions); images not in it fall back to "
                        ".txt/.caption sidecars (numbered img.1.txt, img.2.txt, ...: more captions)")  # fmt: skip
    parser.add_argument("--conditioning", default=None, metavar="ROOT_OR_COLUMN",
                        help="a conditioning image per sample (ControlNet map, edit pair): a column of the --captions "
                        "table holding its path relative to the source root, else a root (folder or URL) holding "
                        "it at the sample's own relative path. Missing or differently sized pairs are error "
                        "rows")  # fmt: skip
    parser.add_argument("--previous", default=None, metavar="MANIFEST",
                        help="reuse unchanged rows from this manifest (default: the one at --out, if any)")  # fmt: skip
    parser.add_argument("--storage-options", default=None, help="fsspec options as JSON, e.g. an endpoint_url")
    parser.add_argument("--max-pixels", type=int, default=MAX_PIXELS,
                        help="images declaring more pixels are errors (too_many_pixels), never decoded; recorded "
                        f"in the manifest, embed decodes up to it (default and most {MAX_PIXELS:,}: "
                        "what Pillow decodes)")  # fmt: skip
    parser.add_argument("--header-bytes", type=int, default=FIRST_READ,
                        help="first ranged read per image (default 64 KiB)")
    parser.add_argument("--reads-in-flight", type=int, default=ScanConfig.reads_in_flight,
                        help="storage requests in flight per Ray task on an object store (default 128)")
    parser.add_argument("--files-per-task", type=int, default=None,
                        help="batch size of one Ray task (default: automatic)")
    parser.add_argument("--shard-window", type=int, default=SHARD_WINDOW,
                        help="tar shards: bytes read at each member header, which also covers the small members "
                        "after it and the next image's header (default 4 KiB)")  # fmt: skip
    parser.add_argument("--caption-field", default="caption",
                        help="tar shards: the field of a sample's .json member to take the caption from when it "
                        "has no .txt/.caption member, a string or a list of strings (default: caption)")  # fmt: skip
    parser.add_argument("--format", choices=FORMATS, default="auto",
                        help="auto (default): loose image files, or WebDataset .tar shards, told apart by extension; "
                        "parquet: the .parquet files of the source, one image per row (--image-column)")  # fmt: skip
    parser.add_argument("--image-column", default="image",
                        help="--format parquet: the column of image bytes: binary, or the HuggingFace datasets "
                        "Image struct {bytes, path} (default: image)")  # fmt: skip
    parser.add_argument("--caption-column", default=None,
                        help="--format parquet: the column of captions (text); default: no captions")
    parser.add_argument("--ray-address", default=None,
                        help="Ray cluster to use (default: $RAY_ADDRESS, else start one here)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar or progress lines (the summary line is always printed)")
    add_bucket_arguments(parser)
    parser.epilog = (f"Images: {', '.join(sorted(IMAGE_EXTENSIONS))} (any case): what this Pillow and its "
                     "installed plugins open. Hidden and ._* files are ignored; other files are counted by extension.")


def run(args: argparse.Namespace) -> int:
    options = parse_storage_options(args.storage_options)
    config = ScanConfig(
        max_pixels=args.max_pixels, header_bytes=args.header_bytes, reads_in_flight=args.reads_in_flight,
        files_per_task=args.files_per_task, progress=not args.no_progress, shard_window=args.shard_window,
        caption_field=args.caption_field, format=args.format, image_column=args.image_column,
        caption_column=args.caption_column,
    )  # fmt: skip
    for name in ("max_pixels", "header_bytes", "reads_in_flight", "shard_window"):
        if getattr(config, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if config.format != "parquet" and (args.caption_column or args.image_column != "image"):
        raise UsageError("--image-column and --caption-column are for parquet sources: add --format parquet")
    if config.max_pixels > MAX_PIXELS:
        raise UsageError(f"--max-pixels {config.max_pixels:,} is above {MAX_PIXELS:,}: Pillow refuses to decode "
                         "larger images, so embed could not use them; the option can only lower the limit")
    meta = scan_dataset(
        args.source, args.out, spec=spec_from_args(args), storage_options=options, captions=args.captions,
        previous=args.previous, config=config, ray_address=args.ray_address, conditioning=args.conditioning,
    )  # fmt: skip
    print(summary_line(meta, args.out))
    return 0


def ignored_line(ignored_extensions: dict[str, int], top: int = 4) -> str:
    """The most common ignored extensions, e.g. ``200,000 .heic (pip install 'bucketeer[heif]'), 3 .md``."""
    ranked = sorted(ignored_extensions.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = []
    for ext, n in ranked[:top]:
        hint = missing_format_hint(ext)
        name = f".{ext}" if ext and not ext.startswith("(") else (ext or "(no extension)")
        parts.append(f"{n:,} {name}" + (f" ({hint})" if hint else ""))
    if len(ranked) > top:
        parts.append(f"{sum(n for _, n in ranked[top:]):,} more")
    return ", ".join(parts)


def summary_line(meta: dict[str, Any], out: str) -> str:
    """The closing line: counts, ignored files by extension, reuse, reads and speed."""
    s = meta["summary"]
    if "shards" in s:
        from pipeline.sources.containers import summary_line as shards_summary_line  # it imports this module's parts

        return shards_summary_line(meta, out)
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(s["errors_by_kind"].items())) or "none"
    ignored = ignored_line(s.get("ignored_extensions") or {})
    hidden = s.get("ignored_hidden", 0)
    others = "; ".join(p for p in (ignored, f"{hidden} hidden" if hidden else "") if p)
    pairs = (f" | conditioning: {s['conditioning_probed']} probed, {s['conditioning_errors']} bad pairs, "
             f"{s['conditioning_files']} under the source not counted as samples") if "conditioning_probed" in s else ""
    return (
        f"scanned {s['listed']} images ({s['ignored']} other files ignored{': ' + others if others else ''}): "
        f"{s['samples']} samples, {s['errors']} errors ({kinds}) | reused {s['reused']}, new {s['new']}, "
        f"changed {s['changed']}, deleted {s['deleted']}{pairs} | read {s['files_read']} files, {s['mb_read']:.1f} MB "
        f"(median {s['median_bytes_read'] / 1024:.0f} KiB, {s['requests_per_file']:.2f} requests per file) in "
        f"{s['seconds']:.1f} s, {s['files_per_s']:.0f} files/s -> {redact(out)} "
        f"(fingerprint {meta['fingerprint'][:12]})"
    )


def scan_dataset(
    source: str,
    out: str,
    *,
    spec: BucketSpec,
    storage_options: dict[str, Any] | None = None,
    captions: str | None = None,
    previous: str | None = None,
    config: ScanConfig = ScanConfig(),
    ray_address: str | None = None,
    fs=None,
    conditioning: str | None = None,
) -> dict[str, Any]:
    """Scan ``source`` into a manifest at ``out``; returns the committed ``_manifest.json`` content.

    ``conditioning``: ``--conditioning`` (see :mod:`pipeline.scan.conditioning`).
    ``fs`` replaces the filesystem of ``source`` (``source`` is then a path in it; it must be
    picklable): benchmarks and tests wrap storage with it. Raises StorageError for permanent
    storage failures (nothing is committed), UsageError for bad input (no images, a bad table).
    """
    started, clock = time.time(), time.perf_counter()
    task_fs = fs
    fs, root = (fs, fs._strip_protocol(source).rstrip("/")) if fs is not None else open_url(source, storage_options)
    try:
        listing = list_source(fs, root)
    except Exception as e:
        if isinstance(e, FileNotFoundError) or is_storage_failure(e):  # retried already; a missing root or bucket
            raise StorageError(redact(f"cannot list {source}: {e}", storage_options)) from None
        raise
    table = load_caption_table(captions, storage_options) if captions else None
    target = (source, _task_options(source, storage_options, config), task_fs, root)
    if config.format not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {config.format!r}")
    if config.format != "parquet":
        _parquet_files_ignored(listing, source)
    if (config.format == "parquet" or listing.shards or listing.compressed_shards) and conditioning:
        raise UsageError("--conditioning works on loose image files; this source holds .tar shards or parquet files")
    pairing = resolve(conditioning, source, captions, storage_options, task_fs) if conditioning else None
    excluded = 0
    if pairing is not None:
        listing, excluded = pairing.exclude(listing)
    if config.format == "parquet" or listing.shards or listing.compressed_shards:
        from pipeline.sources.containers import scan_containers  # it imports this package's parts

        return scan_containers(listing, out, target, source=source, spec=spec, storage_options=storage_options,
                               table=table, previous=previous, config=config, ray_address=ray_address,
                               started=started)  # fmt: skip
    if not listing.images:
        raise UsageError(
            f"no image files under {redact(source)} ({listing.ignored} other files ignored"
            f"{': ' + ignored_line(listing.ignored_extensions) if listing.ignored_extensions else ''}); images are "
            f"{_extensions()}, or WebDataset .tar shards. Check the path."
        )
    log.info("listed %d images (%d ignored) in %.1f s", len(listing.images), listing.ignored, listing.seconds)
    plan = plan_rescan(listing, out, previous, storage_options, config.max_pixels, table)

    # only image headers go to Ray; re-reading a few changed sidecars of reused rows is driver work
    probed = {w.name for w in plan.work if w.probe}  # an image's further sidecars are read in its task
    image_work = [w for w in plan.work if w.name in probed]
    caption_work = [w for w in plan.work if w.name not in probed]
    try:
        results, ray_seconds = run_tasks(scan_batch, target, config, lambda cpus: _batches(image_work, config, cpus),
                                         len(image_work), progress=config.progress, ray_address=ray_address)
        if caption_work:
            results.append(probe_files(fs, root, caption_work, in_flight=config.reads_in_flight))
    except StorageError as e:
        raise StorageError(redact(str(e), storage_options)) from None
    probed = _redacted(pa.concat_tables(results) if results else PROBE_SCHEMA.empty_table(), storage_options)
    images, errors, stats = _assemble(listing, plan, probed, table)
    if pairing is not None:
        images, errors, paired = pair(images, errors, set(probed.filter(probed.column("probed")).column("name")
                                                          .to_pylist()), pairing,
                                      _conditioning_probe(pairing, storage_options, task_fs, config, ray_address))
        stats.update(paired, conditioning_files=excluded)
    samples, too_small = apply_buckets(images, spec)
    errors = pa.concat_tables([errors, too_small])
    seconds = time.perf_counter() - clock - ray_seconds
    summary = _summary(listing, plan, stats, samples, errors, seconds, started, config, captions, table)
    return write_manifest(
        out, samples, errors, source=source, spec=spec, storage_options=storage_options, summary=summary,
        counts={"listed": len(listing.images), "ignored": listing.ignored}, max_pixels=config.max_pixels,
        conditioning=pairing.meta() if pairing is not None else None,
    )  # fmt: skip


def _conditioning_probe(pairing, storage_options, fs, config: ScanConfig, ray_address: str | None):
    """``probe(items)`` for :func:`pipeline.scan.conditioning.pair`: the conditioning images' headers,
    read by the same Ray tasks as the targets' (:func:`scan_batch`), batched the same way."""
    target = probe_target(pairing, storage_options, fs)
    target = (target[0], _task_options(target[0], storage_options, config), *target[2:])

    def probe(items: list) -> pa.Table:
        try:
            results, _ = run_tasks(scan_batch, target, config, lambda cpus: _batches(items, config, cpus), len(items),
                                   progress=config.progress, ray_address=ray_address)  # fmt: skip
        except StorageError as e:
            raise StorageError(redact(str(e), storage_options)) from None
        return _redacted(pa.concat_tables(results), storage_options)

    return probe


def _parquet_files_ignored(listing: Listing, source: str) -> None:
    """Without --format parquet, parquet files are other files (a caption table beside images, say),
    unless they are all the source holds: then the user most likely meant to scan them."""
    if not listing.parquet:
        return
    if not (listing.images or listing.shards or listing.compressed_shards):
        raise UsageError(
            f"{redact(source)} holds {len(listing.parquet)} .parquet files (e.g. {listing.parquet[0].name}) and "
            "no image files or tar shards: to scan the images inside them, add --format parquet --image-column "
            "COLUMN (binary image bytes, or a HuggingFace Image struct) and, if they have captions, "
            "--caption-column COLUMN"
        )
    listing.ignored_extensions["parquet"] = listing.ignored_extensions.get("parquet", 0) + len(listing.parquet)
    listing.parquet = []


def _extensions() -> str:
    """The image extensions, the common ones first: ``jpg, png, ... and 40 more (bucketeer scan --help)``."""
    common = [e for e in ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "avif", "heic", "jxl")
              if e in IMAGE_EXTENSIONS]  # fmt: skip
    rest = len(IMAGE_EXTENSIONS) - len(common)
    return ", ".join(common) + (f" and {rest} more (bucketeer scan --help)" if rest else "")


def _task_options(source: str, storage_options: dict[str, Any] | None, config: ScanConfig) -> dict[str, Any] | None:
    """The tasks' storage options: on S3, a connection pool as large as the reads in flight
    (botocore's default of 10 connections would queue the rest)."""
    if not source.startswith(("s3://", "s3a://")):
        return storage_options
    options = dict(storage_options or {})
    config_kwargs = dict(options.get("config_kwargs") or {})
    config_kwargs.setdefault("max_pool_connections", max(10, config.reads_in_flight))
    return {**options, "config_kwargs": config_kwargs}


def _redacted(probed: pa.Table, storage_options: dict[str, Any] | None) -> pa.Table:
    """Messages of read_failed rows quote storage errors: no credential may stay in them."""
    if not storage_options or probed.column("message").null_count == probed.num_rows:
        return probed
    messages = [redact(m, storage_options) if m else m for m in probed.column("message").to_pylist()]
    return probed.set_column(PROBE_SCHEMA.get_field_index("message"), "message", pa.array(messages, pa.string()))


# --- the Ray part -------------------------------------------------------------------------------


def scan_batch(target: tuple, batch: pa.Table, config: ScanConfig) -> pa.Table:
    """One Ray task: probe the files of ``batch`` (a :func:`~pipeline.sources.listing.work_table`; see
    :func:`pipeline.sources.reading.probe_files`) on its own filesystem."""
    source, storage_options, fs, root = target
    if fs is None:
        fs, root = open_url(source, storage_options)
    register_plugins()
    result = probe_files(fs, root, work_items(batch), max_pixels=config.max_pixels, first_read=config.header_bytes,
                         in_flight=config.reads_in_flight)  # fmt: skip
    faults.hit("scan.task")  # tests: stall or lose this worker mid-scan
    return result


def _batches(work: list, config: ScanConfig, cpus: int) -> list[pa.Table]:
    """``work`` cut into one table per Ray task: enough tasks to keep every CPU busy 4 times over."""
    per_task = config.files_per_task or int(np.clip(-(-len(work) // (4 * cpus)), 16, 2000))
    # each batch its own columns: a slice of one big table would ship the whole table's buffers
    return [work_table(work[i : i + per_task]) for i in range(0, len(work), per_task)]


# --- assembling the manifest --------------------------------------------------------------------


def _listing_columns(listing: Listing) -> pa.Table:
    entries = listing.images
    return pa.table({
        "filename": pa.array([e.name for e in entries], pa.string()),
        "size": pa.array([e.size for e in entries], pa.int64()),
        "etag": pa.array([e.etag for e in entries], pa.string()),
        "mtime": pa.array([e.mtime for e in entries], pa.float64()),
    })  # fmt: skip


def _sidecar_captions(listing: Listing, probed: pa.Table):
    """Captions read from sidecars: ``{image: (caption, captions)}`` for images whose every sidecar was
    read, the images with a sidecar that could not be read, and how many empty captions left a list."""
    read: dict[str, dict[str, str | None]] = {}
    failed: set[str] = set()
    for name, sidecar, caption, ok in zip(*(probed.column(c).to_pylist()
                                            for c in ("name", "sidecar", "caption", "caption_read"))):  # fmt: skip
        if ok:
            read.setdefault(name, {})[sidecar] = caption
        elif ok is False:
            failed.add(name)
    out: dict[str, tuple[str | None, list[str] | None]] = {}
    dropped = 0
    for name, texts in read.items():
        sidecars = image_sidecars(listing, name) if name not in failed else []
        if not sidecars or any(s.name not in texts for s in sidecars):
            continue
        if len(sidecars) == 1:  # one sidecar: an empty one is a null caption, as always
            out[name] = (texts[sidecars[0].name], None)
            continue
        caption, captions, empty = caption_list([texts[s.name] for s in sidecars])
        out[name], dropped = (caption, captions), dropped + empty
    return out, failed, dropped


def _assemble(listing: Listing, plan: RescanPlan, probed: pa.Table, table: CaptionTable | None):
    """Image rows (IMAGE_SCHEMA) and error rows (ERRORS_SCHEMA) from reused rows and the tasks' tables."""
    sidecar_captions, failed_reads, dropped = _sidecar_captions(listing, probed)
    table_captions = table.captions if table is not None else {}
    table_lists = table.lists if table is not None else {}

    def caption_of(name: str, previous: tuple[str | None, list[str] | None]) -> tuple[str | None, list[str] | None]:
        if name in table_captions:
            return table_captions[name], table_lists.get(name)
        if name in sidecar_captions:
            return sidecar_captions[name]
        return previous if name in plan.kept_captions else (None, None)

    def source_of(name: str) -> str | None:
        # a sidecar that could not be read records no source, so the next scan reads it again
        return None if name in failed_reads else caption_source(listing, name, table)

    def caption_columns(names: list[str], previous: list[tuple]) -> dict[str, pa.Array]:
        pairs = [caption_of(n, p) for n, p in zip(names, previous)]
        return {"caption": pa.array([p[0] for p in pairs], pa.string()),
                "captions": pa.array([p[1] for p in pairs], pa.list_(pa.string())),
                "caption_source": pa.array([source_of(n) for n in names], pa.string())}  # fmt: skip

    listed = _listing_columns(listing)

    def new_rows(rows: pa.Table, schema: pa.Schema) -> pa.Table:
        names = rows.column("name").to_pylist()
        at = pc.index_in(rows.column("name"), value_set=listed.column("filename"))
        columns = {c: rows.column(c) for c in ("width", "height", "format", "orientation", "bytes_read",
                                               "error", "message")}  # fmt: skip
        columns.update({c: listed.column(c).take(at) for c in ("size", "etag", "mtime")})
        columns.update({"sample_id": pa.array(sample_ids(names), pa.uint64()), "filename": rows.column("name"),
                        **caption_columns(names, [(None, None)] * len(names))})  # fmt: skip
        return conform(pa.table(columns), schema)

    def with_captions(reused: pa.Table) -> pa.Table:
        names = reused.column("filename").to_pylist()
        previous = list(zip(reused.column("caption").to_pylist(), reused.column("captions").to_pylist()))
        for name, column in caption_columns(names, previous).items():
            reused = reused.set_column(reused.schema.get_field_index(name), name, column)
        return reused

    new = probed.filter(probed.column("probed"))
    usable = pc.is_null(new.column("error"))
    images = new_rows(new.filter(usable), IMAGE_SCHEMA)
    errors = new_rows(new.filter(pc.invert(usable)), ERRORS_SCHEMA)
    images = pa.concat_tables([with_captions(plan.reused_images), images])
    errors = pa.concat_tables([with_captions(plan.reused_errors), errors])
    stats = {
        "files_read": new.num_rows,
        "bytes_read": new.column("bytes_read").drop_null().to_numpy(),
        "requests": int(pc.sum(probed.column("requests")).as_py() or 0),
        "captions_read": len(sidecar_captions),
        "caption_read_failures": len(failed_reads),
        "empty_captions_dropped": dropped + (table.dropped if table is not None else 0),
        "caption_lists": sum(len(c[1] or ()) > 1 for c in sidecar_captions.values()) + len(table_lists),
    }
    return images, errors, stats


def _summary(listing, plan, stats, samples, errors, seconds, started, config, captions, table) -> dict[str, Any]:
    kinds: dict[str, int] = {}
    for kind in errors.column("error").to_pylist():
        kinds[kind] = kinds.get(kind, 0) + 1
    read = stats.pop("bytes_read")
    return {
        **stats,
        "requests_per_file": round(stats["requests"] / max(1, stats["files_read"]), 4),
        "listed": len(listing.images), "ignored": listing.ignored, "ignored_hidden": listing.ignored_hidden,
        "ignored_other": listing.ignored_other, "ignored_extensions": dict(sorted(listing.ignored_extensions.items())),
        "list_requests": listing.requests, "list_seconds": round(listing.seconds, 3), "samples": samples.num_rows,
        "errors": errors.num_rows, "errors_by_kind": kinds, "reused": plan.reused, "new": plan.new,
        "changed": plan.changed, "deleted": plan.deleted, "previous": plan.previous, "bytes_read": int(read.sum()),
        "mb_read": round(int(read.sum()) / 1e6, 3), "median_bytes_read": int(np.median(read)) if len(read) else 0,
        "seconds": round(seconds, 3), "files_per_s": round(len(listing.images) / max(seconds, 1e-9), 1),
        "started_at": _dt.datetime.fromtimestamp(started, _dt.timezone.utc).isoformat(timespec="seconds"),
        "started_at_epoch": started, "header_bytes": config.header_bytes, "plugins": list(register_plugins()),
        "captions": redact(captions) if captions else "sidecars",
        "caption_table_version": table.version if table is not None else None,
    }  # fmt: skip
