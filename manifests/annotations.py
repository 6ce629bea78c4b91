"""The ANNOTATIONS artifact: per-sample columns a model computed from a manifest's images.

    ANNOTATIONS/
      _annotations.json          written last: manifest fingerprint, tasks (model, weight hash, settings), counts
      parts/<unit>.parquet       sample_id, filename, source_key, written_at, + each task's columns
      errors/<unit>.parquet      sample_id, filename, source_key, written_at, error, message

Workers write the parts, one per unit of work, named by a hash of the unit (its sample ids and
their source keys) and the settings: a unit redone after a lost worker rewrites the same object,
never a second copy. The driver writes ``_annotations.json`` last, naming the parts. A killed
job leaves parts that no root JSON names yet; the next run of the same settings adopts them (each
part carries the settings fingerprint in its parquet metadata; a part of other settings is refused).

``source_key`` here is an **image key**: :func:`manifests.cache.freshness.source_key` over the
row's size and etag or mtime only. A caption edit (or ``scan --captions`` merging generated
captions) changes no image, so it annotates nothing again; a changed image does. When a sample was
annotated twice (its image changed), the row written last is the one that counts
(:func:`resolve`); ``read_annotations`` returns one row per sample.

Tasks: each adds its columns to the parts (:data:`TASK_COLUMNS`) and records its settings in
``_annotations.json`` (:class:`TaskSettings`; ``model`` ``"default"``: the embedded tiny random weights).

    caption      caption string, generated_tokens int32       a vision-language model's caption
    embedding    embedding fixed_size_list<float16>[D]         a CLIP image embedding, L2-normalised
    aesthetic    aesthetic float32                             a head on the embedding (LAION predictor: ~1..10)
    safety       safety float32                                P(NSFW) in [0, 1], a head on the embedding
    watermark    watermark float32                             P(watermark) in [0, 1], a head on the embedding
    phash        phash uint64                                  64-bit DCT perceptual hash (imagehash's bit order)
    sha256       sha256 string                                 64 lowercase hex of the bytes read
    stats        luminance, contrast, colourfulness, sharpness, border_fraction float32; grayscale bool
    scenes       scenes list<struct<start int32, frames int32, time float64>>   a video's shots (frames from 0)
    motion       motion float32, scene_motion list<float32>   mean |dY| between frames within shots (video, per shot)
    with scenes  scene_aesthetic, scene_safety, scene_watermark list<float32>, scene_embedding list<float16 list>,
                 scene_caption list<string>: the shot tasks per shot; aesthetic, embedding, ... the video's summary
    review       keep bool, caption string, reviewer string  a person's decision (bucketeer review)

``embedding``'s D is the model's projection width: :data:`TASK_COLUMNS` lists it as a float16 list,
:func:`embedding_type` gives the stored type. Readers ask for the columns they use
(``read_annotations(..., columns=[...])``): a reader without float16 support never touches ``embedding``.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from manifests import __version__
from manifests.cache.freshness import IndexLookup, source_key
from manifests.errors import MissingError, UsageError
from manifests.jsonrecord import JsonRecord, each, nested, optional
from manifests.storage import join, open_url, read_artifact_meta, redact, write_bytes_atomic, write_json_atomic

__all__ = ["ANNOTATIONS_FILE", "FORMAT_VERSION", "TASK_COLUMNS", "SHOT_COLUMNS", "AnnotationsError",
           "AnnotationsMissingError", "TaskSettings", "AnnotationsCounts", "embedding_type", "AnnotationsMeta",
           "image_key", "settings_fingerprint", "part_name", "write_part", "read_parts", "resolve", "committed_lookup",
           "read_annotations_meta", "read_annotations", "write_annotations_meta", "is_annotations"]  # fmt: skip

ANNOTATIONS_FILE = "_annotations.json"
FORMAT_VERSION = 1
KIND = "bucketeer-annotations"
_FINGERPRINT_KEY = b"bucketeer.settings_fingerprint"
# columns every part and error part has, in this order
KEY_COLUMNS = [("sample_id", pa.uint64()), ("filename", pa.string()), ("source_key", pa.uint64()),
               ("written_at", pa.float64())]  # fmt: skip
TASK_COLUMNS: dict[str, list[tuple[str, pa.DataType]]] = {
    "caption": [("caption", pa.string()), ("generated_tokens", pa.int32())],
    "embedding": [("embedding", pa.list_(pa.float16()))],  # stored as embedding_type(D)
    "aesthetic": [("aesthetic", pa.float32())],
    "safety": [("safety", pa.float32())],
    "watermark": [("watermark", pa.float32())],
    "phash": [("phash", pa.uint64())],
    "sha256": [("sha256", pa.string())],
    "stats": [("luminance", pa.float32()), ("contrast", pa.float32()), ("colourfulness", pa.float32()),
              ("sharpness", pa.float32()), ("border_fraction", pa.float32()), ("grayscale", pa.bool_())],
    # video manifests (pipeline/annotate/scenes.py): a video's shots, and motion within them (per shot, same order)
    "scenes": [("scenes", pa.list_(pa.struct([("start", pa.int32()), ("frames", pa.int32()),
                                              ("time", pa.float64())])))],
    "motion": [("motion", pa.float32()), ("scene_motion", pa.list_(pa.float32()))],
    # bucketeer dedup (pipeline/dedup): one row per sample of its input annotations
    # bucketeer review (pipeline/review): a person's decision; caption only when edited (it replaces the sample's
    # captions in `scan --captions`); written_at is when the decision was made
    "review": [("keep", pa.bool_()), ("caption", pa.string()), ("reviewer", pa.string())],
    "dedup": [("duplicate", pa.bool_()), ("cluster_id", pa.uint64()), ("keeper_id", pa.uint64()),
              ("similarity", pa.float32())],
}
# the shot tasks of a video run (with ``scenes``): the task's own column is the video's summary, these its shots'
SHOT_COLUMNS: dict[str, list[tuple[str, pa.DataType]]] = {
    "caption": [("scene_caption", pa.list_(pa.string()))],
    "embedding": [("scene_embedding", pa.list_(pa.list_(pa.float16())))],  # stored as list<embedding_type(D)>
    "aesthetic": [("scene_aesthetic", pa.list_(pa.float32()))],
    "safety": [("scene_safety", pa.list_(pa.float32()))],
    "watermark": [("scene_watermark", pa.list_(pa.float32()))],
}
ERROR_COLUMNS = [*KEY_COLUMNS, ("error", pa.string()), ("message", pa.string())]


class AnnotationsError(UsageError):
    """An annotations folder that cannot be used as asked (other settings, another format)."""


class AnnotationsMissingError(AnnotationsError, MissingError):
    """A folder without ``_annotations.json`` (never finished, or not annotations)."""


@dataclass(frozen=True, kw_only=True)
class TaskSettings(JsonRecord):
    """One task's model and settings: what makes its output what it is (fingerprinted)."""

    task: str
    model: str  # hub id, local folder, or "default"
    weight_sha256: str  # over the sorted (name, sha256) of its weight files (pipeline.annotate.engines)
    prompt: str | None = None
    max_new_tokens: int | None = None
    generation: Mapping[str, Any] = nested(dict, default_factory=dict)  # do_sample etc.


@dataclass(frozen=True, kw_only=True)
class AnnotationsCounts(JsonRecord):
    """Of the manifest's samples (when this was written): annotated, error rows, and the total."""

    samples: int
    annotated: int
    errors: int


@dataclass(frozen=True, kw_only=True)
class AnnotationsMeta(JsonRecord):
    """``_annotations.json``, parsed once (:func:`read_annotations_meta`)."""

    kind: str = KIND
    format_version: int = FORMAT_VERSION
    manifest: str  # URL of the manifest annotated (redacted)
    manifest_fingerprint: str
    tasks: tuple[TaskSettings, ...] = nested(each(TaskSettings.from_json))
    settings_fingerprint: str
    engine: str  # what ran the last run: "transformers" or "vllm"
    counts: AnnotationsCounts = nested(AnnotationsCounts.from_json)
    parts: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    fingerprint: str
    tool_version: str = __version__
    created_at: str | None = optional()
    throttled: int | None = optional()  # the last run's storage answers that asked for fewer requests (not hashed)

    def task(self, name: str) -> TaskSettings | None:
        return next((t for t in self.tasks if t.task == name), None)


def embedding_type(dim: int) -> pa.DataType:
    """The stored type of the ``embedding`` column of a ``dim``-wide model: fixed_size_list<float16>[dim]."""
    return pa.list_(pa.float16(), dim)


def image_key(rows: pa.Table) -> np.ndarray:
    """(n,) uint64 key of each manifest row's image bytes: size and etag or mtime (no caption, no bucket)."""
    present = [c for c in ("sample_id", "size", "etag", "mtime") if c in rows.column_names]
    return source_key(rows.select(present))


def settings_fingerprint(tasks: tuple[TaskSettings, ...]) -> str:
    """16 hex digits over the tasks' settings: parts and folders of other settings are never mixed."""
    text = json.dumps([t.to_json() for t in sorted(tasks, key=lambda t: t.task)], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def part_name(settings: str, sample_ids: np.ndarray, keys: np.ndarray) -> str:
    """A unit's part name: a hash of the settings and its rows (the same unit redone, the same name)."""
    order = np.argsort(sample_ids)
    h = hashlib.sha256(settings.encode())
    h.update(np.asarray(sample_ids, "<u8")[order].tobytes() + np.asarray(keys, "<u8")[order].tobytes())
    return h.hexdigest()[:24] + ".parquet"


def _schema(columns: list[tuple[str, pa.DataType]], settings: str) -> pa.Schema:
    return pa.schema(columns, metadata={_FINGERPRINT_KEY: settings.encode()})


def part_schema(tasks: tuple[str, ...]) -> list[tuple[str, pa.DataType]]:
    """The columns of a part holding ``tasks`` (with ``scenes``: each shot task's :data:`SHOT_COLUMNS` too)."""
    shots = "scenes" in tasks
    return [*KEY_COLUMNS, *(c for t in tasks for c in [*TASK_COLUMNS[t], *(SHOT_COLUMNS.get(t, []) * shots)])]


def write_part(fs, root: str, kind: str, name: str, table: pa.Table, settings: str) -> None:
    """Write ``table`` as ``ROOT/<kind>/<name>`` (kind ``parts`` or ``errors``) atomically, tagged with
    the ``settings`` fingerprint."""
    columns = ERROR_COLUMNS if kind == "errors" else [(f.name, f.type) for f in table.schema]
    table = pa.Table.from_arrays([table.column(n).cast(t) for n, t in columns], schema=_schema(columns, settings))
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    write_bytes_atomic(fs, join(root, kind, name), sink.getvalue())


def _listed(fs, root: str, kind: str) -> list[str]:
    folder = join(root, kind)
    fs.invalidate_cache(folder)  # the workers wrote parts since this process last listed (s3fs caches listings)
    try:
        names = fs.ls(folder, detail=False)
    except FileNotFoundError:
        return []
    return sorted(n.rsplit("/", 1)[-1] for n in names if n.endswith(".parquet"))


def read_parts(url: str, storage_options: dict | None, kind: str, names: tuple[str, ...] | None = None,
               settings: str | None = None, columns: list[str] | None = None) -> pa.Table:  # fmt: skip
    """The rows of ``kind`` (``parts`` or ``errors``) parts ``names`` (None: every part in the folder,
    also those a killed run left). ``settings``: refuse (AnnotationsError) a part of another fingerprint."""
    fs, root = open_url(url, storage_options)
    names = tuple(_listed(fs, root, kind)) if names is None else names
    base = ERROR_COLUMNS if kind == "errors" else KEY_COLUMNS
    tables = []
    for name in names:
        data = fs.cat_file(join(root, kind, name))
        if columns is not None:
            held = pq.ParquetFile(io.BytesIO(data)).schema_arrow.names
            if absent := [c for c in columns if c not in held]:
                raise AnnotationsError(f"{redact(url)} {kind}/{name} has no column {', '.join(absent)} (it has "
                                       f"{', '.join(held)}): annotate with the task that makes it")  # fmt: skip
        table = pq.read_table(io.BytesIO(data), columns=columns)
        found = (table.schema.metadata or {}).get(_FINGERPRINT_KEY, b"").decode()
        if settings is not None and found != settings:
            raise AnnotationsError(f"{redact(url)} holds {kind}/{name} of other settings (fingerprint {found}, "
                                   f"this run's {settings}): write these settings to another --out")  # fmt: skip
        tables.append(table.replace_schema_metadata(None))
    if not tables:
        known = dict([*base, *(c for cs in [*TASK_COLUMNS.values(), *SHOT_COLUMNS.values()] for c in cs)])
        wanted = columns or [n for n, _ in base]
        return pa.table({n: pa.array([], known.get(n, pa.null())) for n in wanted})
    return pa.concat_tables(tables, promote_options="permissive")


def resolve(table: pa.Table) -> pa.Table:
    """One row per sample id: the one written last (a sample annotated again after its image changed)."""
    if table.num_rows == 0:
        return table
    by_id = np.argsort(table.column("sample_id").to_numpy(), kind="stable")  # (n,)
    ids = table.column("sample_id").to_numpy()[by_id]
    if not np.any(ids[1:] == ids[:-1]):  # one row per sample already (the common case): sorting by id is all
        return table.take(by_id)
    order = pc.sort_indices(table, [("sample_id", "ascending"), ("written_at", "descending")])
    table = table.take(order)
    ids = table.column("sample_id").to_numpy()
    first = np.r_[True, ids[1:] != ids[:-1]]
    return table.filter(pa.array(first))


def committed_lookup(url: str, storage_options: dict | None, settings: str) -> tuple[IndexLookup, int]:
    """What ``url`` already holds of these settings (every part on storage, adopted or named), as a
    freshness lookup keyed by image keys; and how many part files that was. Refuses parts of other settings."""
    columns = ["sample_id", "source_key", "written_at"]
    parts = read_parts(url, storage_options, "parts", settings=settings, columns=columns)
    errors = read_parts(url, storage_options, "errors", settings=settings, columns=[*columns, "error"])
    both = resolve(pa.concat_tables([parts.append_column("error", pa.nulls(parts.num_rows, pa.string())), errors]))
    is_error = both.column("error").is_valid()
    return IndexLookup(both.filter(pc.invert(is_error)), both.filter(is_error)), parts.num_rows + errors.num_rows


def is_annotations(url: str, storage_options: dict | None = None) -> bool:
    """Whether ``url`` is a folder holding ``_annotations.json``."""
    fs, root = open_url(url, storage_options)
    try:
        fs.invalidate_cache(root)
        return bool(fs.isfile(join(root, ANNOTATIONS_FILE)))
    except (OSError, ValueError):
        return False


def read_annotations_meta(url: str, storage_options: dict | None = None) -> AnnotationsMeta:
    """``url``'s ``_annotations.json``; AnnotationsMissingError without one, AnnotationsError for another format."""
    fs, root = open_url(url, storage_options)
    meta = read_artifact_meta(fs, root, url, file=ANNOTATIONS_FILE, kind=KIND, version=FORMAT_VERSION,
                              error=AnnotationsError, missing=AnnotationsMissingError,
                              missing_hint="run `bucketeer annotate` (again) to finish it",
                              version_hint="re-run `bucketeer annotate` into a new folder")  # fmt: skip
    return AnnotationsMeta.from_json(meta)


def read_annotations(url: str, storage_options: dict | None = None, columns: list[str] | None = None
                     ) -> tuple[AnnotationsMeta, pa.Table, pa.Table]:  # fmt: skip
    """``(meta, rows, errors)`` of a finished annotations folder: the parts ``_annotations.json`` names,
    one row per sample id (:func:`resolve`); a sample's newest row decides whether it is a row or an error.
    ``columns``: read only these task columns (None: all); the KEY_COLUMNS always come. A column the parts
    lack is an AnnotationsError naming it."""
    meta = read_annotations_meta(url, storage_options)
    keys = [n for n, _ in KEY_COLUMNS]
    wanted = None if columns is None else keys + [c for c in columns if c not in keys]
    rows = resolve(read_parts(url, storage_options, "parts", meta.parts, columns=wanted))
    errors = resolve(read_parts(url, storage_options, "errors", meta.errors))
    if errors.num_rows == 0:  # no error row: nothing to weigh against the rows (saves a sort of every row)
        return meta, rows, errors
    marked = [t.select(["sample_id", "written_at"]).append_column("is_error", pa.array([bad] * t.num_rows, pa.bool_()))
              for t, bad in ((rows, False), (errors, True))]  # fmt: skip
    latest = resolve(pa.concat_tables(marked))
    failed = latest.filter(latest.column("is_error")).column("sample_id")
    rows = rows.filter(pc.invert(pc.is_in(rows.column("sample_id"), value_set=failed)))
    errors = errors.filter(pc.is_in(errors.column("sample_id"), value_set=failed))
    return meta, rows, errors


def write_annotations_meta(url: str, storage_options: dict | None, meta: AnnotationsMeta) -> AnnotationsMeta:
    """Write ``_annotations.json`` (last: it makes the folder valid) with its own fingerprint filled in."""
    body = {**meta.to_json(), "fingerprint": "", "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat()}
    digest = {k: v for k, v in body.items() if k not in ("created_at", "fingerprint", "tool_version", "throttled")}
    body["fingerprint"] = hashlib.sha256(json.dumps(digest, sort_keys=True).encode()).hexdigest()[:16]
    fs, root = open_url(url, storage_options)
    write_json_atomic(fs, join(root, ANNOTATIONS_FILE), body)
    return AnnotationsMeta.from_json(body)


def listed_parts(url: str, storage_options: dict | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The part and error part names on storage now (what the root JSON will name)."""
    fs, root = open_url(url, storage_options)
    return tuple(_listed(fs, root, "parts")), tuple(_listed(fs, root, "errors"))
