"""The scan of a source made of containers: WebDataset tar shards, or parquet files with an image column.

Called by :func:`pipeline.scan.job.scan_dataset` for the ``.tar`` files of a listing (alone, or beside
the loose images of a mixed folder: :func:`container_part` gives rows and a summary, the job commits
them), or with ``--format parquet`` (:mod:`pipeline.sources.parquet`). Files of the kinds a scan does
not read were counted as ignored before this (:mod:`pipeline.scan.kinds`). A ``.tar.gz``/``.tgz``
shard cannot be read by byte range (neither by the scan nor by embed, which reads each image with one
ranged read): ``--format tar`` refuses it with what to do (decompress it once into a ``.tar``),
other scans count it as ignored and say so.

Incremental per container: every row of a shard or parquet file whose size and ETag (mtime where
the store has none) are those recorded in the previous manifest is reused without reading it,
unless it had a ``read_failed`` row, or ``--max-pixels``, ``--caption-field`` (tar) or
``--image-column``/``--caption-column`` (parquet) changed. Rows are checked and bucketed as for
loose files (:func:`manifests.manifest.apply_buckets`); rows without a container (a mixed folder's
loose images) are the loose scan's to reuse. The summary counts containers under the keys
``shards``/``shards_read``/``shard_bytes`` whatever their kind (``source_format`` says which).
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests.buckets import BucketSpec
from manifests.errors import StorageError, UsageError
from manifests.manifest import Manifest, apply_buckets, conform
from manifests.manifest_meta import ScanSummary
from manifests.schema import ERRORS_SCHEMA, sample_ids
from manifests.storage import redact
from pipeline.sources.captions import CaptionTable
from pipeline.sources.listing import IMAGE_SCHEMA, FileEntry, Listing
from pipeline.sources.masks import mask_counts
from pipeline.sources.rescan import previous_manifest, unchanged
from pipeline.sources.tasks import run_tasks
from pipeline.sources.parquet import PARQUET_ROWS, scan_parquet_batch
from pipeline.sources.shards import SHARD_ROWS, scan_shard_batch, shard_work

__all__ = ["ScanPart", "ShardPlan", "check_container_source", "container_settings", "compressed_shards_message",
           "container_part", "plan_shards", "shard_plan"]



def _is_parquet(config: Any) -> bool:
    return getattr(config, "format", "auto") == "parquet"


def check_container_source(listing: Listing, source: str, config: Any = None) -> None:
    """Raise UsageError for containers this scan cannot read: none at all, or compressed tar shards
    (see the module docstring). Other kinds of files were counted as ignored before this."""
    if _is_parquet(config):
        if not listing.parquet:
            raise UsageError(f"--format parquet: no .parquet files under {redact(source)}; check the path")
        return
    if listing.compressed_shards:
        raise UsageError(compressed_shards_message(listing.compressed_shards, source))
    if not listing.shards:
        raise UsageError(f"--format tar: no .tar shards under {redact(source)}; check the path")


def compressed_shards_message(names: list[str], source: str) -> str:
    """Why compressed tar shards are not scanned, and what to do."""
    return (
        f"{redact(source)} holds {len(names)} compressed tar shards (e.g. {names[0]}): a "
        ".tar.gz/.tgz cannot be read by byte range, so scanning it means reading it whole, and embed "
        "would decompress a whole shard for every image. Decompress them once "
        "(for f in *.tar.gz; do gzip -dc \"$f\" > \"${f%.gz}\"; done), remove the compressed copies, "
        "and scan the .tar shards"
    )


class ScanPart(NamedTuple):
    """What one kind of file of a source gave: rows (bucketed), the scan's summary of them, the counts."""

    samples: pa.Table
    errors: pa.Table
    summary: ScanSummary
    counts: dict[str, int]


@dataclass
class ShardPlan:
    work: list[FileEntry]  # shards to read
    reused_images: pa.Table  # IMAGE_SCHEMA rows of unchanged shards (too_small rejects included)
    reused_errors: pa.Table  # ERRORS_SCHEMA rows of unchanged shards
    reused: int = 0
    new: int = 0
    changed: int = 0
    deleted: int = 0
    previous: str | None = None
    deleted_names: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # the unchanged containers, whose rows are reused


def container_settings(config: Any) -> dict[str, Any]:
    """What a container's rows depend on besides its bytes: a change means every container is read again.
    Recorded in the manifest's summary; embed reads ``image_column`` from it."""
    if _is_parquet(config):
        return {"source_format": "parquet", "image_column": config.image_column,
                "caption_column": config.caption_column, "masks": getattr(config, "masks", None)}  # fmt: skip
    return {"source_format": "webdataset", "caption_field": config.caption_field,
            "masks": getattr(config, "masks", None)}  # fmt: skip


def plan_shards(
    shards: list[FileEntry], out: str, previous: str | None, storage_options: dict[str, Any] | None, config: Any
) -> ShardPlan:
    """Split ``shards`` into shards to read and rows to reuse from the previous manifest
    (``previous``, else a committed one at ``out``). Raises ManifestError when ``previous`` is unreadable."""
    return shard_plan(shards, previous_manifest(out, previous, storage_options), config, previous or out)


def shard_plan(shards: list[FileEntry], old: Manifest | None, config: Any, where: str) -> ShardPlan:
    """:func:`plan_shards` against the previous manifest ``old`` (None: every shard is new), read from ``where``."""
    empty = ShardPlan(list(shards), IMAGE_SCHEMA.empty_table(), ERRORS_SCHEMA.empty_table(), new=len(shards))
    if old is None or old.max_pixels != config.max_pixels or any(
        getattr(old.meta.summary, k) != v for k, v in container_settings(config).items()
    ):
        return empty
    small = pc.equal(old.errors.column("error"), "too_small")
    images = pa.concat_tables([conform(old.samples, IMAGE_SCHEMA), conform(old.errors.filter(small), IMAGE_SCHEMA)])
    errors = old.errors.filter(pc.invert(small))
    images = images.filter(pc.is_valid(images.column("container")))  # a mixed folder's loose rows: not ours
    errors = errors.filter(pc.is_valid(errors.column("container")))
    recorded: dict[str, tuple] = {}
    for tab in (images, errors):
        cols = tab.select(["container", "container_size", "etag", "mtime"]).to_pydict()
        for name, size, etag, mtime in zip(cols["container"], cols["container_size"], cols["etag"], cols["mtime"]):
            if name is not None:
                recorded[name] = (size, etag, mtime)
    failed = set(errors.filter(pc.equal(errors.column("error"), "read_failed")).column("container").to_pylist())
    plan = ShardPlan([], images, errors, previous=redact(where))
    keep = []
    for shard in shards:
        before = recorded.get(shard.name)
        if before is None:
            plan.work.append(shard)
            plan.new += 1
        elif shard.name in failed or not unchanged(shard, *before):
            plan.work.append(shard)
            plan.changed += 1
        else:
            keep.append(shard.name)
    kept = pa.array(keep, pa.string())
    plan.reused_images = images.filter(pc.fill_null(pc.is_in(images.column("container"), kept), False))
    plan.reused_errors = errors.filter(pc.fill_null(pc.is_in(errors.column("container"), kept), False))
    plan.reused, plan.kept = len(keep), keep
    plan.deleted_names = sorted(set(recorded) - {s.name for s in shards})
    plan.deleted = len(plan.deleted_names)
    return plan


def container_part(
    listing: Listing,
    out: str,
    target: tuple,
    *,
    source: str,
    spec: BucketSpec,
    storage_options: dict[str, Any] | None,
    table: CaptionTable | None,
    previous: str | None,
    config: Any,
    ray_address: str | None,
    started: float,
) -> ScanPart:
    """Scan the tar shards (or, with ``config.format == "parquet"``, the parquet files) of ``listing``,
    reusing the rows of unchanged ones from the manifest at ``previous`` (else ``out``); the caller
    commits the part (alone, or beside the loose images' rows).

    ``target`` is what each Ray task opens storage with (see :func:`pipeline.scan.probing.scan_batch`).
    Raises UsageError for compressed shards (or a missing --image-column/--caption-column),
    StorageError for a permanent storage failure.
    """
    clock = time.perf_counter()
    check_container_source(listing, source, config)
    parquet = _is_parquet(config)
    files = listing.parquet if parquet else listing.shards
    task, rows_schema = (scan_parquet_batch, PARQUET_ROWS) if parquet else (scan_shard_batch, SHARD_ROWS)
    plan = plan_shards(files, out, previous, storage_options, config)

    def batches_for(cpus: int) -> list[pa.Table]:
        # a container's reads follow one another: many per task keep reads_in_flight requests going
        per_task = max(1, min(config.reads_in_flight, -(-len(plan.work) // cpus)))
        return [shard_work(plan.work[i : i + per_task]) for i in range(0, len(plan.work), per_task)]

    try:
        results, ray_seconds = run_tasks(
            task, target, config, batches_for, len(plan.work), progress=config.progress,
            ray_address=ray_address, unit="shards", count=lambda t: json.loads(t.schema.metadata[b"stats"])["shards"],
        )  # fmt: skip
    except StorageError as e:
        raise StorageError(redact(str(e), storage_options)) from None
    stats = _stats(results)
    rows = (pa.concat_tables([r.replace_schema_metadata(None) for r in results]) if results
            else rows_schema.empty_table())  # fmt: skip
    rows = rows.append_column("sample_id", pa.array(sample_ids(rows.column("filename").to_pylist()), pa.uint64()))
    usable = pc.is_null(rows.column("error"))
    images = pa.concat_tables([plan.reused_images, conform(rows.filter(usable), IMAGE_SCHEMA)])
    errors = pa.concat_tables([plan.reused_errors, conform(rows.filter(pc.invert(usable)), ERRORS_SCHEMA)])
    if table is not None:
        images, errors = _with_table_captions(images, table), _with_table_captions(errors, table)
    samples, too_small = apply_buckets(images, spec)
    errors = pa.concat_tables([errors, too_small])
    stats["masks"] = mask_counts(samples, stats["mask_members"]) if getattr(config, "masks", None) else {}
    seconds = time.perf_counter() - clock - ray_seconds
    listed = samples.num_rows + errors.num_rows - _container_rows(errors)  # a too_small image is in errors now
    summary = _summary(listing, files, plan, stats, samples, errors, listed, seconds, started, config, table)
    return ScanPart(samples, errors, summary, {"listed": listed, "ignored": listing.ignored, "shards": len(files)})


def _container_rows(errors: pa.Table) -> int:
    """Error rows about a whole container (corrupt_container, read_failed), not about one of its images."""
    return int(pc.sum(pc.equal(errors.column("filename"), errors.column("container"))).as_py() or 0)


def _with_table_captions(rows: pa.Table, table: CaptionTable) -> pa.Table:
    """``--captions`` rows (keyed by ``filename``: ``<shard>/<member>``, ``<file>/<row>``) replace what the
    container said (generated captions are added to it: :meth:`CaptionTable.merged`)."""
    names = rows.column("filename").to_pylist()
    pairs = [table.merged(n, c, many) if n in table.captions else (c, many)
             for n, c, many in zip(names, rows.column("caption").to_pylist(), rows.column("captions").to_pylist())]
    sources = [f"table:{table.version}" if n in table.captions else s
               for n, s in zip(names, rows.column("caption_source").to_pylist())]  # fmt: skip
    rows = rows.set_column(rows.schema.get_field_index("caption"), "caption", pa.array([p[0] for p in pairs],
                                                                                         pa.string()))
    rows = rows.set_column(rows.schema.get_field_index("captions"), "captions",
                           pa.array([p[1] for p in pairs], pa.list_(pa.string())))
    at = rows.schema.get_field_index("caption_source")
    return rows.set_column(at, "caption_source", pa.array(sources, pa.string()))


def _stats(results: list[pa.Table]) -> dict[str, Any]:
    total: dict[str, Any] = {"shards": 0, "requests": 0, "bytes_read": 0, "images": 0,
                             "captions_truncated": 0, "ignored_members": {}, "mask_members": 0}  # fmt: skip
    for result in results:
        stats = json.loads(result.schema.metadata[b"stats"])
        for name in ("shards", "requests", "bytes_read", "images", "captions_truncated",
                     "mask_members"):
            total[name] += stats[name]
        for ext, n in stats["ignored_members"].items():
            total["ignored_members"][ext] = total["ignored_members"].get(ext, 0) + n
    return total


def _summary(listing, files, plan, stats, samples, errors, listed, seconds, started, config, table) -> ScanSummary:
    kinds: dict[str, int] = {}
    for kind in errors.column("error").to_pylist():
        kinds[kind] = kinds.get(kind, 0) + 1
    read_names = {s.name for s in plan.work}
    shard_bytes = sum(s.size for s in files if s.name in read_names)
    images_read = max(1, stats["images"])
    return ScanSummary.from_json({
        **container_settings(config),
        "listed": listed, "samples": samples.num_rows, "errors": errors.num_rows, "errors_by_kind": kinds,
        "shards": len(files), "shards_read": len(plan.work), "images_read": stats["images"],
        "reused": plan.reused, "new": plan.new, "changed": plan.changed, "deleted": plan.deleted,
        "previous": plan.previous, "captions_truncated": stats["captions_truncated"],
        # every sample without a caption, reused shards' too (a shard's own count covers only the shards read)
        "no_caption": samples.column("caption").null_count,
        "ignored": listing.ignored, "ignored_members": dict(sorted(stats["ignored_members"].items())),
        "ignored_extensions": dict(sorted(listing.ignored_extensions.items())),
        "ignored_hidden": listing.ignored_hidden, "requests": stats["requests"],
        "bytes_read": stats["bytes_read"], "mb_read": round(stats["bytes_read"] / 1e6, 3),
        "shard_bytes": shard_bytes, "read_fraction": round(stats["bytes_read"] / max(1, shard_bytes), 5),
        "requests_per_image": round(stats["requests"] / images_read, 4),
        "bytes_per_image": round(stats["bytes_read"] / images_read, 1),
        "list_requests": listing.requests, "list_seconds": round(listing.seconds, 3),
        "seconds": round(seconds, 3), "files_per_s": round(stats["images"] / max(seconds, 1e-9), 1),
        "started_at": _dt.datetime.fromtimestamp(started, _dt.timezone.utc).isoformat(timespec="seconds"),
        "started_at_epoch": started, "shard_window": config.shard_window,
        "captions": "table" if table is not None else ("column" if _is_parquet(config) else "members"),
        "caption_table_version": table.version if table is not None else None,
        "median_bytes_read": int(np.median(samples.column("bytes_read").to_numpy())) if samples.num_rows else 0,
        **stats["masks"],
    })  # fmt: skip
