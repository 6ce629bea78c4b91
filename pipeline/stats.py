"""Print a manifest's counts, bucket histogram and errors by kind (``--json`` for machines)."""

from __future__ import annotations

import argparse
import json as _json
from dataclasses import dataclass, field
from typing import Any

from manifests.manifest import manifest_stats, read_manifest
from manifests.manifest_meta import ManifestCounts
from manifests.storage import parse_storage_options

__all__ = ["StatsJob", "StatsResult", "add_arguments", "job_from_args", "run"]


@dataclass(frozen=True, kw_only=True)
class StatsJob:
    """``bucketeer stats``: the figures of the manifest at ``manifest``; ``json``: print one JSON object."""

    manifest: str
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec options, e.g. an endpoint_url
    json: bool = False


@dataclass(frozen=True, kw_only=True)
class StatsResult:
    url: str
    fingerprint: str
    counts: ManifestCounts
    captioned: int  # samples with a caption
    buckets: dict[str, int]  # bucket -> samples, largest first
    errors: dict[str, int]  # error kind -> rows, most first


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", help="manifest folder (local path or URL)")
    parser.add_argument("--storage-options", default=None, help="fsspec options as JSON, e.g. an endpoint_url")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def job_from_args(args: argparse.Namespace) -> StatsJob:
    """The job of ``bucketeer stats``' options; raises UsageError for bad ``--storage-options``."""
    return StatsJob(manifest=args.manifest, storage_options=parse_storage_options(args.storage_options),
                    json=args.json)  # fmt: skip


def run(job: StatsJob) -> StatsResult:
    """Print the manifest's figures (tables, or JSON); raises ManifestError for an unreadable manifest."""
    manifest = read_manifest(job.manifest, job.storage_options)
    stats = manifest_stats(manifest)
    result = StatsResult(url=job.manifest, fingerprint=manifest.fingerprint, counts=manifest.meta.counts,
                         captioned=stats["captioned"], buckets=stats["buckets"], errors=stats["errors"])  # fmt: skip
    if job.json:
        print(_json.dumps(stats, indent=2, sort_keys=True))
        return result
    print("counts:   " + ", ".join(f"{k} {v}" for k, v in sorted(result.counts.to_json().items())))
    print(f"captions: {result.captioned} of {result.counts.samples} samples have one")
    total = max(1, result.counts.samples)
    print(f"buckets:  {len(result.buckets)}")
    for bucket, n in result.buckets.items():
        bar = "#" * max(1, round(40 * n / total))
        print(f"  {bucket:>10}  {n:>9}  {100 * n / total:5.1f}%  {bar}")
    print(f"errors:   {sum(result.errors.values())}")
    for kind, n in result.errors.items():
        print(f"  {kind:>16}  {n:>9}")
    return result


if __name__ == "__main__":
    from pipeline.cli import exit_after, module_main

    exit_after(module_main, "stats")
