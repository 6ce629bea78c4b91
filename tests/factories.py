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
