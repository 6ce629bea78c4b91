"""Incremental rescans: what changed since the previous manifest.

:func:`plan_rescan` compares a :class:`~pipeline.sources.listing.Listing` with the previous manifest:
unchanged files (same size and ETag, or mtime where the store has no ETag) keep their rows and are not
read, and their sidecar captions are read again exactly when the listed sidecar differs from the one
each row's ``caption_source`` records (no timestamps are compared with any clock). An image with
numbered sidecars (:func:`~pipeline.sources.listing.image_sidecars`) has several captions; all of them
are read again when any one of them changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from manifests.manifest import Manifest, ManifestError, conform, read_manifest
from manifests.schema import ERRORS_SCHEMA, VIDEO_COLUMNS
from manifests.storage import redact
from pipeline.sources.captions import CaptionTable
from pipeline.sources.listing import IMAGE_SCHEMA, FileEntry, Listing, WorkItem, image_sidecars

__all__ = [
    "RescanPlan", "plan_rescan", "reusable_videos", "reusable_container_videos", "VIDEO_PROBED", "previous_manifest",
    "unchanged", "caption_source", "sidecar_version", "sidecars_version",
]  # fmt: skip



@dataclass
class RescanPlan:
    work: list[WorkItem]  # files to read, by name
    reused_images: pa.Table  # IMAGE_SCHEMA rows of unchanged files, caption as before
    reused_errors: pa.Table  # ERRORS_SCHEMA rows of unchanged broken files
    kept_captions: set[str]  # reused rows read from exactly the sidecar version still listed
    reused: int = 0
    new: int = 0
    changed: int = 0
    deleted: int = 0
    previous: str | None = None


def sidecar_version(entry: FileEntry) -> str:
    """``caption_source`` of a caption read from sidecar ``entry`` (format in manifests/schema.py)."""
    version = entry.etag or (repr(entry.mtime) if entry.mtime is not None else "?")
    return f"sidecar:{entry.size}:{version}:{entry.name}"


def sidecars_version(entries: list[FileEntry]) -> str | None:
    """``caption_source`` of captions read from ``entries`` (one sidecar, or numbered ones), None for none."""
    if len(entries) <= 1:
        return sidecar_version(entries[0]) if entries else None
    return "sidecars:" + "|".join(sidecar_version(e) for e in entries)


def caption_source(listing: Listing, name: str, table: CaptionTable | None) -> str | None:
    """``caption_source`` of image ``name`` now: the caption table's row, else its sidecar(s), else None."""
    if table is not None and name in table.captions:
        return f"table:{table.version}"
    return sidecars_version(image_sidecars(listing, name))


def unchanged(entry: FileEntry, size: int | None, etag: str | None, mtime: float | None) -> bool:
    """Whether a listed object is the one recorded with ``size`` and ``etag`` (``mtime`` where the store has none)."""
    if size != entry.size:
        return False
    if entry.etag and etag:
        return entry.etag == etag
    return entry.mtime is not None and mtime is not None and entry.mtime == mtime


def previous_manifest(out: str, previous: str | None, storage_options: dict[str, Any] | None) -> Manifest | None:
    """The manifest a rescan reuses rows from: ``previous``, else the one committed at ``out``, else None.

    Raises ManifestError when ``previous`` was named and cannot be read.
    """
    try:
        return read_manifest(previous or out, storage_options)
    except ManifestError:
        if previous:
            raise
        return None


def plan_rescan(
    listing: Listing,
    out: str,
    previous: str | None,
    storage_options: dict[str, Any] | None,
    max_pixels: int,
    table: CaptionTable | None,
) -> RescanPlan:
    """Split the listed images into rows to reuse from the previous manifest and files to read.

    The previous manifest is ``previous`` or, when absent, a committed one at ``out``. Error rows
    of kind ``read_failed`` are always re-read, ``too_many_pixels`` when ``--max-pixels`` changed.
    A reused row's sidecar is read again exactly when its ``caption_source`` differs from the
    sidecar listed now (new, rewritten, or another sidecar wins), or was unknown (null: an older
    manifest, or a failed read). Table captions need no read: the table is in memory.
    """
    old = previous_manifest(out, previous, storage_options)
    entries = {e.name: e for e in listing.images}
    empty = RescanPlan([], IMAGE_SCHEMA.empty_table(), ERRORS_SCHEMA.empty_table(), set())
    if old is None:
        empty.work = [item for e in listing.images for item in _work(listing, e, True, table)]
        empty.new = len(listing.images)
        return empty

    # a mixed folder's tar rows are the shards' scan's to reuse (pipeline/sources/containers.py)
    old_samples = old.samples.filter(pc.is_null(old.samples.column("container")))
    old_errors = old.errors.filter(pc.is_null(old.errors.column("container")))
    # a video manifest's (scan --frames) video rows are not images; its images' video columns are the video scan's
    old_samples, old_errors = _images_only(old_samples), _images_only(old_errors)
    small = pc.equal(old_errors.column("error"), "too_small")
    images = pa.concat_tables([conform(old_samples, IMAGE_SCHEMA), conform(old_errors.filter(small), IMAGE_SCHEMA)])
    # link errors come from the listing each time, never from the previous manifest
    redo = {"read_failed", "broken_link", "link_loop"}
    redo |= {"too_many_pixels"} if old.max_pixels != max_pixels else set()
    errors = old_errors.filter(pc.invert(small))
    errors = errors.filter(pc.invert(pc.is_in(errors.column("error"), pa.array(sorted(redo)))))
    redo_names = set(old_errors.column("filename").to_pylist()) - set(errors.column("filename").to_pylist())
    redo_names -= set(images.column("filename").to_pylist())

    plan = RescanPlan([], images, errors, set(), previous=redact(previous or out))
    seen: set[str] = set()
    keep_image, keep_error = [], []
    for tab, keep in ((images, keep_image), (errors, keep_error)):
        cols = tab.select(["filename", "size", "etag", "mtime", "caption_source"]).to_pydict()
        for i, name in enumerate(cols["filename"]):
            entry = entries.get(name)
            if entry is None or not unchanged(entry, cols["size"][i], cols["etag"][i], cols["mtime"][i]):
                keep.append(False)
                continue
            keep.append(True)
            seen.add(name)
            sidecars = _sidecars(listing, name, table)
            if not sidecars:
                continue  # the table's caption, or none: known without reading anything
            versioned = all(e.etag is not None or e.mtime is not None for e in sidecars)
            if versioned and cols["caption_source"][i] == sidecars_version(sidecars):
                plan.kept_captions.add(name)
            else:
                plan.work += _work(listing, entry, False, table)
    plan.reused_images = images.filter(pa.array(keep_image, pa.bool_()))
    plan.reused_errors = errors.filter(pa.array(keep_error, pa.bool_()))
    previous_names = set(images.column("filename").to_pylist()) | set(errors.column("filename").to_pylist())
    previous_names |= redo_names
    for e in listing.images:
        if e.name not in seen:
            plan.work += _work(listing, e, True, table)
            if e.name in previous_names:
                plan.changed += 1
            else:
                plan.new += 1
    plan.reused = len(seen)
    plan.deleted = len(previous_names - set(entries) - {name for name, _, _ in listing.link_errors})
    plan.work.sort()
    return plan


# what a video's probe found (pipeline/sources/video.py), kept in its manifest row: a rescan reuses them
VIDEO_PROBED = ("width", "height", "frames", "fps", "duration", "codec", "format", "frame_count_from")
_VIDEO_CONTENT_ERRORS = ("empty", "not_a_video", "invalid_header")  # the bytes' verdict: the same bytes, the same


def reusable_videos(listing: Listing, old: Manifest | None) -> dict[str, dict[str, Any]]:
    """The loose video rows of the previous manifest ``old`` (:func:`previous_manifest`) whose file is listed
    unchanged (same size and ETag, or mtime): ``{filename: {the probe's columns, error, message}}``, so that a
    rescan reads no header of theirs. A sample or a ``too_short``/``too_small`` reject gives its probe (bucketed
    again); a content error (``empty``, ``not_a_video``, ``invalid_header``) stays one; ``read_failed`` is read
    again. The videos of unchanged tar shards and parquet files: :func:`reusable_container_videos`."""
    if old is None or "codec" not in old.samples.column_names:
        return {}
    entries = {e.name: e for e in listing.videos}
    out_rows: dict[str, dict[str, Any]] = {}
    kept = ["filename", "size", "etag", "mtime", *VIDEO_PROBED]
    errors = old.errors.filter(pc.is_in(old.errors.column("error"), pa.array(["too_short", "too_small",
                                                                              *_VIDEO_CONTENT_ERRORS])))  # fmt: skip
    tables = [(old.samples, False), (errors, True)]
    for table, is_error in tables:
        loose = table.filter(pc.is_null(table.column("container")))
        loose = loose.filter(pc.invert(pc.is_null(loose.column("codec"))) if not is_error else
                             pc.is_in(loose.column("filename"), pa.array(sorted(entries), pa.string())))  # fmt: skip
        rows = loose.select(kept + (["error", "message"] if is_error else [])).to_pylist()
        for row in rows:
            entry = entries.get(row["filename"])
            if entry is None or not unchanged(entry, row["size"], row["etag"], row["mtime"]):
                continue
            content_error = is_error and row["error"] in _VIDEO_CONTENT_ERRORS
            out_rows[row["filename"]] = {**{k: row[k] for k in VIDEO_PROBED},
                                         "error": row["error"] if content_error else None,
                                         "message": row["message"] if content_error else None}  # fmt: skip
    return out_rows


def reusable_container_videos(old: Manifest | None, kept: list[str], schema: pa.Schema) -> pa.Table:
    """The previous manifest's video rows of the containers ``kept`` (unchanged tar shards or parquet files, by
    :func:`pipeline.sources.containers.shard_plan`) as the probe rows ``schema`` (a container task's output), so
    that a rescan reads nothing of theirs: a sample or a ``too_short``/``too_small`` reject gives its probe
    (bucketed again), every other error (content errors, a corrupt container) stays what it was; ``bytes_read`` and
    ``requests`` are 0."""
    if old is None or not kept or "codec" not in old.samples.column_names:
        return schema.empty_table()
    names = pa.array(kept, pa.string())
    rows = []
    for table in (old.samples, old.errors):
        mine = table.filter(pc.fill_null(pc.is_in(table.column("container"), names), False))
        if "error" in mine.column_names:
            rebucketed = pc.fill_null(pc.is_in(mine.column("error"), pa.array(["too_short", "too_small"])), False)
            for column in ("error", "message"):
                at = mine.schema.get_field_index(column)
                mine = mine.set_column(at, column, pc.if_else(rebucketed, pa.nulls(mine.num_rows, pa.string()),
                                                              mine.column(column)))  # fmt: skip
        rows.append(conform(mine, schema))
    reused = pa.concat_tables(rows)
    for column in [c for c in ("bytes_read", "requests") if c in schema.names]:
        at = reused.schema.get_field_index(column)
        reused = reused.set_column(at, column, pa.array([0] * reused.num_rows, schema.field(column).type))
    return reused


def _sidecars(listing: Listing, name: str, table: CaptionTable | None) -> list[FileEntry]:
    """The sidecars to read for ``name``: none when the caption table already has it (generated captions
    are added to the sidecars' captions: those are read)."""
    if table is not None and name in table.captions and not table.generated:
        return []
    return image_sidecars(listing, name)


def _work(listing: Listing, entry: FileEntry, probe: bool, table: CaptionTable | None) -> list[WorkItem]:
    """The items of image ``entry``: its probe with its (first) sidecar, then one item per further sidecar."""
    sidecars = _sidecars(listing, entry.name, table)
    first = sidecars[0] if sidecars else None
    items = [WorkItem(entry.name, entry.size, probe, first and first.name, first.size if first else 0)]
    return items + [WorkItem(entry.name, entry.size, False, s.name, s.size) for s in sidecars[1:]]


def _images_only(rows: pa.Table) -> pa.Table:
    """The image rows of a manifest table, without video columns: a video manifest's (scan --frames) videos
    are not images, and its images' frame columns are the video scan's to set."""
    if "codec" not in rows.column_names:
        return rows
    return rows.filter(pc.is_null(rows.column("codec"))).drop_columns(list(VIDEO_COLUMNS))
