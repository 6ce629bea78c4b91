"""A scan's rows of loose images: the tasks' probe rows and the reused rows of the previous manifest
joined with the listing (size, ETag, mtime) and the captions (caption table, else sidecars), into image
rows (before bucketing) and error rows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from manifests.manifest import conform
from manifests.schema import ERRORS_SCHEMA, sample_ids
from pipeline.sources.captions import CaptionTable, caption_list
from pipeline.sources.listing import IMAGE_SCHEMA, Listing, image_sidecars
from pipeline.sources.reading import SIDECAR_LIMIT
from pipeline.sources.rescan import RescanPlan, caption_source

__all__ = ["assemble"]


def _listing_columns(listing: Listing) -> pa.Table:
    entries = listing.images
    return pa.table({
        "filename": pa.array([e.name for e in entries], pa.string()),
        "size": pa.array([e.size for e in entries], pa.int64()),
        "etag": pa.array([e.etag for e in entries], pa.string()),
        "mtime": pa.array([e.mtime for e in entries], pa.float64()),
    })  # fmt: skip


def _sidecar_captions(listing: Listing, probed: pa.Table):
    """Captions read from sidecars: ``{image: (caption, captions)}`` for images whose every sidecar was
    read, the images with a sidecar that could not be read, and how many empty captions left a list."""
    read: dict[str, dict[str, str | None]] = {}
    failed: set[str] = set()
    for name, sidecar, caption, ok in zip(*(probed.column(c).to_pylist()
                                            for c in ("name", "sidecar", "caption", "caption_read"))):  # fmt: skip
        if ok:
            read.setdefault(name, {})[sidecar] = caption
        elif ok is False:
            failed.add(name)
    out: dict[str, tuple[str | None, list[str] | None]] = {}
    dropped = 0
    for name, texts in read.items():
        sidecars = image_sidecars(listing, name) if name not in failed else []
        if not sidecars or any(s.name not in texts for s in sidecars):
            continue
        if len(sidecars) == 1:  # one sidecar: an empty one is a null caption, as always
            out[name] = (texts[sidecars[0].name], None)
            continue
        caption, captions, empty = caption_list([texts[s.name] for s in sidecars])
        out[name], dropped = (caption, captions), dropped + empty
    return out, failed, dropped


def _truncated(listing: Listing, probed: pa.Table) -> int:
    """Sidecars read in this scan that were longer than SIDECAR_LIMIT bytes, so cut there."""
    sizes = {e.name: e.size for e in listing.sidecars.values()}
    sizes.update((e.name, e.size) for numbered in listing.numbered.values() for e in numbered.values())
    read = probed.filter(pc.fill_null(probed.column("caption_read"), False)).column("sidecar").to_pylist()
    return sum(sizes.get(name, 0) > SIDECAR_LIMIT for name in read)


def assemble(listing: Listing, plan: RescanPlan, probed: pa.Table, table: CaptionTable | None):
    """Image rows (IMAGE_SCHEMA) and error rows (ERRORS_SCHEMA) from reused rows and the tasks' tables."""
    sidecar_captions, failed_reads, dropped = _sidecar_captions(listing, probed)
    table_captions = table.captions if table is not None else {}
    table_lists = table.lists if table is not None else {}

    def caption_of(name: str, previous: tuple[str | None, list[str] | None]) -> tuple[str | None, list[str] | None]:
        if name in table_captions and table is not None and table.generated:  # added to the originals
            originals = sidecar_captions.get(name) or (previous if name in plan.kept_captions else (None, None))
            return table.merged(name, *originals)
        if name in table_captions:
            return table_captions[name], table_lists.get(name)
        if name in sidecar_captions:
            return sidecar_captions[name]
        return previous if name in plan.kept_captions else (None, None)

    def source_of(name: str) -> str | None:
        # a sidecar that could not be read records no source, so the next scan reads it again
        return None if name in failed_reads else caption_source(listing, name, table)

    def caption_columns(names: list[str], previous: list[tuple]) -> dict[str, pa.Array]:
        pairs = [caption_of(n, p) for n, p in zip(names, previous)]
        return {"caption": pa.array([p[0] for p in pairs], pa.string()),
                "captions": pa.array([p[1] for p in pairs], pa.list_(pa.string())),
                "caption_source": pa.array([source_of(n) for n in names], pa.string())}  # fmt: skip

    listed = _listing_columns(listing)

    def new_rows(rows: pa.Table, schema: pa.Schema) -> pa.Table:
        names = rows.column("name").to_pylist()
        at = pc.index_in(rows.column("name"), value_set=listed.column("filename"))
        columns = {c: rows.column(c) for c in ("width", "height", "format", "orientation", "bytes_read",
                                               "error", "message")}  # fmt: skip
        columns.update({c: listed.column(c).take(at) for c in ("size", "etag", "mtime")})
        columns.update({"sample_id": pa.array(sample_ids(names), pa.uint64()), "filename": rows.column("name"),
                        **caption_columns(names, [(None, None)] * len(names))})  # fmt: skip
        return conform(pa.table(columns), schema)

    def with_captions(reused: pa.Table) -> pa.Table:
        names = reused.column("filename").to_pylist()
        previous = list(zip(reused.column("caption").to_pylist(), reused.column("captions").to_pylist()))
        for name, column in caption_columns(names, previous).items():
            reused = reused.set_column(reused.schema.get_field_index(name), name, column)
        return reused

    new = probed.filter(probed.column("probed"))
    usable = pc.is_null(new.column("error"))
    images = new_rows(new.filter(usable), IMAGE_SCHEMA)
    errors = new_rows(new.filter(pc.invert(usable)), ERRORS_SCHEMA)
    images = pa.concat_tables([with_captions(plan.reused_images), images])
    errors = pa.concat_tables([with_captions(plan.reused_errors), errors])
    stats = {
        "files_read": new.num_rows,
        "bytes_read": new.column("bytes_read").drop_null().to_numpy(),
        "requests": int(pc.sum(probed.column("requests")).as_py() or 0),
        "captions_read": len(sidecar_captions),
        "caption_read_failures": len(failed_reads),
        "empty_captions_dropped": dropped + (table.dropped if table is not None else 0),
        "caption_lists": sum(len(c[1] or ()) > 1 for c in sidecar_captions.values()) + len(table_lists),
        "captions_truncated": _truncated(listing, probed),
    }
    return images, errors, stats
