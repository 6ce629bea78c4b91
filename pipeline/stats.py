"""Print a manifest's counts, bucket histogram and errors by kind (``--json`` for machines).

    bucketeer stats MANIFEST
    bucketeer stats MANIFEST --annotations SCORES,DUPS --where "aesthetic > 5.5 AND NOT duplicate"

With ``--where`` (the selection of ``bucketeer plan --where``, :mod:`manifests.select`) it also prints, before
any planning, how many samples and pixels the filter keeps, per bucket, and text histograms of the scores it
reads (and of ``aesthetic``, ``safety``, ``watermark`` where the annotations have them), all and kept.
"""

from __future__ import annotations

import argparse
import json as _json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from manifests.errors import UsageError
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
    annotations: tuple[str, ...] = ()  # folders whose columns --where reads
    where: str | None = None  # a selection to measure (bucketeer plan --where)


@dataclass(frozen=True, kw_only=True)
class StatsResult:
    url: str
    fingerprint: str
    counts: ManifestCounts
    captioned: int  # samples with a caption
    buckets: dict[str, int]  # bucket -> samples, largest first
    errors: dict[str, int]  # error kind -> rows, most first
    selected: int | None = None  # samples --where keeps (None without --where)
    selected_buckets: dict[str, tuple[int, int]] | None = None  # bucket -> (kept, dropped)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", help="manifest folder (local path or URL)")
    parser.add_argument("--storage-options", default=None, help="fsspec options as JSON, e.g. an endpoint_url")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--annotations", default=None, metavar="A[,B...]",
                        help="annotations folders whose columns --where reads, comma-separated")
    parser.add_argument("--where", default=None, metavar="SQL",
                        help="show what this selection (as bucketeer plan --where) keeps: samples and pixels per "
                        "bucket, and score histograms")


def job_from_args(args: argparse.Namespace) -> StatsJob:
    """The job of ``bucketeer stats``' options; raises UsageError for bad ``--storage-options``."""
    return StatsJob(manifest=args.manifest, storage_options=parse_storage_options(args.storage_options),
                    json=args.json, where=args.where,
                    annotations=tuple(a.strip() for a in args.annotations.split(",")) if args.annotations else ())


def run(job: StatsJob) -> StatsResult:
    """Print the manifest's figures (tables, or JSON); raises ManifestError for an unreadable manifest, and
    UsageError for ``--annotations`` without ``--where`` or a bad selection (:func:`manifests.select.evaluate`)."""
    if job.annotations and job.where is None:
        raise UsageError("--annotations is read by --where: give the selection to measure, e.g. --where "
                         "\"aesthetic > 5\"")  # fmt: skip
    manifest = read_manifest(job.manifest, job.storage_options)
    stats = manifest_stats(manifest)
    result = StatsResult(url=job.manifest, fingerprint=manifest.fingerprint, counts=manifest.meta.counts,
                         captioned=stats["captioned"], buckets=stats["buckets"], errors=stats["errors"])  # fmt: skip
    selection = None
    if job.where is not None:
        from dataclasses import replace

        from manifests.select import annotation_sources, evaluate

        sources = annotation_sources(job.annotations, job.storage_options)
        selection = evaluate([manifest], sources, job.where, None, job.storage_options).selections[0]
        result = replace(result, selected=selection.kept, selected_buckets=selection.per_bucket())
    if job.json:
        if result.selected_buckets is not None:
            per_bucket = {b: {"kept": k, "dropped": d} for b, (k, d) in result.selected_buckets.items()}
            stats["where"] = {"expression": job.where, "kept": result.selected, "buckets": per_bucket}
        print(_json.dumps(stats, indent=2, sort_keys=True))
        return result
    print("counts:   " + ", ".join(f"{k} {v}" for k, v in sorted(result.counts.to_json().items())))
    print(f"captions: {result.captioned} of {result.counts.samples} samples have one")
    total = max(1, result.counts.samples)
    print(f"buckets:  {len(result.buckets)}" + (" (kept per bucket below)" if selection is not None else ""))
    for bucket, n in result.buckets.items() if selection is None else ():
        bar = "#" * max(1, round(40 * n / total))
        print(f"  {bucket:>10}  {n:>9}  {100 * n / total:5.1f}%  {bar}")
    print(f"errors:   {sum(result.errors.values())}")
    for kind, n in result.errors.items():
        print(f"  {kind:>16}  {n:>9}")
    if selection is not None:
        _print_selection(job, manifest, result, selection, sources)
    return result


_SCORES = ("aesthetic", "safety", "watermark")  # histogrammed where the annotations have them
_SHOWN_BUCKETS = 12
_BINS = 8


def _print_selection(job: StatsJob, manifest: Any, result: StatsResult, sel: Any, sources: Any) -> None:
    """Samples and pixels kept, per bucket (the largest), and score histograms (all | kept): one screen."""
    from manifests.select import read_columns
    pixels = (manifest.samples.column("width").to_numpy().astype(np.int64) *
              manifest.samples.column("height").to_numpy().astype(np.int64))  # (n,)  # fmt: skip
    n, kept = len(sel.keep), sel.kept
    print(f"where:    {job.where}")
    print(f"  kept {kept} of {n} samples ({100 * kept / max(n, 1):.1f}%), {pixels[sel.keep].sum() / 1e6:.1f} of "
          f"{pixels.sum() / 1e6:.1f} megapixels ({100 * pixels[sel.keep].sum() / max(pixels.sum(), 1):.1f}%)")
    print(f"  {'bucket':>10}  {'kept':>9}  {'of':>9}  {'kept %':>6}")
    buckets = sorted((result.selected_buckets or {}).items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    for name, (k, d) in buckets[:_SHOWN_BUCKETS]:
        print(f"  {name:>10}  {k:>9}  {k + d:>9}  {100 * k / max(k + d, 1):5.1f}%")
    if len(buckets) > _SHOWN_BUCKETS:
        rest = buckets[_SHOWN_BUCKETS:]
        print(f"  {len(rest)} more buckets: {sum(k for _, (k, _) in rest)} kept of {sum(k + d for _, (k, d) in rest)}")
    available = {c for a in sources for c in a.columns} | set(manifest.samples.column_names)
    used = sel_columns(job.where)
    from_annotations = [c for c in (*used, *_SCORES) if c in available and c not in manifest.samples.column_names]
    wanted = [*from_annotations, *(c for c in used if c in manifest.samples.column_names)]
    frame = read_columns(manifest, sources, list(dict.fromkeys(wanted)), job.storage_options)
    shown = 0
    for column in frame.columns:
        values = frame[column]
        if shown == 3 or not values.dtype.is_numeric():
            continue
        _histogram(column, values.cast(float).to_numpy(), sel.keep)
        shown += 1


def sel_columns(where: str | None) -> list[str]:
    """The columns a ``--where`` expression reads."""
    from manifests.filters import parse_filter

    return [] if where is None else list(parse_filter(where, "--where").columns)


def _histogram(column: str, values: np.ndarray, keep: np.ndarray) -> None:
    """A text histogram of ``values`` (NaN: no annotations row), all samples and kept ones side by side."""
    known = ~np.isnan(values)
    print(f"histogram {column} (all | kept){f', {int((~known).sum())} without a value' if (~known).any() else ''}:")
    if not known.any():
        return
    lo, hi = float(values[known].min()), float(values[known].max())
    edges = np.linspace(lo, hi if hi > lo else lo + 1, _BINS + 1)
    every = np.histogram(values[known], edges)[0]
    kept = np.histogram(values[known & keep], edges)[0]
    top = max(int(every.max()), 1)
    for i in range(_BINS):
        print(f"  [{edges[i]:8.3g}, {edges[i + 1]:8.3g}{']' if i == _BINS - 1 else ')'}  {every[i]:>8} "
              f"{'#' * round(20 * every[i] / top):<20} | {kept[i]:>8} {'#' * round(20 * kept[i] / top)}")


if __name__ == "__main__":
    from pipeline.cli import exit_after, module_main

    exit_after(module_main, "stats")
