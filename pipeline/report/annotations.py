"""The report's annotations section: what made them, the counts, and a grid of sample thumbnails with
their original and generated captions (``bucketeer report MANIFEST --annotations ANNOTATIONS``).

Thumbnails are read as embed and annotate read images (:func:`pipeline.report.thumbs.thumbnails`),
downscaled to :data:`THUMB_PIXELS` on the long side; the samples shown are the first
:data:`GRID_SAMPLES` of the manifest, in sample id order, that have a generated caption. Only the
``caption`` column is read (a folder may also hold embeddings and scores: :mod:`pipeline.report.scores`).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from manifests.annotations import AnnotationsMeta, read_annotations, read_annotations_meta
from manifests.manifest import Manifest
from manifests.storage import join, open_url
from pipeline.report.thumbs import THUMB_PIXELS, thumbnails

__all__ = ["GRID_SAMPLES", "THUMB_PIXELS", "annotations_section", "part_columns"]

GRID_SAMPLES = 12


def part_columns(url: str, meta: AnnotationsMeta, storage_options: dict[str, Any] | None) -> dict[str, pa.DataType]:
    """``column -> type`` of the folder's parts, from the first part's parquet footer (no rows read);
    empty when it names no part."""
    if not meta.parts:
        return {}
    fs, root = open_url(url, storage_options)
    with fs.open(join(root, "parts", meta.parts[0]), "rb") as f:
        schema = pq.read_schema(f)
    return {f.name: f.type for f in schema}


def annotations_section(url: str, manifest: Manifest, storage_options: dict[str, Any] | None = None
                        ) -> tuple[list[tuple[str, str]], list[tuple[str, bytes, str]]]:  # fmt: skip
    """What the report shows of annotations folder ``url`` made from ``manifest``: its summary rows
    ``(label, value)`` (settings, counts) and the caption grid as figures ``(name, png, note)``."""
    meta = read_annotations_meta(url, storage_options)
    summary: list[tuple[str, str]] = []
    figures: list[tuple[str, bytes, str]] = []
    summary += [("engine", meta.engine), ("settings fingerprint", meta.settings_fingerprint),
                     ("annotated", f"{meta.counts.annotated:,} of {meta.counts.samples:,} samples"),
                     ("errors", f"{meta.counts.errors:,}"),
                     ("made from this manifest", "yes" if meta.manifest_fingerprint == manifest.fingerprint
                      else "no: another version of it (a rescan since)")]  # fmt: skip
    for task in meta.tasks:
        text = f"model {task.model}, weights sha256 {task.weight_sha256[:12]}…"
        text += f", max {task.max_new_tokens} new tokens" if task.max_new_tokens is not None else ""
        text += f"; prompt: {task.prompt}" if task.prompt is not None else ""
        summary.append((f"task {task.task}", text))
    if "caption" not in part_columns(url, meta, storage_options):
        return summary, figures
    _, rows, _ = read_annotations(url, storage_options, columns=["caption"])  # not the embeddings a folder may hold
    if rows.num_rows == 0:
        return summary, figures
    samples = manifest.samples
    shown = samples.filter(pc.is_in(samples.column("sample_id"), value_set=rows.column("sample_id")))
    shown = shown.sort_by("sample_id").slice(0, GRID_SAMPLES)
    generated = dict(zip(rows.column("sample_id").to_pylist(), rows.column("caption").to_pylist()))
    listed = shown.to_pylist()
    for i, (row, png) in enumerate(zip(listed, thumbnails(manifest, listed, storage_options))):
        if png is None:
            continue
        originals = [c for c in (row.get("captions") or [row.get("caption")]) if c and c != generated[row["sample_id"]]]
        note = (f"{row['filename']} | original: {' / '.join(originals) if originals else '(none)'} | "
                f"generated: {generated[row['sample_id']]}")  # fmt: skip
        figures.append((f"caption-{i:02d}", png, note))
    return summary, figures
