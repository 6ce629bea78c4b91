"""The report's selection section: what a ``--where`` kept and dropped of the manifest, per bucket, and a grid of
thumbnails of a few dropped samples with the values that dropped them.

    bucketeer report MANIFEST --plan PLAN --out report.html                       # the plan's own selection
    bucketeer report MANIFEST --annotations SCORES,DUPS --where "aesthetic > 5" --out report.html

The selection is :func:`manifests.select.evaluate`, the one ``bucketeer plan --where`` uses; the samples shown
are the first :data:`DROPPED_SHOWN` dropped ones in sample id order.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from manifests.manifest import Manifest
from manifests.select import annotation_sources, evaluate, read_columns
from manifests.storage import redact

__all__ = ["DROPPED_SHOWN", "selection_section"]

DROPPED_SHOWN = 8
_BUCKET_ROWS = 24


def _recorded(plan: str, manifest: Manifest, storage_options: dict[str, Any] | None
              ) -> tuple[str | None, str | None, tuple[str, ...]] | None:  # fmt: skip
    """The plan's ``(where, weight_by, annotations URLs)``; None for a plan without a selection."""
    from manifests.plan import read_plan_meta

    meta = read_plan_meta(plan, storage_options)
    if meta.selection is None:
        return None
    return meta.selection.where, meta.selection.weight_by, tuple(a.url for a in meta.selection.annotations)


def selection_section(manifest: Manifest, storage_options: dict[str, Any] | None = None, *, plan: str | None = None,
                      annotations: Sequence[str] = (), where: str | None = None
                      ) -> tuple[str, list[tuple[str, str]], list[tuple[str, bytes, str]]] | None:  # fmt: skip
    """``(title, rows, figures)`` of the selection ``where`` over ``annotations`` (else the one ``plan`` recorded,
    over the annotations it recorded); None when there is none. Figures: ``(name, png,
    note)``. Raises UsageError like :func:`manifests.select.evaluate`."""
    weight_by = None
    title = "Selection (--where)"
    if where is None and plan is not None:
        recorded = _recorded(plan, manifest, storage_options)
        if recorded is None:
            return None
        where, weight_by, annotations = recorded  # the plan's own (--annotations may be a caption folder)
        title = f"Selection of plan {redact(plan)}"
    if where is None and weight_by is None:
        return None
    sources = [s for s in annotation_sources(annotations, storage_options)]
    if plan is not None and len({s.manifest_fingerprint for s in sources}) > 1:  # a mixture: this manifest's own
        sources = [s for s in sources if s.manifest_fingerprint == manifest.fingerprint]
    evaluation = evaluate([manifest], sources, where, weight_by, storage_options)
    sel = evaluation.selections[0]
    rows = [("where", where or "(all)")]
    if weight_by:
        rows.append(("weight by", weight_by))
    rows += [(f"annotations {i}", f"{redact(s.url)} (fingerprint {s.fingerprint})") for i, s in enumerate(sources)]
    rows.append(("kept", f"{sel.kept:,} of {len(sel.keep):,} samples ({100 * sel.kept / max(len(sel.keep), 1):.1f}%),"
                         f" {sel.dropped:,} dropped"))  # fmt: skip
    per_bucket = sorted(sel.per_bucket().items(), key=lambda kv: -sum(kv[1]))
    for name, (kept, dropped) in per_bucket[:_BUCKET_ROWS]:
        rows.append((f"bucket {name}", f"kept {kept:,}, dropped {dropped:,}"))
    if len(per_bucket) > _BUCKET_ROWS:
        rest = per_bucket[_BUCKET_ROWS:]
        rows.append((f"{len(rest)} more buckets", f"kept {sum(k for _, (k, _) in rest):,}, dropped "
                                                  f"{sum(d for _, (_, d) in rest):,}"))  # fmt: skip
    return title, rows, _dropped_grid(manifest, sources, sel, evaluation.columns, storage_options)


def _dropped_grid(manifest: Manifest, sources: Sequence[Any], sel: Any, columns: Sequence[str],
                  storage_options: dict[str, Any] | None) -> list[tuple[str, bytes, str]]:  # fmt: skip
    """Thumbnails of the first dropped samples (by id), each with the values of the columns the filter reads."""
    from pipeline.report.thumbs import thumbnails  # the report's one thumbnail reader

    dropped = np.flatnonzero(~sel.keep)
    if not len(dropped):
        return []
    shown = dropped[np.argsort(sel.sample_ids[dropped], kind="stable")][:DROPPED_SHOWN]
    values = read_columns(manifest, sources, list(columns), storage_options)[shown.tolist()] if columns else None
    listed = manifest.samples.take(shown).to_pylist()
    figures = []
    for i, (row, png) in enumerate(zip(listed, thumbnails(manifest, listed, storage_options))):
        if png is None:
            continue
        shown_values = ", ".join(f"{c} {values[c][i]}" for c in columns) if values is not None else ""
        figures.append((f"dropped-{i:02d}", png, f"dropped: {row['filename']}" + (f" | {shown_values}" if shown_values
                                                                                     else "")))  # fmt: skip
    return figures
