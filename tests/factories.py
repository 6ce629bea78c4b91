"""Tiny, deterministic test data built inside the tests (no downloads)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from manifests.buckets import BucketSpec
from manifests.manifest import apply_buckets
from manifests.schema import sample_ids


def image_rows(n: int, seed: int = 0, *, min_side: int = 32, max_side: int = 4096) -> pa.Table:
    """``n`` synthetic image rows (as a scan would produce them, before bucketing)."""
    rng = np.random.default_rng(seed)
    names = [f"dir{i % 7}/img_{i:06d}.jpg" for i in range(n)]
    w = rng.integers(min_side, max_side, n).astype(np.int32)
    h = rng.integers(min_side, max_side, n).astype(np.int32)
    captions = [None if i % 5 == 0 else f"a photo number {i}" for i in range(n)]
    return pa.table(
        {
            "sample_id": pa.array(sample_ids(names), pa.uint64()),
            "filename": names,
            "width": w,
            "height": h,
            "caption": pa.array(captions, pa.string()),
            "size": pa.array(rng.integers(1000, 3_000_000, n), pa.int64()),
            "etag": [f"etag{i}" for i in range(n)],
            "format": ["JPEG"] * n,
            "orientation": pa.array(np.ones(n, np.int8)),
            "bytes_read": pa.array(np.full(n, 65536, np.int64)),
        }
    )


def manifest_tables(n: int, seed: int = 0, spec: BucketSpec | None = None, n_errors: int = 3):
    """``(samples, errors)`` tables for a synthetic manifest with a few non-image error rows."""
    samples, small = apply_buckets(image_rows(n, seed), spec or BucketSpec())
    bad = [f"broken/bad_{i}.jpg" for i in range(n_errors)]
    errors = pa.table(
        {
            "sample_id": pa.array(sample_ids(bad), pa.uint64()),
            "filename": bad,
            "error": ["truncated"] * n_errors,
            "message": ["image file is truncated"] * n_errors,
            "size": pa.array([10] * n_errors, pa.int64()),
        }
    )
    from manifests.manifest import conform
    from manifests.schema import ERRORS_SCHEMA

    return samples, pa.concat_tables([conform(errors, ERRORS_SCHEMA), small])


def video_manifest_tables(n_videos: int, n_images: int = 0, seed: int = 0, *, frames=(17, 33, 49),
                          spec: BucketSpec | None = None, max_frames: int = 120):  # fmt: skip
    """``(samples, errors)`` of a synthetic video manifest (``scan --frames``), bucketed by the scan's own code:
    ``n_videos`` clips of 5..``max_frames`` frames (``too_short`` rows below the shortest of ``frames``) and
    ``n_images`` 1-frame image samples (``WxHx1``). Write it with ``frame_ladder=frames``."""
    from manifests.frames import FrameLadder, video_bucket_names
    from manifests.manifest import conform
    from manifests.schema import VIDEO_SAMPLES_SCHEMA
    from pipeline.scan.video import bucket_videos

    spec = spec or BucketSpec(area=256 * 256, step=32)
    rng = np.random.default_rng(seed)
    videos = image_rows(n_videos, seed, min_side=64, max_side=1024)
    videos = videos.set_column(1, "filename", pa.array([f"clips/v_{i:05d}.mp4" for i in range(n_videos)]))
    videos = videos.set_column(0, "sample_id", pa.array(sample_ids(videos.column("filename").to_pylist()), pa.uint64()))
    n = videos.num_rows
    extra = {"frames": pa.array(rng.integers(5, max_frames, n), pa.int32()), "fps": pa.array(np.full(n, 24.0)),
             "codec": pa.array(["h264"] * n), "frame_count_from": pa.array(["index"] * n)}  # fmt: skip
    for name, column in extra.items():
        videos = videos.append_column(name, column)
    videos = videos.append_column("duration", pa.array(np.asarray(videos.column("frames"), np.float64) / 24))
    samples, errors = bucket_videos(videos, spec, FrameLadder(tuple(frames)))
    images, small = apply_buckets(image_rows(n_images, seed + 1, min_side=64, max_side=1024), spec, video=True)
    ones = np.ones(images.num_rows, np.int32)
    images = images.set_column(images.schema.get_field_index("bucket"), "bucket",
                               video_bucket_names(images.column("bucket"), ones))  # fmt: skip
    images = images.set_column(images.schema.get_field_index("frames"), "frames", pa.array(ones))
    images = images.set_column(images.schema.get_field_index("clips"), "clips", pa.array(ones))
    samples = pa.concat_tables([conform(t, VIDEO_SAMPLES_SCHEMA) for t in (samples, images)])
    return samples, pa.concat_tables([errors, small])


# what the offline GPU machine lacks (benchmarks/gpu_check.py must run without them)
GPU_MACHINE_ABSENT = ("ray", "polars", "s3fs", "vllm")


def absent_modules_site(folder, names=GPU_MACHINE_ABSENT):
    """A folder holding a ``sitecustomize.py`` that makes ``names`` unimportable: put it first on ``PYTHONPATH``
    and a process and every process it starts behave as on a machine without those packages. Returns it."""
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(f"""import sys


class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {tuple(names)!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent in this test)")


sys.meta_path.insert(0, Absent())
""")
    return folder
