"""The video part of ``bucketeer scan --frames`` (or ``--frame-ladder``): loose video files, header only.

    bucketeer scan ./clips --out ./clips-manifest --frames 17,33,49,81 --resolution 512

The loose ``.mp4 .mov .webm .mkv`` files of the listing (:data:`pipeline.sources.listing.VIDEO_EXTENSIONS`)
are cut into batches, one Ray task per batch (:func:`pipeline.sources.tasks.run_tasks`, as for
images), and each file's container header is read by ranged reads (:func:`pipeline.sources.video.probe_video`),
with its sidecar caption (``clip.txt``/``clip.caption`` beside ``clip.mp4``) or the ``--captions`` table's.
The driver buckets the rows: the pixel bucket of the display size (:func:`manifests.manifest.apply_buckets`,
``too_small`` as for images) and the frame bucket (:func:`manifests.frames.assign_frames`: ``WxHxF``,
``clips``, ``too_short``). Images of the same folder are scanned as ever and join as 1-frame samples
(:func:`one_frame`). The video members of WebDataset tar shards are probed where they lie, by ranged
reads of their byte range (:mod:`pipeline.sources.video_shards`: ``container``, ``member_offset`` and
``size`` in the row, as for images in shards). With ``--format parquet`` the videos of the parquet files'
``--image-column`` (row group and row in the row, as for images; a parquet value has no byte range, so
its row group's column chunk is read and each video probed from the bytes in hand). A rescan reuses the
previous manifest's row of an unchanged loose video (same size and ETag, or mtime: no header read, its
sidecar read again; :func:`pipeline.sources.rescan.reusable_videos`), and the video rows of an unchanged tar shard
or parquet file (same size and ETag, or mtime, and the same ``--caption-field``/``--image-column`` settings:
:func:`pipeline.sources.containers.shard_plan`, :func:`pipeline.sources.rescan.reusable_container_videos`).
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests import faults
from manifests.buckets import BucketSpec
from manifests.errors import StorageError
from manifests.frames import FrameLadder, assign_frames, video_bucket_names
from manifests.manifest import Manifest, apply_buckets, conform
from manifests.manifest_meta import ManifestMeta, ScanSummary
from manifests.schema import VIDEO_ERRORS_SCHEMA, VIDEO_SAMPLES_SCHEMA, sample_ids
from manifests.storage import is_local, join, open_url, redact
from pipeline.scan.config import ScanConfig
from pipeline.sources.captions import decode_caption, sidecar_stem
from pipeline.sources.containers import ScanPart, ShardPlan, container_settings, shard_plan
from pipeline.sources.headers import StorageFailure
from pipeline.sources.listing import Listing, WorkItem, work_items, work_table
from pipeline.sources.reading import SIDECAR_LIMIT
from pipeline.sources.rescan import reusable_container_videos, reusable_videos
from pipeline.sources.captions import CaptionTable
from pipeline.sources.parquet import VIDEO_PARQUET_ROWS, scan_video_parquet_batch
from pipeline.sources.shards import shard_work
from pipeline.sources.tasks import run_tasks
from pipeline.sources.video import VideoProbe, probe_video
from pipeline.sources.video_shards import VIDEO_SHARD_ROWS, scan_video_shard_batch

__all__ = ["scan_video_batch", "video_part", "one_frame", "one_frame_samples", "bucket_videos", "video_scan_part",
           "video_summary_line"]

_PROBE_FIELDS = (
    pa.field("name", pa.string()), pa.field("size", pa.int64()), pa.field("width", pa.int32()),
    pa.field("height", pa.int32()), pa.field("frames", pa.int32()), pa.field("fps", pa.float64()),
    pa.field("duration", pa.float64()), pa.field("codec", pa.string()), pa.field("format", pa.string()),
    pa.field("frame_count_from", pa.string()), pa.field("error", pa.string()), pa.field("message", pa.string()),
    pa.field("bytes_read", pa.int64()), pa.field("requests", pa.int32()), pa.field("caption", pa.string()),
)  # fmt: skip
VIDEO_PROBE_SCHEMA = pa.schema(_PROBE_FIELDS)
_UNBUCKETED = pa.schema([f for f in VIDEO_SAMPLES_SCHEMA if f.name != "bucket"])  # a video row before bucketing


def scan_video_batch(target: tuple, batch: pa.Table, config: ScanConfig) -> pa.Table:
    """One Ray task: probe the videos of ``batch`` (a work table) and read their sidecars, threads in flight."""
    source, storage_options, fs, root = target
    if fs is None:
        fs, root = open_url(source, storage_options)
    items = work_items(batch)
    with ThreadPoolExecutor(max(1, min(len(items), config.reads_in_flight, 32))) as pool:
        rows = list(pool.map(lambda item: _probe_one(fs, root, item), items))
    faults.hit("scan.task")
    columns = list(zip(*rows)) if rows else [[] for _ in _PROBE_FIELDS]
    arrays = [pa.array(c, f.type) for c, f in zip(columns, _PROBE_FIELDS)]
    return pa.Table.from_arrays(arrays, schema=VIDEO_PROBE_SCHEMA)


def _probe_one(fs, root: str, item: WorkItem) -> tuple:
    path = join(root, item.name)
    try:
        if not item.probe:  # a rescan reuses the previous row's probe (filled in by the driver): the sidecar only
            probe = VideoProbe()
        elif is_local(fs):
            with open(path, "rb") as fh:
                fd = fh.fileno()
                probe = probe_video(lambda start, end: os.pread(fd, end - start, start), item.size)
        else:
            probe = probe_video(lambda start, end: fs.cat_file(path, start=start, end=end), item.size)
    except StorageFailure as e:
        probe = VideoProbe(error="read_failed", message=f"reading the header failed: {e}")
    caption = None
    if item.sidecar is not None:
        try:
            caption = decode_caption(fs.cat_file(join(root, item.sidecar), start=0, end=min(item.sidecar_size,
                                                                                            SIDECAR_LIMIT)))
        except Exception as e:  # a sidecar that cannot be read fails the scan, as for images
            raise StorageError(f"reading {item.sidecar}: {e}") from None
    fmt = probe.format.split(",")[0] if probe.format else None
    return (item.name, item.size, probe.width, probe.height, probe.frames, probe.fps, probe.duration, probe.codec, fmt,
            probe.frame_count_from, probe.error, probe.message, probe.bytes_read, probe.requests, caption)  # fmt: skip


def _work(listing: Listing, reused: dict[str, dict]) -> list[WorkItem]:
    items = []
    for entry in listing.videos:
        sidecar = listing.sidecars.get(sidecar_stem(entry.name))
        items.append(WorkItem(entry.name, entry.size, entry.name not in reused, sidecar.name if sidecar else None,
                              sidecar.size if sidecar else 0))  # fmt: skip
    return items


def video_part(listing: Listing, target: tuple, config: ScanConfig, spec: BucketSpec, ladder: FrameLadder,
               table: CaptionTable | None, ray_address: str | None, old: Manifest | None = None,
               where: str = "") -> ScanPart:  # fmt: skip
    """The loose videos and the containers' (tar shards', parquet files') videos of ``listing``: probed by Ray
    tasks, bucketed ``WxHxF``; rows and a summary. ``old``: the previous manifest (read from ``where``), whose
    rows of unchanged loose videos (:func:`pipeline.sources.rescan.reusable_videos`) and of unchanged containers
    (:func:`pipeline.sources.rescan.reusable_container_videos`) are taken as they are, nothing of theirs read."""
    clock = time.perf_counter()
    reused = reusable_videos(listing, old)
    probed, ray_seconds = _loose_videos(listing, target, config, ray_address, reused)
    shard_stats: dict[str, Any] = {}
    containers = listing.parquet if config.format == "parquet" else listing.shards
    plan = shard_plan(containers, old, config, where)
    if containers:
        in_shards, shard_stats, seconds = _container_videos(plan, old, target, config, ray_address)
        probed, ray_seconds = pa.concat_tables([probed, in_shards], promote_options="default"), ray_seconds + seconds
    if table is not None:
        probed = _table_captions(probed, table)
    failed = probed.filter(pc.is_valid(probed.column("error")))
    if target[1]:
        messages = [redact(m, target[1]) for m in failed.column("message").to_pylist()]
        failed = failed.set_column(failed.schema.get_field_index("message"), "message", pa.array(messages, pa.string()))
    good = probed.filter(pc.is_null(probed.column("error")))
    samples, errors = bucket_videos(good, spec, ladder)
    errors = pa.concat_tables([conform(failed, VIDEO_ERRORS_SCHEMA), errors])
    seconds = time.perf_counter() - clock - ray_seconds
    loose = probed.filter(pc.is_null(probed.column("container")))
    read = int(pc.sum(loose.column("bytes_read")).as_py() or 0) + shard_stats.get("bytes_read", 0)
    total = int(pc.sum(loose.column("size")).as_py() or 0) + sum(s.size for s in containers)
    videos = len(listing.videos) + shard_stats.get("videos", 0)
    requests = int(pc.sum(loose.column("requests")).as_py() or 0) + shard_stats.get("requests", 0)
    figures = {"videos": videos, "video_samples": samples.num_rows, "video_errors": errors.num_rows,
               "clips": int(pc.sum(samples.column("clips")).as_py() or 0), "video_bytes_read": read,
               "video_bytes": total, "video_read_fraction": round(read / total, 6) if total else 0.0,
               "video_requests": requests, "video_seconds": round(seconds, 3), "frame_ladder": ladder.to_json(),
               "videos_reused": len(reused),
               "ignored": listing.ignored, "ignored_hidden": listing.ignored_hidden,
               "ignored_extensions": dict(listing.ignored_extensions)}  # fmt: skip
    if containers:  # the settings: embed and the report read a parquet file's videos from its image_column
        figures.update(shards=len(containers), shard_bytes=sum(s.size for s in containers),
                       ignored_members=shard_stats.get("ignored_members", {}), shards_reused=plan.reused,
                       shards_new=plan.new, shards_changed=plan.changed, shards_deleted=plan.deleted,
                       **container_settings(config))  # fmt: skip
    listed = len(listing.videos) + len(containers)
    return ScanPart(samples, errors, ScanSummary.from_json(figures), {"listed": listed, "ignored": listing.ignored})


def _loose_videos(listing: Listing, target: tuple, config: ScanConfig, ray_address: str | None,
                  reused: dict[str, dict]) -> tuple[pa.Table, float]:  # fmt: skip
    """The probed rows of the loose videos (``filename``, the probe's columns, ``sample_id``, ``etag``,
    ``mtime``; those of ``reused`` from the previous manifest) and the seconds Ray took to start."""
    work = _work(listing, reused)
    per_task = config.files_per_task or 64

    def batches(cpus: int) -> list[pa.Table]:
        return [work_table(work[i : i + per_task]) for i in range(0, len(work), per_task)]

    try:
        results, ray_seconds = run_tasks(scan_video_batch, target, config, batches, len(work),
                                         progress=config.progress, ray_address=ray_address)  # fmt: skip
    except StorageError as e:
        raise StorageError(redact(str(e), target[1])) from None
    probed = pa.concat_tables(results) if results else VIDEO_PROBE_SCHEMA.empty_table()
    if reused:  # the previous rows' probes in place of the empty ones of the items not probed
        rows = [{**r, **reused[r["name"]]} if r["name"] in reused else r for r in probed.to_pylist()]
        probed = pa.Table.from_pylist(rows, schema=VIDEO_PROBE_SCHEMA)
    entries = {e.name: e for e in listing.videos}
    names = probed.column("name").to_pylist()
    probed = probed.append_column("sample_id", pa.array(sample_ids(names), pa.uint64()))
    probed = probed.append_column("etag", pa.array([entries[n].etag for n in names], pa.string()))
    probed = probed.append_column("mtime", pa.array([entries[n].mtime for n in names], pa.float64()))
    probed = probed.append_column("container", pa.nulls(probed.num_rows, pa.string()))
    return probed.rename_columns(["filename" if c == "name" else c for c in probed.column_names]), ray_seconds


def _container_videos(plan: ShardPlan, old: Manifest | None, target: tuple, config: ScanConfig,
                      ray_address: str | None) -> tuple[pa.Table, dict[str, Any], float]:  # fmt: skip
    """The video members of the tar shards ``plan`` reads (:mod:`pipeline.sources.video_shards`), or with
    ``--format parquet`` the videos of the parquet files' ``--image-column``
    (:func:`pipeline.sources.parquet.scan_video_parquet_batch`), and the rows of the containers it keeps from
    ``old``: their rows with ``sample_id``, the read containers' summed counts, the seconds Ray took to start."""
    shards = plan.work
    parquet = config.format == "parquet"
    task, schema = (scan_video_parquet_batch, VIDEO_PARQUET_ROWS) if parquet else (scan_video_shard_batch,
                                                                                   VIDEO_SHARD_ROWS)  # fmt: skip
    per_task = max(1, min(16, -(-len(shards) // 64)))

    def batches(cpus: int) -> list[pa.Table]:
        return [shard_work(shards[i : i + per_task]) for i in range(0, len(shards), per_task)]

    try:
        results, ray_seconds = run_tasks(task, target, config, batches, len(shards),
                                         progress=config.progress, ray_address=ray_address, unit="shards",
                                         count=lambda t: json.loads(t.schema.metadata[b"stats"])["shards"])  # fmt: skip
    except StorageError as e:
        raise StorageError(redact(str(e), target[1])) from None
    stats: dict[str, Any] = {"requests": 0, "bytes_read": 0, "videos": 0, "ignored_members": {}}
    for result in results:
        found = json.loads(result.schema.metadata[b"stats"])
        found["videos"] = found.get("videos", found.get("images", 0))  # a parquet file's counts name them images
        for name in ("requests", "bytes_read", "videos"):
            stats[name] += found[name]
        for ext, n in found.get("ignored_members", {}).items():
            stats["ignored_members"][ext] = stats["ignored_members"].get(ext, 0) + n
    read = [r.replace_schema_metadata(None) for r in results]
    reused = reusable_container_videos(old, plan.kept, schema)
    stats["videos"] += int(pc.sum(pc.not_equal(reused.column("filename"), reused.column("container"))).as_py() or 0)
    rows = pa.concat_tables([reused, *read])
    rows = rows.append_column("sample_id", pa.array(sample_ids(rows.column("filename").to_pylist()), pa.uint64()))
    return rows, stats, ray_seconds


def _table_captions(probed: pa.Table, table: CaptionTable) -> pa.Table:
    captions = probed.column("caption").to_pylist()
    names = probed.column("filename").to_pylist()
    merged = [table.merged(n, c, None)[0] if n in table.captions else c for n, c in zip(names, captions)]
    return probed.set_column(probed.schema.get_field_index("caption"), "caption", pa.array(merged, pa.string()))


def bucket_videos(videos: pa.Table, spec: BucketSpec, ladder: FrameLadder) -> tuple[pa.Table, pa.Table]:
    """Bucket probed video rows ``WxHxF``; returns ``(samples, errors)``: ``too_small`` and ``too_short`` rejects."""
    samples, small = apply_buckets(conform(videos, _UNBUCKETED), spec, video=True)  # the video columns ride along
    bucket_frames, clips, short = assign_frames(ladder, samples.column("frames").to_numpy(zero_copy_only=False))
    samples = samples.set_column(samples.schema.get_field_index("bucket"), "bucket",
                                 video_bucket_names(samples.column("bucket"), bucket_frames))  # fmt: skip
    samples = samples.set_column(samples.schema.get_field_index("clips"), "clips", pa.array(clips, pa.int32()))
    too_short = samples.filter(pa.array(short)).drop_columns(["bucket"])
    too_short = too_short.append_column("error", pa.array(["too_short"] * too_short.num_rows, pa.string()))
    too_short = too_short.append_column("message", pa.array(
        [f"{n} frames, fewer than the shortest frame bucket ({ladder.frames[0]}; --frames)"
         for n in too_short.column("frames").to_pylist()], pa.string()))  # fmt: skip
    too_short = too_short.set_column(too_short.schema.get_field_index("clips"), "clips",
                                     pa.nulls(too_short.num_rows, pa.int32()))  # fmt: skip
    return samples.filter(pa.array(~short)), pa.concat_tables([small, conform(too_short, VIDEO_ERRORS_SCHEMA)])


def one_frame(part: ScanPart) -> ScanPart:
    """An image part in a video manifest: each sample 1 frame (``frames`` 1, ``clips`` 1, bucket ``WxHx1``)."""
    return ScanPart(one_frame_samples(part.samples), conform(part.errors, VIDEO_ERRORS_SCHEMA), part.summary,
                    part.counts)  # fmt: skip


def one_frame_samples(images: pa.Table) -> pa.Table:
    """Bucketed image rows (``WxH``) as the 1-frame samples of a video manifest (``WxHx1``, frames 1, clips 1)."""
    samples = conform(images, VIDEO_SAMPLES_SCHEMA)
    n = samples.num_rows
    samples = samples.set_column(samples.schema.get_field_index("bucket"), "bucket",
                                 video_bucket_names(samples.column("bucket"), np.ones(n, np.int32)))  # fmt: skip
    samples = samples.set_column(samples.schema.get_field_index("frames"), "frames", pa.array(np.ones(n, np.int32)))
    return samples.set_column(samples.schema.get_field_index("clips"), "clips", pa.array(np.ones(n, np.int32)))


def video_scan_part(images: ScanPart | None, videos: ScanPart) -> ScanPart:
    """One part of a video scan: the videos and the (1-frame) images, one summary counting both."""
    parts = [p for p in (images, videos) if p is not None]
    samples = pa.concat_tables([p.samples for p in parts])
    errors = pa.concat_tables([p.errors for p in parts])
    kinds: dict[str, int] = {}
    for kind in errors.column("error").to_pylist():
        kinds[kind] = kinds.get(kind, 0) + 1
    base: dict[str, Any] = images.summary.to_json() if images is not None else {}
    summary = {**base, **videos.summary.to_json(), "samples": samples.num_rows, "errors": errors.num_rows,
               "errors_by_kind": kinds, "images_loose": None}  # fmt: skip
    summary["listed"] = sum(p.counts.get("listed", 0) for p in parts)
    counts = {"listed": summary["listed"], "ignored": videos.counts["ignored"]}
    return ScanPart(samples, errors, ScanSummary.from_json({k: v for k, v in summary.items() if v is not None}),
                    counts)  # fmt: skip


def video_summary_line(meta: ManifestMeta, out: str) -> str:
    """The closing line of a video scan: videos, clips, images, errors, what share of the bytes was read."""
    s, other = meta.summary, meta.summary.other
    kinds = ", ".join(f"{k} {v}" for k, v in sorted((s.errors_by_kind or {}).items())) or "none"
    videos, images = other.get("videos", 0), (s.samples or 0) - other.get("video_samples", 0)
    read, total = other.get("video_bytes_read", 0), other.get("video_bytes", 0)
    share = f"{100 * read / total:.2f}%" if total else "-"
    reuse = (f", reused: {other.get('videos_reused', 0)} loose videos, {s.shards_reused} of {s.shards} containers"
             if other.get("videos_reused") or s.shards_reused else "")  # fmt: skip
    return (f"scan (video, frames {','.join(map(str, meta.frame_ladder or []))}): {videos} videos -> "
            f"{other.get('video_samples', 0)} samples ({other.get('clips', 0)} clips), {images} images as 1-frame "
            f"samples, {s.errors} errors ({kinds}) -> {redact(out)}; video headers: {read / 1e6:.2f} MB read of "
            f"{total / 1e6:.2f} MB ({share}){reuse}")
