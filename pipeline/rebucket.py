"""Re-assign buckets from a manifest's stored sizes into a new manifest, without reading any image.

Change the training resolution (or bucket list, or min side) without rescanning:
``bucketeer rebucket MANIFEST --out NEW --resolution 512``, or from Python
``run(RebucketJob(manifest="m/", out="m512/", spec=BucketSpec(area=512 * 512)))``. A video manifest
(``scan --frames``) keeps its frame ladder: its rows get the buckets a video scan with the new options gives
(:func:`rebucket_video`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from manifests.lock import writer_lock
from manifests.buckets import BucketSpec, add_bucket_arguments, spec_from_args
from manifests.frames import FrameLadder
from manifests.manifest import Manifest, apply_buckets, conform, read_manifest, rebucket, write_manifest
from manifests.schema import VIDEO_ERRORS_SCHEMA, VIDEO_SAMPLES_SCHEMA
from manifests.manifest_meta import ManifestMeta
from manifests.storage import parse_storage_options

__all__ = ["RebucketJob", "RebucketResult", "add_arguments", "job_from_args", "run", "rebucket_video"]


@dataclass(frozen=True, kw_only=True)
class RebucketJob:
    """``bucketeer rebucket``: the manifest at ``manifest`` bucketed again by ``spec`` into ``out``
    (which may be ``manifest`` itself)."""

    manifest: str
    out: str
    spec: BucketSpec = field(default_factory=BucketSpec)
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec options, e.g. an endpoint_url


@dataclass(frozen=True, kw_only=True)
class RebucketResult:
    url: str  # the new manifest
    fingerprint: str
    meta: ManifestMeta
    samples: int
    errors: int
    buckets: int  # distinct buckets the samples fill


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", help="existing manifest folder (local path or URL)")
    parser.add_argument("--out", required=True, help="folder for the new manifest (may equal MANIFEST)")
    parser.add_argument("--storage-options", default=None, help="fsspec options as JSON, e.g. an endpoint_url")
    add_bucket_arguments(parser)


def job_from_args(args: argparse.Namespace) -> RebucketJob:
    """The job of ``bucketeer rebucket``'s options; raises UsageError for bad bucket or storage options."""
    return RebucketJob(manifest=args.manifest, out=args.out, spec=spec_from_args(args),
                       storage_options=parse_storage_options(args.storage_options))  # fmt: skip


def run(job: RebucketJob) -> RebucketResult:
    """Write the re-bucketed manifest and print one line; raises ManifestError for an unreadable manifest."""
    old = read_manifest(job.manifest, job.storage_options)
    samples, errors = rebucket(old, job.spec) if old.meta.frame_ladder is None else rebucket_video(old, job.spec)
    counts = {k: v for k, v in old.meta.counts.to_json().items() if k not in ("samples", "errors")}
    with writer_lock(job.out, job.storage_options, "rebucket"):
        meta = write_manifest(job.out, samples, errors, source=old.source, spec=job.spec, counts=counts,
                              summary=replace(old.meta.summary, rebucketed_from=old.fingerprint),
                              max_pixels=old.max_pixels,  # the rows were judged by it; embed decodes up to it
                              frame_ladder=old.meta.frame_ladder, storage_options=job.storage_options)  # fmt: skip
    n_buckets = len(set(samples.column("bucket").to_pylist()))
    print(
        f"rebucketed {samples.num_rows} samples into {n_buckets} buckets "
        f"({errors.num_rows} error rows) -> {job.out} (fingerprint {meta.fingerprint[:12]})"
    )
    return RebucketResult(url=job.out, fingerprint=meta.fingerprint, meta=meta, samples=samples.num_rows,
                          errors=errors.num_rows, buckets=n_buckets)  # fmt: skip


def rebucket_video(manifest: Manifest, spec: BucketSpec) -> tuple[pa.Table, pa.Table]:
    """A video manifest's rows bucketed again by ``spec``, with its own frame ladder, as a video scan buckets
    them (:func:`pipeline.scan.video.bucket_videos`): videos ``WxHxF``, images ``WxHx1``; ``too_small`` and
    ``too_short`` rows are judged again, other error rows carried over. Returns new ``(samples, errors)``."""
    from pipeline.scan.video import bucket_videos, one_frame_samples

    redo = pc.is_in(manifest.errors.column("error"), pa.array(["too_small", "too_short"]))
    unbucketed = pa.schema([f for f in VIDEO_SAMPLES_SCHEMA if f.name not in ("bucket", "clips")])  # as probed
    rows = pa.concat_tables([conform(t, unbucketed) for t in (manifest.samples, manifest.errors.filter(redo))])
    image = pc.is_null(rows.column("codec")).combine_chunks()  # a scanned video always has its codec; an image none
    videos, rejects = bucket_videos(rows.filter(pc.invert(image)), spec, FrameLadder(manifest.meta.frame_ladder))
    images, small = apply_buckets(rows.filter(image), spec, video=True)
    return (pa.concat_tables([videos, one_frame_samples(images)]),
            pa.concat_tables([manifest.errors.filter(pc.invert(redo)), rejects, conform(small, VIDEO_ERRORS_SCHEMA)]))


if __name__ == "__main__":
    from pipeline.cli import exit_after, module_main

    exit_after(module_main, "rebucket")
