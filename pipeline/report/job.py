"""Write a self-contained HTML report with plots of a manifest, and optionally of a plan and a cache.

    bucketeer report MANIFEST [--plan PLAN] [--cache CACHE] [--annotations A[,B...]] --out report.html
    bucketeer report MANIFEST --annotations SCORES,DUPS --where "aesthetic > 5" --out report.html  # kept/dropped

The page works offline: CSS inline, figures embedded as PNG ``data:`` URIs, no script, no external
URL. The same figures are written as PNG files to ``<out stem>_figures/`` next to the page; sample
thumbnail grids (captions, scores, duplicates) are inline only.
"""

from __future__ import annotations

import argparse
import base64
import datetime as _dt
import html
import io
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow.compute as pc

from manifests.errors import BucketeerError, UsageError
from manifests.manifest import Manifest, manifest_stats, read_manifest
from manifests.progress import Progress
from manifests.storage import join, open_url, parse_storage_options, redact, write_bytes_atomic
from pipeline.report.thumbs import GRID_CSS, ThumbGrid, grid_html


@dataclass
class Figure:
    name: str  # file stem of the PNG, e.g. "buckets"
    png: bytes
    note: str = ""
    wide: bool = False  # spans the whole row of the page


@dataclass
class Section:
    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)  # summary table (label, value)
    figures: list[Figure] = field(default_factory=list)
    grids: list[ThumbGrid] = field(default_factory=list)  # sample thumbnails, after the figures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", help="manifest folder (local path or URL)")
    parser.add_argument("--out", required=True, help="the HTML file to write (local path or URL)")
    parser.add_argument("--plan", default=None,
                        help="a plan folder made from this manifest: adds padding/drops and tokens per step")
    parser.add_argument("--cache", default=None, help="a cache folder: adds record counts, bytes per sample and errors")
    parser.add_argument("--annotations", default=None,
                        help="annotations folders, comma-separated (bucketeer annotate, bucketeer dedup): adds their "
                             "settings and counts, thumbnails with original and generated captions, a histogram "
                             "of each score with its lowest and highest scored samples, and the largest "
                             "duplicate clusters")
    parser.add_argument("--where", default=None, metavar="SQL",
                        help="a selection (as bucketeer plan --where) over the manifest and --annotations: adds what "
                        "it keeps and drops per bucket and thumbnails of dropped samples (a --plan made with "
                        "--where shows its own)")
    parser.add_argument("--storage-options", default=None, help="fsspec options as JSON, e.g. an endpoint_url")


@dataclass(frozen=True, kw_only=True)
class ReportJob:
    """The report of ``manifest`` (and of a plan and a cache made from it) as one HTML page at ``out``."""

    manifest: str
    out: str
    plan: str | None = None
    cache: str | None = None
    annotations: tuple[str, ...] | str = ()  # annotations folders (a str: one folder)
    where: str | None = None  # a selection to show (pipeline/report/selection.py)
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    progress: bool = True  # report sections built, on stderr

    def __post_init__(self) -> None:
        if isinstance(self.annotations, str):
            object.__setattr__(self, "annotations", (self.annotations,))
        if not self.out.endswith((".html", ".htm")):
            raise UsageError(f"--out {self.out!r} must name an .html file")


@dataclass(frozen=True)
class ReportResult:
    url: str  # the HTML page
    figures: tuple[str, ...]  # the PNG files beside it
    seconds: float


def job_from_args(args: argparse.Namespace) -> ReportJob:
    return ReportJob(manifest=args.manifest, out=args.out, plan=args.plan, cache=args.cache,
                     annotations=tuple(u.strip() for u in (args.annotations or "").split(",") if u.strip()),
                     where=args.where,
                     storage_options=parse_storage_options(args.storage_options))  # fmt: skip


def run(job: ReportJob) -> ReportResult:
    started = time.perf_counter()
    paths = write_report(job.manifest, job.out, plan=job.plan, cache=job.cache, annotations=job.annotations,
                         where=job.where, storage_options=dict(job.storage_options), progress=job.progress)  # fmt: skip
    print(f"report: {redact(paths[0])}  ({len(paths) - 1} figures in {redact(paths[0].rsplit('.', 1)[0])}_figures/)")
    return ReportResult(paths[0], tuple(paths[1:]), round(time.perf_counter() - started, 3))


def write_report(
    manifest_url: str,
    out: str,
    *,
    plan: str | None = None,
    cache: str | None = None,
    annotations: str | Sequence[str] | None = None,
    where: str | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> list[str]:
    """Build the report and write it; returns ``[html_path, png_path, ...]``. ``progress``:
    report sections built (:class:`manifests.progress.Progress`, on stderr).

    Raises ManifestError (a ValueError) for a bad manifest, FileNotFoundError for a plan or cache
    folder without its ``_plan.json`` / ``_cache.json``, AnnotationsMissingError (a UsageError) for an
    annotations folder without ``_annotations.json``. ``annotations``: one folder, or several joined on
    ``sample_id`` for the score and duplicate sections.
    """
    try:
        from pipeline.report import plots  # matplotlib only when a report is made
    except ImportError as e:
        raise BucketeerError(f"bucketeer report needs matplotlib ({e}): pip install 'bucketeer[report]'") from None

    if not out.endswith((".html", ".htm")):
        raise UsageError(f"--out {out!r} must name an .html file")
    annotations = (annotations,) if isinstance(annotations, str) else tuple(annotations or ())
    total = 1 + bool(plan) + bool(cache) + len(annotations) + bool(annotations)  # the scores: one more
    reporter = Progress("report", "sections", total=total, unit="sections", enabled=progress)
    manifest = read_manifest(manifest_url, storage_options)
    if annotations:
        from manifests.annotations import read_annotations_meta
        from pipeline.report.annotations import annotations_section
        from pipeline.report.scores import score_parts

        for url in annotations:  # a folder that is not annotations is refused before any figure is drawn
            read_annotations_meta(url, storage_options)
    sections = [manifest_section(manifest, plots)]
    if manifest.meta.frame_ladder is not None:  # a video manifest: frame counts and contact sheets
        from pipeline.report.video import video_part

        part = video_part(manifest, plots, storage_options)
        sections.append(Section(part.title, part.rows, [Figure(*f) for f in part.figures], part.grids))
    reporter.update(1, last="manifest")
    if plan:
        sections.append(plan_section(plan, manifest, plots, storage_options))
        reporter.update(1, last="plan")
    if cache:
        sections.append(cache_section(cache, plots, storage_options))
        reporter.update(1, last="cache")
    for url in annotations:
        rows, grid = annotations_section(url, manifest, storage_options)
        sections.append(Section(f"Annotations: {redact(url)}", rows, [Figure(*f) for f in grid]))
        reporter.update(1, last="annotations")
    if annotations:
        for part in score_parts(annotations, manifest, plots, storage_options):
            sections.append(Section(part.title, part.rows, [Figure(*f) for f in part.figures], part.grids))
        reporter.update(1, last="scores")
    if where or plan:
        from pipeline.report.selection import selection_section

        found = selection_section(manifest, storage_options, plan=plan, annotations=tuple(annotations), where=where)
        if found is not None:
            sections.append(Section(found[0], found[1], [Figure(*f) for f in found[2]]))
    reporter.close()

    fs, html_path = open_url(out, storage_options)
    figures_dir = html_path.rsplit(".", 1)[0] + "_figures"
    written = [html_path]
    for section in sections:
        for fig in section.figures:
            path = join(figures_dir, f"{fig.name}.png")
            write_bytes_atomic(fs, path, fig.png)
            written.append(path)
    title = f"bucketeer report: {redact(manifest_url)}"
    write_bytes_atomic(fs, html_path, render_html(title, sections).encode("utf-8"))
    return written


# ---------------------------------------------------------------- manifest


def _masks_line(samples) -> str:
    """``scan --masks``: how many samples have a loss mask (by alpha channel, by mask file) and how many not."""
    masks = samples["mask"].drop_nulls()
    alpha = int((masks == "alpha").sum())
    return (f"{len(masks)} of {samples.height} samples have one ({alpha} alpha channels, {len(masks) - alpha} mask "
            f"files), {samples.height - len(masks)} without")


def manifest_section(manifest: Manifest, plots) -> Section:
    """Counts, fingerprint and source, and the five manifest figures."""
    stats = manifest_stats(manifest)
    samples = manifest.samples_df()
    counts = stats["counts"]
    spec = manifest.meta.bucket_spec.to_json()
    rows = [
        ("source", redact(manifest.source)),
        ("manifest", redact(manifest.url)),
        ("fingerprint", manifest.fingerprint),
        ("created", manifest.meta.created_at),
        ("counts", ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))),
        ("captions", f"{stats['captioned']} of {counts['samples']} samples have one"),
        *([("loss masks", _masks_line(samples))] if manifest.meta.masks and "mask" in samples.columns else []),
        ("buckets", f"{len(stats['buckets'])} used; spec "
                    + ", ".join(f"{k}={v}" for k, v in sorted(spec.items()) if v is not None and k != "buckets")),
        ("errors", ", ".join(f"{k} {v}" for k, v in stats["errors"].items()) or "none"),
    ]  # fmt: skip
    widths = samples["width"].to_numpy()
    heights = samples["height"].to_numpy()
    captions = samples["caption"].drop_nulls()
    words = captions.str.count_matches(r"\S+").to_numpy() if len(captions) else np.zeros(0, np.int64)
    png = plots.png_bytes
    figures = [
        Figure("buckets", png(plots.bucket_histogram(stats["buckets"])),
               "Every sample lands in exactly one bucket; a batch holds one bucket."),
        Figure("aspect_ratio", png(plots.aspect_ratio_distribution(widths, heights)),
               "Display orientation (after EXIF rotation)."),
        Figure("resolution", png(plots.resolution_distribution(widths, heights)),
               "Points above the diagonal are portrait images.", wide=True),
        Figure("caption_length", png(plots.caption_length_histogram(words, samples.height - len(captions)))),
        Figure("errors", png(plots.error_kinds(stats["errors"])),
               "Files that were listed but cannot be used; none is dropped silently."),
    ]  # fmt: skip
    return Section("Manifest", rows, figures)


# ---------------------------------------------------------------- plan


def _bucket_tokens(name: str, meta_buckets: dict[str, Any]) -> int:
    """Latent tokens of one sample of ``name``: the plan's own figure, else W*H/256 (8x VAE, 2x2 patches)."""
    known = meta_buckets[name].latent_tokens if name in meta_buckets else None
    if known:
        return int(known)
    w, _, h = name.partition("x")
    return int(w) * int(h) // 256


def plan_section(url: str, manifest: Manifest, plots, storage_options: dict[str, Any] | None = None) -> Section:
    """Plan inputs, padding/drop waste per bucket and tokens per step of its first epoch.

    Reads ``_plan.json`` and the first epoch's rows through :func:`manifests.plan.read_plan_rows`
    (PlanError for a folder that is not a committed plan, or a part that is missing or malformed).
    """
    import pyarrow.compute as pc

    from manifests.plan import read_plan_meta, read_plan_rows

    meta = read_plan_meta(url, storage_options)  # refuses a folder that is not a committed plan
    inputs = meta.inputs
    first = meta.epochs[0]
    epoch = first.epoch
    columns = ["step", "rank", "bucket", "sample_ids"]
    table = read_plan_rows(url, [epoch], columns=columns, storage_options=storage_options, meta=meta).table()

    buckets_meta = meta.buckets
    manifest_counts = manifest_stats(manifest)["buckets"]
    sizes = pc.list_value_length(table.column("sample_ids")).to_numpy(zero_copy_only=False).astype(np.int64)  # (rows,)
    bucket_col = np.asarray(table.column("bucket").to_pylist(), dtype=object)  # (rows,)
    names = sorted(set(bucket_col.tolist()) | set(manifest_counts) | set(buckets_meta))
    used, padded, dropped = [], [], []
    for name in names:
        in_bucket = bucket_col == name
        in_rows = table.column("sample_ids").filter(in_bucket)
        ids = pc.list_flatten(in_rows).to_numpy() if in_bucket.any() else np.zeros(0)
        unique = len(np.unique(ids))
        available = buckets_meta[name].samples if name in buckets_meta else int(manifest_counts.get(name, 0))
        used.append(unique)
        padded.append(int(first.padded.get(name, len(ids) - unique)))
        dropped.append(int(first.dropped.get(name, max(available - unique, 0))))

    steps = np.unique(table.column("step").to_numpy()) if table.num_rows else np.zeros(0, np.int64)  # (S,)
    ranks = np.unique(table.column("rank").to_numpy()) if table.num_rows else np.zeros(0, np.int64)  # (R,)
    tokens = np.zeros((len(ranks), len(steps)), np.int64)  # (R, S)
    if table.num_rows:
        per_row = np.array([_bucket_tokens(b, buckets_meta) for b in bucket_col], np.int64) * sizes  # (rows,)
        rank_at = np.searchsorted(ranks, table.column("rank").to_numpy())  # (rows,)
        step_at = np.searchsorted(steps, table.column("step").to_numpy())  # (rows,)
        np.add.at(tokens, (rank_at, step_at), per_row)

    fingerprint_in = inputs.manifest_fingerprint
    mixed = inputs.mix.manifest_fingerprints if inputs.mix else None
    if mixed:  # a mixture: this manifest is one of its datasets, or not
        fingerprint_in = manifest.fingerprint if manifest.fingerprint in mixed else fingerprint_in
    if fingerprint_in is None:
        match = "not recorded"
    elif fingerprint_in == manifest.fingerprint:
        match = "yes"
    else:
        match = f"NO: plan made from {fingerprint_in[:16]}…, this manifest is {manifest.fingerprint[:16]}…"
    total_slots = int(sizes.sum())
    rows = [
        ("plan", redact(url)),
        ("fingerprint", meta.fingerprint),
        ("made from this manifest", match),
        ("inputs", ", ".join(f"{k}={v}" for k, v in sorted(inputs.to_json().items())
                             if not isinstance(v, (dict, list)) and not k.endswith("fingerprint"))),
        ("steps per epoch", str(meta.steps_per_epoch)),
        (f"epoch {epoch}", f"{len(steps)} steps x {len(ranks)} ranks, {total_slots} sample slots, "
                           f"{sum(padded)} padding repeats ({100 * sum(padded) / max(total_slots, 1):.1f}%), "
                           f"{sum(dropped)} dropped"),
    ]  # fmt: skip
    if mixed:
        from pipeline.plan.summary import mix_datasets

        index = mixed.index(manifest.fingerprint) if manifest.fingerprint in mixed else None
        rows.append(("mixture", f"this manifest is dataset {index} of {len(mixed)}" if index is not None
                     else f"{len(mixed)} datasets; this manifest is none of them"))  # fmt: skip
        for d, line, per_bucket in mix_datasets(meta):
            rows += [(f"dataset {d}", line), ("", per_bucket)]
    tps = meta.tokens_per_step
    if tps is not None:
        rows.append(("tokens per step and rank", ", ".join(f"{k} {v}" for k, v in tps.to_json().items())))
    figures = [
        Figure("plan_waste", plots.png_bytes(plots.plan_waste(names, used, padded, dropped)),
               "Padding repeats samples so every rank has equal steps; drops are leftovers of the leftover policy."),
        Figure("tokens_per_step", plots.png_bytes(plots.tokens_per_step(steps, tokens)),
               "Per-rank work per step: big spreads mean ranks wait on each other."),
    ]  # fmt: skip
    return Section("Plan", rows, figures)


# ---------------------------------------------------------------- cache


def cache_section(url: str, plots, storage_options: dict[str, Any] | None = None) -> Section:
    """Record counts, bytes per sample, settings and errors of a cache (via ``_cache.json`` and its index).

    The index is read through :func:`manifests.cache.read_index`: superseded rows (a sample embedded
    again after its image changed, or after a read failure) are not counted.
    """
    from manifests.cache import read_cache_meta, read_index

    meta = read_cache_meta(url, storage_options)  # refuses a folder that is not a bucketeer cache
    counts = meta.counts.to_json()
    records = meta.counts.samples
    index = read_index(url, storage_options, meta)
    lengths = index["samples"].column("length").to_numpy()
    sample_bytes = int(lengths.sum())  # of the live records (the index names their shards)
    shards = pc.count_distinct(index["samples"].column("shard")).as_py()
    errors = index["errors"].column("error").to_pylist()
    kinds = {str(k): int(n) for k, n in zip(*np.unique(errors, return_counts=True))} if errors else {}
    settings = meta.settings.hashed
    rows = [
        ("cache", redact(url)),
        ("fingerprint", meta.fingerprint),
        ("records", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "?"),
        ("bytes per sample", f"{sample_bytes / records / 1024:.1f} KiB ({shards} shard objects)"
                             if records else "n/a"),
        ("settings", ", ".join(f"{k}={redact(str(v))}" for k, v in sorted(settings.items())
                               if not isinstance(v, (dict, list)))),
        ("errors", ", ".join(f"{k} {n}" for k, n in kinds.items()) or "none"),
    ]  # fmt: skip
    figures = [
        Figure("cache_record_sizes", plots.png_bytes(plots.cache_record_sizes(lengths))),
        Figure("cache_errors", plots.png_bytes(plots.error_kinds(kinds, "Cache: errors by kind")),
               "Images whose full decode or encode failed during embed."),
    ]  # fmt: skip
    return Section("Cache", rows, figures)


# ---------------------------------------------------------------- HTML

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1d2330;
       background: #f5f6f8; }
header { background: #1d2330; color: #fff; padding: 18px 32px; }
header h1 { margin: 0; font-size: 20px; } header p { margin: 4px 0 0; color: #b8bfcc; font-size: 12px; }
main { padding: 8px 32px 32px; }
section { margin-top: 24px; } h2 { font-size: 17px; border-bottom: 2px solid #3b6fb6; padding-bottom: 4px; }
table { border-collapse: collapse; background: #fff; width: 100%; box-shadow: 0 1px 2px rgba(0,0,0,.08); }
td { padding: 5px 10px; border-bottom: 1px solid #e6e8ec; vertical-align: top; word-break: break-all; }
td:first-child { font-weight: 600; white-space: nowrap; width: 1%; color: #4a5263; word-break: normal; }
.figures { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 16px; margin-top: 16px; }
figure { margin: 0; background: #fff; padding: 10px; box-shadow: 0 1px 2px rgba(0,0,0,.08); }
figure.wide { grid-column: 1 / -1; }
figure img { width: 100%; height: auto; display: block; }
figcaption { font-size: 12px; color: #5b6374; margin-top: 6px; }
""" + GRID_CSS


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def render_html(title: str, sections: list[Section]) -> str:
    """The page: inline CSS, one table and a grid of embedded figures per section."""
    esc = html.escape
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    out = io.StringIO()
    out.write(f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>')
    out.write('<meta name="viewport" content="width=device-width, initial-scale=1">')
    out.write(f"<style>{_CSS}</style></head><body>")
    out.write(f"<header><h1>{esc(title)}</h1><p>written {esc(now)} by bucketeer report</p></header><main>")
    for section in sections:
        out.write(f"<section><h2>{esc(section.title)}</h2><table>")
        for label, value in section.rows:
            out.write(f"<tr><td>{esc(label)}</td><td>{esc(value)}</td></tr>")
        out.write('</table><div class="figures">')
        for fig in section.figures:
            wide = ' class="wide"' if fig.wide else ""
            out.write(f'<figure id="fig-{esc(fig.name)}"{wide}><img alt="{esc(fig.name)}" src="{_data_uri(fig.png)}">')
            if fig.note:
                out.write(f"<figcaption>{esc(fig.note)}</figcaption>")
            out.write("</figure>")
        out.write("</div>")
        for grid in section.grids:
            out.write(grid_html(grid))
        out.write("</section>")
    out.write("</main></body></html>\n")
    return out.getvalue()

