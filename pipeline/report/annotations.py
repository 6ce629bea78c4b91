"""The report's annotations section: what made them, the counts, and a grid of sample thumbnails with
their original and generated captions (``bucketeer report MANIFEST --annotations ANNOTATIONS``).

Thumbnails are read as embed and annotate read images (one read each: loose file, tar member, parquet
row), decoded upright and downscaled to :data:`THUMB_PIXELS` on the long side; the samples shown are
the first :data:`GRID_SAMPLES` of the manifest, in sample id order, that have a generated caption.
"""

from __future__ import annotations

import io
from typing import Any

import pyarrow.compute as pc

from manifests.annotations import read_annotations
from manifests.manifest import Manifest
from manifests.schema import MAX_PIXELS
from manifests.storage import open_url

__all__ = ["GRID_SAMPLES", "THUMB_PIXELS", "annotations_section"]

GRID_SAMPLES = 12
THUMB_PIXELS = 192


def _thumbnails(manifest: Manifest, rows: list[dict], storage_options: dict[str, Any] | None) -> list[bytes | None]:
    """PNG thumbnails of ``rows`` (manifest rows), None where an image cannot be read or decoded."""
    from pipeline.annotate.workers import decode_for_caption
    from pipeline.embed.imaging import ImageFailure, fetch_images
    from pipeline.embed.job import image_column

    fs, root = open_url(manifest.source, storage_options)
    blobs = fetch_images(fs, root, rows, image_column=image_column(manifest.meta))
    out: list[bytes | None] = []
    for row, blob in zip(rows, blobs):
        try:
            if isinstance(blob, BaseException):
                raise ImageFailure("read_failed", str(blob))
            image = decode_for_caption(blob, row["width"], row["height"], THUMB_PIXELS,
                                       int(manifest.max_pixels or MAX_PIXELS), row["filename"])  # fmt: skip
        except ImageFailure:
            out.append(None)
            continue
        buf = io.BytesIO()
        image.save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def annotations_section(url: str, manifest: Manifest, storage_options: dict[str, Any] | None = None
                        ) -> tuple[list[tuple[str, str]], list[tuple[str, bytes, str]]]:  # fmt: skip
    """What the report shows of annotations folder ``url`` made from ``manifest``: its summary rows
    ``(label, value)`` (settings, counts) and the caption grid as figures ``(name, png, note)``."""
    meta, rows, _ = read_annotations(url, storage_options)
    summary: list[tuple[str, str]] = []
    figures: list[tuple[str, bytes, str]] = []
    summary += [("engine", meta.engine), ("settings fingerprint", meta.settings_fingerprint),
                     ("annotated", f"{meta.counts.annotated:,} of {meta.counts.samples:,} samples"),
                     ("errors", f"{meta.counts.errors:,}"),
                     ("made from this manifest", "yes" if meta.manifest_fingerprint == manifest.fingerprint
                      else "no: another version of it (a rescan since)")]  # fmt: skip
    for task in meta.tasks:
        summary.append((f"task {task.task}", f"model {task.model}, weights sha256 {task.weight_sha256[:12]}…, "
                                                  f"max {task.max_new_tokens} new tokens; prompt: {task.prompt}"))
    if "caption" not in rows.column_names or rows.num_rows == 0:
        return summary, figures
    samples = manifest.samples
    shown = samples.filter(pc.is_in(samples.column("sample_id"), value_set=rows.column("sample_id")))
    shown = shown.sort_by("sample_id").slice(0, GRID_SAMPLES)
    generated = dict(zip(rows.column("sample_id").to_pylist(), rows.column("caption").to_pylist()))
    listed = shown.to_pylist()
    for i, (row, png) in enumerate(zip(listed, _thumbnails(manifest, listed, storage_options))):
        if png is None:
            continue
        originals = [c for c in (row.get("captions") or [row.get("caption")]) if c and c != generated[row["sample_id"]]]
        note = (f"{row['filename']} | original: {' / '.join(originals) if originals else '(none)'} | "
                f"generated: {generated[row['sample_id']]}")  # fmt: skip
        figures.append((f"caption-{i:02d}", png, note))
    return summary, figures
