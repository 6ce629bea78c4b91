"""The report's score and duplicate sections, from annotations folders (``--annotations A,B``).

    bucketeer report MANIFEST --annotations SCORES,DUPLICATES --out report.html

What is drawn is what the folders hold, found from their parts' schema (no rows read for it):

- every float column (``aesthetic``, ``safety``, ``luminance``, ...): a histogram over its range, and
  thumbnail grids of the :data:`EXTREMES` lowest and highest scored samples (ties by sample id);
- every bool column (``grayscale``, ``duplicate``): counts of true, false and no value;
- ``cluster_id`` with ``keeper_id`` (``bucketeer dedup``): grids of the :data:`CLUSTERS` largest
  clusters of two or more samples, the keeper first, then the others by similarity to it.

Several folders are joined on ``sample_id`` (a column held by two folders is taken from the first
named); only the columns drawn are read (never the embeddings), as Arrow and numpy arrays, and only
the samples shown have their images read. Samples not in this manifest are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests.annotations import read_annotations, read_annotations_meta
from manifests.manifest import Manifest
from manifests.storage import redact
from pipeline.report.annotations import part_columns
from pipeline.report.thumbs import GRID_PIXELS, Thumb, ThumbGrid, thumbnails

__all__ = ["EXTREMES", "CLUSTERS", "CLUSTER_THUMBS", "ReportPart", "read_scores", "score_bins", "extremes",
           "largest_clusters", "score_parts"]  # fmt: skip

EXTREMES = 8  # thumbnails of the lowest and of the highest scored samples, per score
CLUSTERS = 6  # duplicate clusters shown, largest first
CLUSTER_THUMBS = 8  # thumbnails per cluster shown, keeper first
BINS = 40
DEDUP_COLUMNS = ("duplicate", "cluster_id", "keeper_id", "similarity")
_NOT_SCORES = ("written_at", "source_key", "similarity")  # a key column; similarity is shown in the cluster grids


@dataclass(frozen=True)
class ReportPart:
    """One section of the page: summary rows, figures ``(name, png, note)`` and thumbnail grids."""

    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)
    figures: list[tuple[str, bytes, str]] = field(default_factory=list)
    grids: list[ThumbGrid] = field(default_factory=list)


def _wanted(name: str, kind: pa.DataType) -> bool:
    return name in DEDUP_COLUMNS or (
        (pa.types.is_floating(kind) or pa.types.is_boolean(kind)) and name not in _NOT_SCORES
    )


def read_scores(urls: Sequence[str], manifest: Manifest, storage_options: dict[str, Any] | None = None
                ) -> tuple[pa.Table | None, dict[str, str]]:  # fmt: skip
    """``sample_id`` and the score and dedup columns of annotations folders ``urls``, joined on
    ``sample_id`` (full outer), only samples of ``manifest``; and ``column -> folder`` it came from.
    None when no folder holds such a column."""
    joined: pa.Table | None = None
    origin: dict[str, str] = {}
    for url in urls:
        meta = read_annotations_meta(url, storage_options)
        wanted = [c for c, kind in part_columns(url, meta, storage_options).items()
                  if c not in origin and _wanted(c, kind)]  # fmt: skip
        if not wanted:
            continue
        _, rows, _ = read_annotations(url, storage_options, columns=wanted)
        table = rows.select(["sample_id", *[c for c in wanted if c in rows.column_names]])
        origin.update({c: url for c in table.column_names[1:]})
        joined = table if joined is None else joined.join(table, "sample_id", join_type="full outer")
    if joined is None:
        return None, {}
    in_manifest = pc.is_in(joined.column("sample_id"), value_set=manifest.samples.column("sample_id"))
    return joined.filter(in_manifest), origin


def _floats(table: pa.Table, name: str) -> np.ndarray:
    """(n,) float64, NaN where there is no value."""
    column = pc.fill_null(table.column(name).cast(pa.float64()), float("nan"))
    return column.to_numpy()


def score_bins(values: np.ndarray, bins: int = BINS) -> tuple[np.ndarray, np.ndarray, int]:
    """Histogram of the non-NaN ``values`` over their range: ``(edges (bins+1,), counts (bins,), missing)``."""
    present = values[~np.isnan(values)]
    if len(present) == 0:
        return np.array([0.0, 1.0]), np.zeros(1, np.int64), len(values)
    lo, hi = float(present.min()), float(present.max())
    span = (lo, hi) if hi > lo else (lo - 0.5, hi + 0.5)
    counts, edges = np.histogram(present, bins=bins, range=span)
    return edges, counts, len(values) - len(present)


def extremes(ids: np.ndarray, values: np.ndarray, k: int = EXTREMES) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the ``k`` lowest (ascending) and ``k`` highest (descending) non-NaN ``values``,
    ties by ascending ``ids``. A partition first: a sort of only the candidates, not of every sample."""
    scored = np.flatnonzero(~np.isnan(values))  # (m,)
    v, i = values[scored], ids[scored]
    k = min(k, len(scored))
    if k == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    low_cut = np.partition(v, k - 1)[k - 1]
    high_cut = np.partition(v, len(v) - k)[len(v) - k]
    low = np.flatnonzero(v <= low_cut)  # (>= k,) with ties at the cut
    high = np.flatnonzero(v >= high_cut)
    low = low[np.lexsort((i[low], v[low]))][:k]
    high = high[np.lexsort((i[high], -v[high]))][:k]
    return scored[low], scored[high]


def largest_clusters(table: pa.Table, n: int = CLUSTERS, per_cluster: int = CLUSTER_THUMBS
                     ) -> tuple[list[tuple[int, int, list[tuple[int, str]]]], dict[str, int]]:  # fmt: skip
    """The ``n`` largest clusters of two or more samples (ties by cluster id) as ``(cluster_id, size,
    [(sample_id, detail), ...])``, the keeper first (detail ``keeper``), then the others by descending
    similarity (``similarity 0.987``), at most ``per_cluster``; and the totals ``clusters``,
    ``duplicates`` (rows marked duplicate, or clustered and not the keeper), ``largest``."""
    has = table.column_names
    rows = table.filter(pc.is_valid(table.column("cluster_id")))
    sizes = rows.group_by("cluster_id").aggregate([("sample_id", "count")])
    sizes = sizes.filter(pc.greater(sizes.column("sample_id_count"), 1))
    top = sizes.sort_by([("sample_id_count", "descending"), ("cluster_id", "ascending")]).slice(0, n)
    members = rows.filter(pc.is_in(rows.column("cluster_id"), value_set=sizes.column("cluster_id")))
    if "duplicate" in has:
        duplicates = int(pc.sum(pc.fill_null(table.column("duplicate"), False).cast(pa.int64())).as_py() or 0)
    else:
        duplicates = members.num_rows - sizes.num_rows
    totals = {"clusters": sizes.num_rows, "duplicates": duplicates,
              "largest": int(top.column("sample_id_count")[0].as_py()) if top.num_rows else 0}  # fmt: skip
    members = members.filter(pc.is_in(members.column("cluster_id"), value_set=top.column("cluster_id")))
    cluster = members.column("cluster_id").to_numpy()  # (m,)
    ids = members.column("sample_id").to_numpy()
    keeper = (pc.fill_null(pc.equal(members.column("keeper_id"), members.column("sample_id")), False).to_numpy()
              if "keeper_id" in has else np.zeros(len(ids), bool))  # fmt: skip
    similarity = _floats(members, "similarity") if "similarity" in has else np.full(len(ids), np.nan)
    out = []
    for cid, size in zip(top.column("cluster_id").to_pylist(), top.column("sample_id_count").to_pylist()):
        at = np.flatnonzero(cluster == cid)  # (size,)
        order = np.lexsort((ids[at], -np.nan_to_num(similarity[at], nan=-np.inf), ~keeper[at]))[:per_cluster]
        shown = [(int(ids[j]), "keeper" if keeper[j] else
                  f"similarity {similarity[j]:.3f}" if not np.isnan(similarity[j]) else "similarity ?")
                 for j in at[order]]  # fmt: skip
        out.append((int(cid), int(size), shown))
    return out, totals


def _with_thumbnails(specs: list[tuple[str, str, list[tuple[int, str]]]], manifest: Manifest,
                     storage_options: dict[str, Any] | None) -> list[ThumbGrid]:  # fmt: skip
    """Grids ``(name, title, [(sample_id, detail)])`` with their thumbnails, each image read once."""
    wanted = sorted({sid for _, _, items in specs for sid, _ in items})
    samples = manifest.samples
    picked = samples.filter(pc.is_in(samples.column("sample_id"), value_set=pa.array(wanted, pa.uint64())))
    rows = {r["sample_id"]: r for r in picked.to_pylist()}
    listed = [rows[s] for s in wanted if s in rows]
    images = dict(zip([r["sample_id"] for r in listed],
                      thumbnails(manifest, listed, storage_options, size=GRID_PIXELS, image_format="JPEG")))
    return [ThumbGrid(name, title, [Thumb(sid, rows[sid]["filename"] if sid in rows else str(sid), detail,
                                          images.get(sid)) for sid, detail in items])
            for name, title, items in specs]  # fmt: skip


def _value(v: float) -> str:
    return f"{v:.4g}"


def score_parts(urls: Sequence[str], manifest: Manifest, plots, storage_options: dict[str, Any] | None = None
                ) -> list[ReportPart]:  # fmt: skip
    """The ``Scores`` part (histograms, bool counts, lowest and highest grids) and the ``Duplicates``
    part (largest clusters) of annotations folders ``urls``; none for folders without such columns."""
    table, origin = read_scores(urls, manifest, storage_options)
    if table is None:
        return []
    total = manifest.samples.num_rows
    ids = table.column("sample_id").to_numpy()  # (n,)
    schema = table.schema
    sources = [u for u in urls if u in origin.values()]  # the folders that hold a column drawn here
    several = len(sources) > 1
    scores = ReportPart(f"Scores: {', '.join(redact(u) for u in sources)}")
    specs: list[tuple[str, str, list[tuple[int, str]]]] = []
    for name in table.column_names[1:]:
        kind = schema.field(name).type
        where = f" (from {redact(origin[name])})" if several else ""
        if pa.types.is_boolean(kind):
            column = table.column(name)
            true = int(pc.sum(pc.fill_null(column, False).cast(pa.int64())).as_py() or 0)
            false = int(pc.sum(pc.fill_null(pc.invert(column), False).cast(pa.int64())).as_py() or 0)
            counts = {"true": true, "false": false, "no value": total - true - false}
            text = f"true {true:,}, false {false:,}, no value {total - true - false:,} (of {total:,} samples)"
            scores.rows.append((name, text + where))
            png = plots.png_bytes(plots.value_counts(name, counts))
            scores.figures.append((f"score_{name}", png, f"{name}: {text}"))
        elif pa.types.is_floating(kind) and name not in _NOT_SCORES:
            values = _floats(table, name)  # (n,)
            edges, counts, _ = score_bins(values)
            scored = int(counts.sum())
            if scored:
                text = (f"{scored:,} of {total:,} samples scored, range {_value(np.nanmin(values))} to "
                        f"{_value(np.nanmax(values))}, median {_value(np.nanmedian(values))}")  # fmt: skip
            else:
                text = f"0 of {total:,} samples scored"
            scores.rows.append((name, text + where))
            png = plots.png_bytes(plots.score_histogram(name, edges, counts, total - scored))
            scores.figures.append((f"score_{name}", png, f"{name}: {text}"))
            low, high = extremes(ids, values)
            for end, at in (("lowest", low), ("highest", high)):
                if len(at):
                    items = [(int(ids[j]), f"{name} {_value(values[j])}") for j in at]
                    specs.append((f"{name}-{end}", f"{name}: the {len(at)} {end}", items))
    parts = [scores] if scores.rows else []
    score_grids = len(specs)
    if "cluster_id" in table.column_names:
        clusters, totals = largest_clusters(table)
        duplicates = ReportPart(f"Duplicates: {redact(origin['cluster_id'])}", [
            ("duplicates", f"{totals['duplicates']:,} of {total:,} samples are duplicates, in {totals['clusters']:,} "
                           f"clusters of 2 or more samples; the largest has {totals['largest']:,}"),
            ("shown", f"the {len(clusters)} largest clusters, keeper first (outlined), then by similarity to it"),
        ])  # fmt: skip
        parts.append(duplicates)
        for rank, (cid, size, items) in enumerate(clusters):
            more = f", the first {len(items)} shown" if size > len(items) else ""
            specs.append((f"cluster-{rank}", f"cluster {cid}: {size} samples{more}", items))
    grids = _with_thumbnails(specs, manifest, storage_options)  # every image read once, for both parts
    scores.grids.extend(grids[:score_grids])
    if len(grids) > score_grids:
        parts[-1].grids.extend(grids[score_grids:])
    return parts
