"""Manifest IO: write parquet parts, then ``_manifest.json`` last; read back only what it lists.

A manifest folder is valid when its ``_manifest.json`` exists. That file names every part, so a
reader never lists the folder, and a writer that dies before committing leaves at most some
unreferenced parts (removed by the next commit) while the previous manifest stays readable.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from manifests import __version__
from manifests.buckets import BucketSpec, assign_buckets, bucket_names
from manifests.schema import ADDED_COLUMNS, FORMAT_VERSION, MASK_COLUMNS, MAX_PIXELS, SAMPLES_SCHEMA, \
    VIDEO_SAMPLES_SCHEMA, table_schemas
from manifests.manifest_meta import (
    MANIFEST_KIND,
    VERSION_HINT,
    ManifestConditioning,
    ManifestCounts,
    ManifestError,
    ManifestMeta,
    ManifestMissingError,
    ManifestPart,
    ManifestParts,
    ScanSummary,
)
from manifests.storage import (
    call_storage,
    join,
    open_url,
    read_artifact_meta,
    RangedFile,
    read_bytes,
    redact,
    write_bytes_atomic,
    write_json_atomic,
)

if TYPE_CHECKING:  # polars is imported where stats are computed: the trainer and GPU check run without it
    import polars as pl

__all__ = [
    "MANIFEST_FILE",
    "ManifestError",
    "ManifestMissingError",
    "Manifest",
    "write_manifest",
    "read_manifest",
    "read_manifest_meta",
    "RowGroup",
    "sample_row_groups",
    "read_row_group",
    "conform",
    "apply_buckets",
    "rebucket",
    "manifest_stats",
]

MANIFEST_FILE = "_manifest.json"
ROWS_PER_PART = 1_000_000


@dataclass
class Manifest:
    """A committed manifest: its metadata and its two tables (``SAMPLES_SCHEMA``, ``ERRORS_SCHEMA``)."""

    url: str
    meta: ManifestMeta
    samples: pa.Table
    errors: pa.Table

    @property
    def fingerprint(self) -> str:
        return self.meta.fingerprint

    @property
    def spec(self) -> BucketSpec:
        return self.meta.bucket_spec

    @property
    def source(self) -> str:
        return self.meta.source

    @property
    def max_pixels(self) -> int:
        """The pixel limit the scan applied (``_manifest.json`` ``max_pixels``); embed decodes up to it.

        Manifests written before the field existed give their scan summary's figure, else MAX_PIXELS.
        """
        return int(self.meta.max_pixels or self.meta.summary.max_pixels or MAX_PIXELS)

    def samples_df(self) -> pl.DataFrame:
        import polars as pl  # here, not at import: the trainer and the GPU check import this module without polars

        return pl.from_arrow(self.samples)  # type: ignore[return-value]

    def errors_df(self) -> pl.DataFrame:
        import polars as pl

        return pl.from_arrow(self.errors)  # type: ignore[return-value]


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Order and cast ``table``'s columns to ``schema``; absent nullable columns become nulls.

    Raises ManifestError naming required columns that are absent or hold nulls.
    """
    columns = []
    for field in schema:
        if field.name in table.column_names:
            col = table.column(field.name)
            if col.type != field.type:
                col = col.cast(field.type)
            if not field.nullable and col.null_count:
                raise ManifestError(f"column {field.name!r} has {col.null_count} null values")
        elif field.nullable:
            col = pa.nulls(table.num_rows, field.type)
        else:
            raise ManifestError(f"required column {field.name!r} is missing")
        columns.append(col)
    return pa.Table.from_arrays(columns, schema=schema)


def _part_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=128 * 1024)
    return buf.getvalue()


def _without_null(table: pa.Table, columns: tuple[str, ...]) -> pa.Table:
    """``table`` without those of ``columns`` (nullable, in ADDED_COLUMNS) that hold only nulls: readers take
    an absent added column as nulls."""
    return table.drop_columns([c for c in columns if table.column(c).null_count == table.num_rows])


def _write_parts(fs, root: str, kind: str, table: pa.Table, rows_per_part: int) -> tuple[ManifestPart, ...]:
    parts: list[ManifestPart] = []
    for start in range(0, max(table.num_rows, 1), rows_per_part):
        chunk = table.slice(start, rows_per_part)
        data = _part_bytes(chunk)
        digest = hashlib.sha256(data).hexdigest()
        # content-addressed names: a rerun writes the same names, and never overwrites a part
        # that a committed _manifest.json still points to with different content
        name = f"{kind}/part-{len(parts):05d}-{digest[:16]}.parquet"
        write_bytes_atomic(fs, join(root, name), data)
        parts.append(ManifestPart(path=name, rows=chunk.num_rows, sha256=digest, bytes=len(data)))
    return tuple(parts)


def write_manifest(
    url: str,
    samples: pa.Table,
    errors: pa.Table,
    *,
    source: str,
    spec: BucketSpec,
    counts: Mapping[str, int] | None = None,
    summary: ScanSummary | None = None,
    max_pixels: int = MAX_PIXELS,
    storage_options: dict[str, Any] | None = None,
    rows_per_part: int = ROWS_PER_PART,
    conditioning: ManifestConditioning | None = None,
    masks: str | None = None,
    frame_ladder: tuple[int, ...] | None = None,
) -> ManifestMeta:
    """Commit a manifest at ``url``: parts first, ``_manifest.json`` last; returns its metadata.

    Rows are sorted by filename so the same content gives the same bytes and fingerprint.
    ``counts`` may add ``listed``, ``ignored`` and ``shards`` (:class:`ManifestCounts`) to the
    sample/error counts; ``summary`` holds the producing job's figures; ``max_pixels`` is the pixel
    limit the rows were judged by (recorded for embed, which decodes up to it). ``conditioning``
    (``scan --conditioning``): where the ``conditioning`` column's paths are relative to; recorded
    only when given; so are ``masks`` (``scan --masks``: the rows' ``mask`` column was filled) and
    ``frame_ladder`` (``scan --frames``: a video manifest). Parts no longer
    referenced are deleted after the commit. Raises ManifestError for duplicate sample ids or a
    ``max_pixels`` outside 1..MAX_PIXELS.
    """
    if not 1 <= max_pixels <= MAX_PIXELS:
        raise ManifestError(f"max_pixels must be 1..{MAX_PIXELS:,} (what Pillow decodes), got {max_pixels:,}")
    # the mask columns only when a row has a mask: a manifest without masks keeps its bytes and fingerprint
    samples_schema, errors_schema = table_schemas(frame_ladder is not None)
    samples = _without_null(conform(samples, samples_schema).sort_by("filename"), MASK_COLUMNS)
    errors = _without_null(conform(errors, errors_schema).sort_by("filename"), MASK_COLUMNS)
    both = pa.concat_arrays([samples.column("sample_id").combine_chunks(), errors.column("sample_id").combine_chunks()])
    if len(np.unique(both.to_numpy())) != len(both):
        raise ManifestError("duplicate sample_id: a file is listed twice, or two paths hash alike")

    fs, root = open_url(url, storage_options)
    call_storage(fs, "creating", root, lambda: fs.makedirs(root, exist_ok=True))
    parts = ManifestParts(
        samples=_write_parts(fs, root, "samples", samples, rows_per_part),
        errors=_write_parts(fs, root, "errors", errors, rows_per_part),
    )
    digests = [p.sha256 for p in parts.samples + parts.errors]
    fingerprint = hashlib.sha256(
        json.dumps([FORMAT_VERSION, redact(source), spec.to_json(), digests], sort_keys=True).encode()
    ).hexdigest()
    meta = ManifestMeta(
        tool_version=__version__,
        created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        source=redact(source),
        bucket_spec=spec,
        counts=ManifestCounts(**{**(counts or {}), "samples": samples.num_rows, "errors": errors.num_rows}),
        # outside the fingerprint, like the summary: the rows already show its effect (too_many_pixels rows)
        max_pixels=int(max_pixels),
        fingerprint=fingerprint,
        parts=parts,
        summary=summary or ScanSummary(),
        conditioning=None if conditioning is None else ManifestConditioning(
            root=redact(conditioning.root), column=conditioning.column),
        masks=masks,
        frame_ladder=None if frame_ladder is None else tuple(int(f) for f in frame_ladder),
    )  # fmt: skip
    write_json_atomic(fs, join(root, MANIFEST_FILE), meta.to_json())
    _remove_unreferenced(fs, root, {p.path for p in parts.samples + parts.errors})
    return meta


def _remove_unreferenced(fs, root: str, keep: set[str]) -> None:
    for kind in ("samples", "errors"):
        folder = join(root, kind)
        try:
            entries = call_storage(fs, "listing", folder, lambda: fs.ls(folder, detail=False))
        except FileNotFoundError:
            continue
        for path in entries:
            rel = f"{kind}/{path.rstrip('/').rsplit('/', 1)[-1]}"
            if rel not in keep:
                call_storage(fs, "removing", path, lambda: fs.rm(path))


def read_manifest_meta(url: str, storage_options: dict[str, Any] | None = None) -> ManifestMeta:
    """Read and check a committed manifest's ``_manifest.json`` only (no parts are read).

    Raises ManifestError (ManifestMissingError without one) saying what is wrong and what to do.
    """
    fs, root = open_url(url, storage_options)
    return _read_meta(fs, root, url)


def _read_meta(fs, root: str, url: str) -> ManifestMeta:
    """The one place ``_manifest.json`` is parsed: :meth:`ManifestMeta.from_json` of what the store holds."""
    raw = read_artifact_meta(
        fs, root, url, file=MANIFEST_FILE, kind=MANIFEST_KIND, version=FORMAT_VERSION, error=ManifestError,
        missing=ManifestMissingError,
        missing_hint="it is not a manifest, or its scan never committed (still running or killed). "
        "Run `bucketeer scan` to (re)build it.",
        version_hint=VERSION_HINT,
    )
    return ManifestMeta.from_json(raw, url)


def read_manifest(url: str, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Read a committed manifest; raises ManifestError saying what is wrong and what to do."""
    fs, root = open_url(url, storage_options)
    meta = _read_meta(fs, root, url)
    tables = {}
    for kind, schema in zip(("samples", "errors"), table_schemas(meta.frame_ladder is not None)):
        pieces = []
        for part in getattr(meta.parts, kind):
            path = join(root, part.path)
            try:
                piece = pq.read_table(pa.BufferReader(read_bytes(fs, path)))
            except FileNotFoundError:
                raise ManifestError(f"{redact(url)}: part {part.path} named in {MANIFEST_FILE} is missing") from None
            except pa.ArrowInvalid as e:
                raise ManifestError(f"{redact(url)}: part {part.path} is not a readable parquet file ({e}); "
                                    "run `bucketeer scan` to rebuild it") from None  # fmt: skip
            missing = [n for n in schema.names if n not in piece.column_names and n not in ADDED_COLUMNS]
            if missing:
                raise ManifestError(f"{redact(url)}: part {part.path} lacks columns {missing}")
            try:
                pieces.append(conform(piece, schema))
            except ManifestError as e:
                raise ManifestError(f"{redact(url)}: part {part.path}: {e}") from None
        tables[kind] = pa.concat_tables(pieces) if pieces else schema.empty_table()
    return Manifest(url=url, meta=meta, samples=tables["samples"], errors=tables["errors"])


def apply_buckets(images: pa.Table, spec: BucketSpec, *, video: bool = False) -> tuple[pa.Table, pa.Table]:
    """Bucket image rows (samples-like, with ``width``/``height``); split off ``too_small`` rejects.

    Returns ``(samples, rejects)`` conformed to SAMPLES_SCHEMA and ERRORS_SCHEMA (``video``: the video
    manifest's, which keep the video columns; pipeline/scan/video.py adds the frame bucket). Every row
    ends in exactly one of them. This is the one bucketing path: scan and rebucket both use it.
    """
    w = images.column("width").to_numpy()
    h = images.column("height").to_numpy()
    bw, bh, too_small = assign_buckets(spec, w, h)
    images = images.drop_columns([c for c in ("bucket", "error", "message") if c in images.column_names])
    images = images.append_column("bucket", bucket_names(bw, bh))
    keep = pa.array(~too_small)
    samples_schema, errors_schema = table_schemas(video)
    samples = conform(images.filter(keep), samples_schema)
    small = images.filter(pa.array(too_small))
    short = np.minimum(small.column("width").to_numpy(), small.column("height").to_numpy())
    small = small.drop_columns(["bucket"])
    small = small.append_column("error", pa.array(["too_small"] * small.num_rows, pa.string()))
    small = small.append_column(
        "message",
        pa.array([f"shorter side {s}px is below --min-side {spec.min_side}px" for s in short], pa.string()),
    )
    return samples, conform(small, errors_schema)


def rebucket(manifest: Manifest, spec: BucketSpec) -> tuple[pa.Table, pa.Table]:
    """Re-assign buckets from stored sizes, no image I/O. ``too_small`` rejects are re-judged too.

    Returns new ``(samples, errors)`` tables; other error rows are carried over unchanged.
    """
    errors = manifest.errors
    is_small = pc.equal(errors.column("error"), "too_small")
    image_schema = pa.schema([f for f in SAMPLES_SCHEMA if f.name != "bucket"])
    candidates = pa.concat_tables(
        [conform(manifest.samples, image_schema), conform(errors.filter(is_small), image_schema)]
    )
    others = errors.filter(pc.invert(is_small))
    samples, small = apply_buckets(candidates, spec)
    return samples, pa.concat_tables([others, small])


def manifest_stats(manifest: Manifest) -> dict[str, Any]:
    """Counts, bucket histogram (largest first) and errors by kind, as plain JSON-ready values."""
    import polars as pl

    samples = manifest.samples_df()
    errors = manifest.errors_df()
    buckets = samples.group_by("bucket").len().sort(["len", "bucket"], descending=[True, False])
    kinds = errors.group_by("error").len().sort(["len", "error"], descending=[True, False])
    captioned = samples.select(pl.col("caption").is_not_null().sum()).item() if samples.height else 0
    return {
        "counts": manifest.meta.counts.to_json(),
        "captioned": int(captioned),
        "buckets": {r["bucket"]: r["len"] for r in buckets.iter_rows(named=True)},
        "errors": {r["error"]: r["len"] for r in kinds.iter_rows(named=True)},
        "fingerprint": manifest.fingerprint,
    }


# ---------------------------------------------------------------- row groups: the manifest in bounded chunks


@dataclass(frozen=True)
class RowGroup:
    """One row group of a samples part (the unit a streaming reader holds in memory at once)."""

    part: str  # path relative to the manifest root
    part_bytes: int  # size of the part object (ranged reads need it)
    index: int  # the row group's number in the part
    rows: int


def _part_size(fs, root: str, url: str, part: ManifestPart) -> int:
    """A part's size in bytes: recorded in ``_manifest.json``, else asked of the store."""
    if part.bytes is not None:
        return int(part.bytes)
    target = join(root, part.path)
    try:
        return int(call_storage(fs, "sizing", target, lambda: fs.size(target)))
    except FileNotFoundError:
        raise ManifestError(f"{redact(url)}: part {part.path} named in {MANIFEST_FILE} is missing") from None


def _part_file(fs, root: str, url: str, path: str, size: int) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(RangedFile(fs, join(root, path), size))
    except FileNotFoundError:
        raise ManifestError(f"{redact(url)}: part {path} named in {MANIFEST_FILE} is missing") from None
    except pa.ArrowInvalid as e:
        raise ManifestError(f"{redact(url)}: part {path} is not a readable parquet file ({e}); "
                            "run `bucketeer scan` to rebuild it") from None  # fmt: skip


def sample_row_groups(
    url: str, meta: ManifestMeta, storage_options: dict[str, Any] | None = None
) -> list[RowGroup]:
    """Every row group of the manifest's samples parts, in order: one footer read per part.

    ``meta`` is the manifest's ``_manifest.json`` (:func:`read_manifest_meta`). Raises ManifestError
    for a part that is missing or not parquet.
    """
    fs, root = open_url(url, storage_options)
    groups = []
    for part in meta.parts.samples:
        size = _part_size(fs, root, url, part)
        file = _part_file(fs, root, url, part.path, size)
        for i in range(file.metadata.num_row_groups):
            groups.append(RowGroup(part.path, size, i, file.metadata.row_group(i).num_rows))
    return groups


def read_row_group(
    url: str, group: RowGroup, columns: list[str], storage_options: dict[str, Any] | None = None
) -> pa.Table:
    """The ``columns`` of one samples row group, typed as ``SAMPLES_SCHEMA`` says; a nullable column
    the part lacks (written before it existed, or never filled) reads as nulls. Ranged reads only.

    Raises ManifestError for a missing or unreadable part, or a required column it lacks.
    """
    fs, root = open_url(url, storage_options)
    file = _part_file(fs, root, url, group.part, group.part_bytes)
    present = [c for c in columns if c in file.schema_arrow.names]
    table = file.read_row_group(group.index, columns=present)
    out = []
    for name in columns:
        field = VIDEO_SAMPLES_SCHEMA.field(name)  # a superset: an image part reads video columns as nulls
        if name in present:
            out.append(table.column(name).cast(field.type))
        elif field.nullable:
            out.append(pa.nulls(table.num_rows, field.type))
        else:
            raise ManifestError(f"{redact(url)}: part {group.part} lacks column {name!r}")
    return pa.Table.from_arrays(out, names=columns)
