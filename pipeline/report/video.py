"""The report of a video manifest (``scan --frames``): frame counts and a contact sheet per bucket.

    bucketeer report ./clips-manifest --out report.html

:func:`video_part` adds to the page of a manifest whose ``_manifest.json`` has a ``frame_ladder``:
a histogram of frames per video, the samples per frame bucket (``F`` of ``WxHxF``; images are the
1-frame samples), and for each bucket (the :data:`SHEET_BUCKETS` largest) a contact sheet: for its
first :data:`SHEET_VIDEOS` videos (by ``sample_id``) the first, middle and last frame of their first
clip (frames ``0``, ``F // 2``, ``F - 1``: clip 0 starts at frame 0, ``manifests/frames.py``).

Frames are decoded with PyAV from ranged reads (:class:`pipeline.sources.headers.RangeReader` over
the loose file, the tar member's byte range, or a parquet value read by its row group as embed reads
images): for each frame, a seek to the keyframe at or before it and a decode forward to it, so the
cost is a GOP or so per frame, never the whole video. A frame is found by its time, ``index / fps``
after the first frame's: the frame of that index for constant-rate video, the frame shown at that
time for variable-rate video. Frames are shown upright (the display matrix applied, as the scan's
``width``/``height``), the long side at most :data:`~pipeline.report.thumbs.GRID_PIXELS`.
"""

from __future__ import annotations

import io
import os
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests.frames import parse_video_bucket
from manifests.manifest import Manifest
from manifests.storage import is_local, join, open_url
from pipeline.report.scores import ReportPart
from pipeline.report.thumbs import GRID_PIXELS, Thumb, ThumbGrid

__all__ = ["SHEET_BUCKETS", "SHEET_VIDEOS", "clip_frame_indices", "decode_frames", "video_part", "video_reader"]

SHEET_BUCKETS = 12  # buckets with a contact sheet: the largest (a page holds a few hundred thumbnails)
SHEET_VIDEOS = 3  # videos per bucket on its sheet, three frames each
_FIRST_READ = 64 * 1024  # the first read of a video; sequential misses then double (RangeReader)
_OPEN_OPTIONS = {"probesize": "32", "analyzeduration": "0"}  # as the scan: no packets read ahead to probe


def clip_frame_indices(bucket_frames: int) -> tuple[int, ...]:
    """The frames of the contact sheet in a clip of ``bucket_frames`` frames: first, middle, last (distinct)."""
    return tuple(sorted({0, bucket_frames // 2, bucket_frames - 1}))


def decode_frames(read_range: Callable[[int, int], bytes], size: int, indices: tuple[int, ...], *,
                  long_side: int = GRID_PIXELS):  # fmt: skip
    """The frames ``indices`` (0-based, ascending) of a video of ``size`` bytes read through ``read_range``,
    as upright RGB PIL images whose long side is at most ``long_side`` px; returns ``(images, bytes_read)``.

    Each frame: a seek to the keyframe at or before its time, then a decode forward to it (see the
    module docstring). A frame past the end gives the last frame decoded. Raises what PyAV raises
    for a file it cannot decode, and what ``read_range`` raises.
    """
    import av  # the `video` extra

    from pipeline.sources.headers import RangeReader

    reader = RangeReader(read_range, size, _FIRST_READ, max_bytes=max(size, 1))
    images = []
    with av.open(reader, options=_OPEN_OPTIONS, buffer_size=_FIRST_READ) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        rate = stream.average_rate or stream.guessed_rate or 24
        start = stream.start_time or 0  # in stream.time_base
        for index in indices:
            target = start + int(round(float(index / rate) / float(stream.time_base)))  # in stream.time_base
            container.seek(target, backward=True, any_frame=False, stream=stream)  # the keyframe at or before
            chosen = None
            for frame in container.decode(stream):
                if chosen is not None and frame.pts is not None and frame.pts > target:
                    break
                chosen = frame
                if frame.pts is not None and frame.pts >= target:
                    break
            if chosen is None:
                raise ValueError(f"no frame decoded at or after frame {index}")
            images.append(_upright(chosen, long_side))
    return images, reader.bytes_read


def _upright(frame, long_side: int):
    """The frame as the display matrix shows it (``frame.rotation``: degrees counter-clockwise), downscaled."""
    image = frame.to_image()
    rotation = int(getattr(frame, "rotation", 0) or 0) % 360
    if rotation:
        image = image.rotate(rotation, expand=True)
    image.thumbnail((long_side, long_side))
    return image


def video_reader(fs, root: str, row: dict, image_column: str | None) -> tuple[Callable[[int, int], bytes], int]:
    """``(read_range, size)`` of a row's video: the loose file, its tar member's bytes, or its parquet value."""
    from pipeline.embed.parquet_images import fetch_parquet_images, is_parquet_row

    size = int(row["size"])
    if is_parquet_row(row):  # no byte range holds a parquet value: its row group's column chunk is read
        blob = fetch_parquet_images(fs, root, [row], str(image_column))[0]
        if isinstance(blob, BaseException):
            raise blob
        return (lambda a, b: blob[a:b]), len(blob)
    path, offset = (join(root, row["container"]), int(row["member_offset"])) if row.get("container") \
        else (join(root, row["filename"]), 0)  # fmt: skip
    if is_local(fs):
        return (lambda a, b: _pread(path, offset + a, offset + b)), size
    return (lambda a, b: fs.cat_file(path, start=offset + a, end=offset + b)), size


def _pread(path: str, start: int, end: int) -> bytes:
    with open(path, "rb") as fh:
        return os.pread(fh.fileno(), end - start, start)


def _sheet_rows(samples: pa.Table) -> dict[str, list[dict]]:
    """The first :data:`SHEET_VIDEOS` videos (by sample_id) of the largest :data:`SHEET_BUCKETS` video buckets."""
    videos = samples.filter(pc.greater(samples.column("frames"), 1)).sort_by("sample_id")
    buckets = videos.column("bucket").to_pylist()
    counts: dict[str, int] = {}
    for b in buckets:
        counts[b] = counts.get(b, 0) + 1
    chosen = sorted(counts, key=lambda b: (-counts[b], b))[:SHEET_BUCKETS]
    at: dict[str, list[int]] = {b: [] for b in chosen}  # row positions in `videos`
    for i, b in enumerate(buckets):
        if b in at and len(at[b]) < SHEET_VIDEOS:
            at[b].append(i)
    return {b: videos.take(pa.array(i, pa.int64())).to_pylist() for b, i in at.items()}


def contact_sheets(manifest: Manifest, storage_options: dict[str, Any] | None = None) -> tuple[list[ThumbGrid], int]:
    """One grid per bucket (see :func:`_sheet_rows`): three frames of each video's first clip; a frame
    that cannot be read or decoded is a grey box. Returns ``(grids, bytes read)``."""
    fs, root = open_url(manifest.source, storage_options)
    image_column = manifest.meta.summary.image_column  # parquet: the column of video bytes
    grids, total = [], 0
    for bucket, rows in _sheet_rows(manifest.samples).items():
        clip = parse_video_bucket(bucket)[2]
        indices = clip_frame_indices(clip)
        thumbs: list[Thumb] = []
        for row in rows:
            try:
                read_range, size = video_reader(fs, root, row, image_column)
                images, read = decode_frames(read_range, size, indices)
                total += read
                blobs: list[bytes | None] = [_jpeg(im) for im in images]
            except Exception:  # untrusted bytes or a failing store: this video's frames are grey boxes
                blobs = [None] * len(indices)
            for index, blob in zip(indices, blobs):
                thumbs.append(Thumb(int(row["sample_id"]), row["filename"], f"frame {index} of {row['frames']}",
                                    blob))  # fmt: skip
        title = f"{bucket}: first, middle and last frame of the first clip of {len(rows)} of its videos"
        grids.append(ThumbGrid(f"sheet-{bucket}", title, thumbs))
    return grids, total


def _jpeg(image) -> bytes:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, "JPEG", quality=85)
    return buf.getvalue()


def video_part(manifest: Manifest, plots, storage_options: dict[str, Any] | None = None) -> ReportPart:
    """The ``Video`` part of the page: frame-count figures and the contact sheets (see the module docstring)."""
    samples = manifest.samples
    frames = samples.column("frames").to_numpy(zero_copy_only=False).astype(np.int64)  # (samples,)
    videos = frames[frames > 1]  # (videos,)
    per_bucket: dict[int, int] = {}
    for name in samples.column("bucket").to_pylist():
        f = parse_video_bucket(name)[2]
        per_bucket[f] = per_bucket.get(f, 0) + 1
    clips = samples.column("clips").to_numpy(zero_copy_only=False)[frames > 1]
    sources = pc.value_counts(samples.column("frame_count_from").drop_null()).to_pylist()
    codecs = pc.value_counts(samples.column("codec").drop_null()).to_pylist()
    grids, read = contact_sheets(manifest, storage_options)
    rows = [
        ("frame ladder", ", ".join(map(str, manifest.meta.frame_ladder or ()))),
        ("videos", f"{len(videos)} ({int(clips.sum())} clips), {int((frames == 1).sum())} images as 1-frame samples"),
        ("frames per video", f"min {videos.min()}, median {int(np.median(videos))}, max {videos.max()}"
                             if len(videos) else "no videos"),
        ("frame counts from", ", ".join(f"{d['values']} {d['counts']}" for d in sources) or "-"),
        ("codecs", ", ".join(f"{d['values']} {d['counts']}" for d in codecs) or "-"),
        ("contact sheets", f"{len(grids)} buckets; {read / 1e6:.2f} MB read to decode their frames"),
    ]  # fmt: skip
    figures = [
        ("video_frames", plots.png_bytes(plots.frame_histogram(videos, manifest.meta.frame_ladder or ())),
         "Frames per video (images excluded); dashed lines: the frame buckets."),
        ("frame_buckets", plots.png_bytes(plots.frame_bucket_counts(per_bucket)),
         "Samples per frame bucket (F of WxHxF; 1: images)."),
    ]  # fmt: skip
    return ReportPart("Video", rows, figures, grids)
