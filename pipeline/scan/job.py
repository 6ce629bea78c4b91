"""Header-only Ray scan of a local folder or s3:// prefix into a parquet manifest.

    bucketeer scan s3://bucket/ds --out s3://bucket/manifests/ds --storage-options '{"endpoint_url": "…"}'
    ray job submit --working-dir . -- python -m pipeline.scan s3://bucket/ds --out s3://bucket/manifests/ds

The source is listed once (on the driver, key ranges in parallel); the files to read are cut into
batches, one Ray task per batch, and each task keeps many ranged reads in flight on threads
(:func:`pipeline.scan.headers.probe_files`). Only the first bytes of each image are read. Results are
bucketed through :func:`manifests.manifest.apply_buckets` and committed by
:func:`manifests.manifest.write_manifest` (parts first, ``_manifest.json`` last), so a killed scan
leaves the previous manifest readable and a re-run gives the same manifest as a clean run.
Files probed are reported as they come back (:class:`manifests.progress.Progress`: a bar on a
terminal, a plain line every 30 s in a Ray job's log; ``--no-progress`` for neither).

Incremental: rows of the manifest already at ``--out`` (or ``--previous``) whose file size and
ETag (mtime when the store has no ETag) are unchanged are reused without reading the file; their
sidecar caption is read again only when the listed sidecar is not the version recorded in the
row's ``caption_source`` (see manifests/schema.py).
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

from manifests import faults
from manifests.buckets import BucketSpec, add_bucket_arguments, spec_from_args
from manifests.manifest import apply_buckets, conform, write_manifest
from manifests.errors import BucketeerError, StorageError, UsageError
from manifests.progress import Progress
from manifests.schema import ERRORS_SCHEMA, MAX_PIXELS, sample_ids
from manifests.storage import open_url, parse_storage_options, redact
from pipeline.scan.captions import CaptionTable, load_caption_table
from pipeline.scan.headers import FIRST_READ, probe_files
from pipeline.scan.listing import (
    IMAGE_EXTENSIONS,
    IMAGE_SCHEMA,
    Listing,
    RescanPlan,
    caption_source,
    list_source,
    plan_rescan,
)
from pipeline.ray_setup import ray_session
from manifests.retry import is_storage_failure

log = logging.getLogger("bucketeer.scan")


@dataclass(frozen=True)
class ScanConfig:
    """Tuning of the scan; the defaults suit a 2-64 core cluster reading from S3."""

    max_pixels: int = MAX_PIXELS  # declared pixel count above this -> too_many_pixels (recorded in the manifest)
    header_bytes: int = FIRST_READ  # first ranged read per image
    threads_per_task: int = 32  # ranged reads in flight per Ray task
    files_per_task: int | None = None  # None: enough tasks to keep every CPU busy 4 times over
    progress: bool = True  # a bar on a terminal, else a line every $BUCKETEER_PROGRESS_SECONDS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="dataset root: a local folder or s3://bucket/prefix")
    parser.add_argument("--out", required=True, help="manifest folder to write (an existing manifest there is reused)")
    parser.add_argument("--captions", default=None, metavar="URL",
                        help="caption table (parquet, jsonl or csv with filename + caption columns); "
                        "images not in it fall back to .txt/.caption sidecars")  # fmt: skip
    parser.add_argument("--previous", default=None, metavar="MANIFEST",
                        help="reuse unchanged rows from this manifest (default: the one at --out, if any)")  # fmt: skip
    parser.add_argument("--storage-options", default=None, help="fsspec options as JSON, e.g. an endpoint_url")
    parser.add_argument("--max-pixels", type=int, default=MAX_PIXELS,
                        help="images declaring more pixels are errors (too_many_pixels), never decoded; recorded "
                        f"in the manifest, embed decodes up to it (default and most {MAX_PIXELS:,}: "
                        "what Pillow decodes)")  # fmt: skip
    parser.add_argument("--header-bytes", type=int, default=FIRST_READ,
                        help="first ranged read per image (default 64 KiB)")
    parser.add_argument("--threads-per-task", type=int, default=32, help="ranged reads in flight per Ray task")
    parser.add_argument("--files-per-task", type=int, default=None,
                        help="batch size of one Ray task (default: automatic)")
    parser.add_argument("--ray-address", default=None,
                        help="Ray cluster to use (default: $RAY_ADDRESS, else start one here)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar or progress lines (the summary line is always printed)")
    add_bucket_arguments(parser)
    parser.epilog = f"Images: {', '.join(sorted(IMAGE_EXTENSIONS))} (any case). Hidden and ._* files are ignored."


def run(args: argparse.Namespace) -> int:
    options = parse_storage_options(args.storage_options)
    config = ScanConfig(
        max_pixels=args.max_pixels, header_bytes=args.header_bytes, threads_per_task=args.threads_per_task,
        files_per_task=args.files_per_task, progress=not args.no_progress,
    )  # fmt: skip
    for name in ("max_pixels", "header_bytes", "threads_per_task"):
        if getattr(config, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if config.max_pixels > MAX_PIXELS:
        raise UsageError(f"--max-pixels {config.max_pixels:,} is above {MAX_PIXELS:,}: Pillow refuses to decode "
                         "larger images, so embed could not use them; the option can only lower the limit")
    meta = scan_dataset(
        args.source, args.out, spec=spec_from_args(args), storage_options=options, captions=args.captions,
        previous=args.previous, config=config, ray_address=args.ray_address,
    )  # fmt: skip
    print(summary_line(meta, args.out))
    return 0


def summary_line(meta: dict[str, Any], out: str) -> str:
    """The closing line: counts, reuse, bytes and speed."""
    s = meta["summary"]
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(s["errors_by_kind"].items())) or "none"
    return (
        f"scanned {s['listed']} images ({s['ignored']} other files ignored): {s['samples']} samples, "
        f"{s['errors']} errors ({kinds}) | reused {s['reused']}, new {s['new']}, changed {s['changed']}, "
        f"deleted {s['deleted']} | read {s['files_read']} files, {s['mb_read']:.1f} MB "
        f"(median {s['median_bytes_read'] / 1024:.0f} KiB) in {s['seconds']:.1f} s, {s['files_per_s']:.0f} files/s "
        f"-> {redact(out)} (fingerprint {meta['fingerprint'][:12]})"
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
) -> dict[str, Any]:
    """Scan ``source`` into a manifest at ``out``; returns the committed ``_manifest.json`` content.

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
    if not listing.images:
        raise UsageError(
            f"no image files under {redact(source)} ({listing.ignored} other files ignored); images are "
            f"{', '.join(sorted(IMAGE_EXTENSIONS))}. Check the path."
        )
    log.info("listed %d images (%d ignored) in %.1f s", len(listing.images), listing.ignored, listing.seconds)
    table = load_caption_table(captions, storage_options) if captions else None
    plan = plan_rescan(listing, out, previous, storage_options, config.max_pixels, table)

    target = (source, storage_options, task_fs, root)
    # only image headers go to Ray; re-reading a few changed sidecars of reused rows is driver work
    image_work = [w for w in plan.work if w[2]]
    caption_work = [w for w in plan.work if not w[2]]
    try:
        results, ray_seconds = _run_tasks(target, image_work, config, ray_address)
        if caption_work:
            results.append(probe_files(fs, root, caption_work, threads=config.threads_per_task))
    except StorageError as e:
        raise StorageError(redact(str(e), storage_options)) from None
    for result in results:  # messages of read_failed rows quote storage errors
        result["message"] = [redact(m, storage_options) if m else m for m in result["message"]]
    images, errors, stats = _assemble(listing, plan, results, table)
    samples, too_small = apply_buckets(images, spec)
    errors = pa.concat_tables([errors, too_small])
    seconds = time.perf_counter() - clock - ray_seconds
    summary = _summary(listing, plan, stats, samples, errors, seconds, started, config, captions, table)
    return write_manifest(
        out, samples, errors, source=source, spec=spec, storage_options=storage_options, summary=summary,
        counts={"listed": len(listing.images), "ignored": listing.ignored}, max_pixels=config.max_pixels,
    )  # fmt: skip


# --- the Ray part -------------------------------------------------------------------------------


def scan_batch(target: tuple, items: list[tuple[str, int, bool, str | None]], config: ScanConfig) -> dict[str, Any]:
    """One Ray task: probe ``items`` (see :func:`pipeline.scan.headers.probe_files`) on its own filesystem."""
    source, storage_options, fs, root = target
    if fs is None:
        fs, root = open_url(source, storage_options)
    result = probe_files(
        fs, root, items, max_pixels=config.max_pixels, first_read=config.header_bytes, threads=config.threads_per_task
    )
    faults.hit("scan.task")  # tests: stall or lose this worker mid-scan
    return result


def _run_tasks(target: tuple, work: list, config: ScanConfig, ray_address: str | None) -> tuple[list[dict], float]:
    """Run :func:`scan_batch` over batches of ``work`` on Ray; returns results and Ray start-up seconds."""
    if not work:
        return [], 0.0
    clock = time.perf_counter()
    with ray_session(ray_address) as ray:
        ray_seconds = time.perf_counter() - clock
        return _run_batches(ray, target, work, config), ray_seconds


def _run_batches(ray, target: tuple, work: list, config: ScanConfig) -> list[dict]:
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    per_task = config.files_per_task or int(np.clip(-(-len(work) // (4 * cpus)), 16, 1000))
    batches = [work[i : i + per_task] for i in range(0, len(work), per_task)]
    # worker loss is retried by Ray; exceptions (a permanent storage error) fail the job at once
    remote = ray.remote(num_cpus=1, max_retries=3, retry_exceptions=False)(scan_batch)
    target_ref = ray.put(target)
    results: list[dict] = []
    pending: dict = {}
    progress = Progress("scan", "files", total=len(work), unit="files", enabled=config.progress)
    mb, errors = 0.0, 0
    try:
        while batches or pending:
            while batches and len(pending) < 4 * cpus:  # a bounded window keeps driver memory flat
                batch = batches.pop(0)
                pending[remote.remote(target_ref, batch, config)] = batch
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                pending.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    if isinstance(e.cause, BucketeerError):  # the task's own error; Ray's wrapper reads as a traceback
                        raise e.cause from None
                    raise
                results.append(result)
                mb += sum(b or 0 for b in result["bytes_read"]) / 1e6
                errors += sum(1 for k in result["error"] if k)
                progress.update(len(result["name"]), read=f"{mb:.1f} MB", errors=errors)  # a row per file
        progress.close()
    finally:
        progress.close(final=False)  # after a failure: no final "done" line
        for ref in pending:
            ray.cancel(ref, force=True)
    return results


# --- assembling the manifest --------------------------------------------------------------------


def _assemble(listing: Listing, plan: RescanPlan, results: list[dict], table: CaptionTable | None):
    """Image rows (IMAGE_SCHEMA) and error rows (ERRORS_SCHEMA) from reused rows and task results."""
    entries = {e.name: e for e in listing.images}
    merged: dict[str, list] = {k: [] for k in results[0]} if results else {}
    for r in results:
        for k, v in r.items():
            merged[k].extend(v)
    read_results = list(zip(merged.get("name", []), merged.get("caption", []), merged.get("caption_read", [])))
    sidecar_captions = {n: c for n, c, ok in read_results if ok}
    failed_reads = {n for n, _, ok in read_results if ok is False}
    stats = {
        "files_read": sum(1 for w, e in zip(merged.get("width", []), merged.get("error", [])) if w is not None or e),
        "bytes_read": [b for b in merged.get("bytes_read", []) if b is not None],
        "requests": sum(r or 0 for r in merged.get("requests", [])),
        "captions_read": len(sidecar_captions),
        "caption_read_failures": len(failed_reads),
    }

    def caption_of(name: str, previous: str | None) -> str | None:
        if table is not None and name in table.captions:
            return table.captions[name]
        if name in sidecar_captions:
            return sidecar_captions[name]
        return previous if name in plan.kept_captions else None

    def source_of(name: str) -> str | None:
        # a sidecar that could not be read records no source, so the next scan reads it again
        return None if name in failed_reads else caption_source(listing, name, table)

    new_images: dict[str, list] = {
        k: [] for k in ("filename", "width", "height", "format", "orientation", "bytes_read")
    }
    new_errors: dict[str, list] = {
        k: [] for k in ("filename", "error", "message", "width", "height", "format", "bytes_read")
    }
    for i, name in enumerate(merged.get("name", [])):
        if merged["error"][i]:
            row = new_errors
            row["error"].append(merged["error"][i])
            row["message"].append(merged["message"][i])
        elif merged["width"][i] is not None:
            row = new_images
            row["orientation"].append(merged["orientation"][i])
        else:
            continue  # a caption-only item of a reused row
        for k in ("filename", "width", "height", "format", "bytes_read"):
            row[k].append(name if k == "filename" else merged[k][i])

    def with_listing(cols: dict[str, list], schema: pa.Schema) -> pa.Table:
        names = cols["filename"]
        cols = {**cols, "sample_id": pa.array(sample_ids(names), pa.uint64()),
                "size": [entries[n].size for n in names], "etag": [entries[n].etag for n in names],
                "mtime": [entries[n].mtime for n in names], "caption": [caption_of(n, None) for n in names],
                "caption_source": [source_of(n) for n in names]}  # fmt: skip
        return conform(pa.table({k: pa.array(v, schema.field(k).type) for k, v in cols.items()}), schema)

    def with_captions(reused: pa.Table) -> pa.Table:
        names = reused.column("filename").to_pylist()
        captions = [caption_of(n, c) for n, c in zip(names, reused.column("caption").to_pylist())]
        reused = reused.set_column(reused.schema.get_field_index("caption"), "caption", pa.array(captions, pa.string()))
        sources = pa.array([source_of(n) for n in names], pa.string())
        return reused.set_column(reused.schema.get_field_index("caption_source"), "caption_source", sources)

    images = pa.concat_tables([with_captions(plan.reused_images), with_listing(new_images, IMAGE_SCHEMA)])
    errors = pa.concat_tables([with_captions(plan.reused_errors), with_listing(new_errors, ERRORS_SCHEMA)])
    return images, errors, stats


def _summary(listing, plan, stats, samples, errors, seconds, started, config, captions, table) -> dict[str, Any]:
    kinds: dict[str, int] = {}
    for kind in errors.column("error").to_pylist():
        kinds[kind] = kinds.get(kind, 0) + 1
    read = stats.pop("bytes_read")
    return {
        **stats,
        "listed": len(listing.images), "ignored": listing.ignored, "ignored_hidden": listing.ignored_hidden,
        "ignored_other": listing.ignored_other, "list_requests": listing.requests,
        "list_seconds": round(listing.seconds, 3), "samples": samples.num_rows, "errors": errors.num_rows,
        "errors_by_kind": kinds, "reused": plan.reused, "new": plan.new, "changed": plan.changed,
        "deleted": plan.deleted, "previous": plan.previous, "bytes_read": int(sum(read)),
        "mb_read": round(sum(read) / 1e6, 3), "median_bytes_read": int(np.median(read)) if read else 0,
        "seconds": round(seconds, 3), "files_per_s": round(len(listing.images) / max(seconds, 1e-9), 1),
        "started_at": _dt.datetime.fromtimestamp(started, _dt.timezone.utc).isoformat(timespec="seconds"),
        "started_at_epoch": started, "header_bytes": config.header_bytes,
        "captions": redact(captions) if captions else "sidecars",
        "caption_table_version": table.version if table is not None else None,
    }  # fmt: skip

