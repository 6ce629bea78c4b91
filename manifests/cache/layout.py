"""The cache folder: shards of records, their index, ``_cache.json``; reading the index and freshness.

The writer (:mod:`manifests.cache.writer`) and the reader (:mod:`manifests.cache.reader`) live in
their own modules; ``CacheWriter``, ``ShardWriter`` and ``CacheReader`` are importable from here too.

Layout of ``CACHE/`` (``_cache.json`` names the index parts, the index rows name the shards;
nothing is ever listed)::

    _cache.json                          settings + fingerprint, index parts, counts, bytes, family and
                                         text layout, empty caption + validation prompt keys (never shards)
    shards/samples-<sha256[:24]>.bin     concatenated sample records (latent + geometry)
    shards/texts-<sha256[:24]>.bin       concatenated text records, one per unique caption
    index/samples-<sha>.parquet          sample_id, shard, offset, length, crc32, caption_key (the first
                                         caption's), caption_keys (all, for a sample with several captions;
                                         null otherwise and in older caches), bucket, source_key, generation,
                                         text_inline (the record holds its caption's text: null/False in
                                         older caches), latent_key (the latent's content identity: null in
                                         older caches)
    index/texts-<sha>.parquet            caption_key, shard, offset, length, crc32 (of a text record, or
                                         of the sample record that holds the caption's text inline)
    index/errors-<sha>.parquet           sample_id, filename, error, message, source_key, generation

A record is gzip'd tensors (:mod:`manifests.cache.codec`: byte planes, or plain safetensors in
older caches; ``_cache.json`` ``records`` says what its writers wrote), readable alone with one
ranged read. A caption that only one sample has is stored inside that sample's record
(``text_inline``), so the trainer reads a sample with one request; shared captions keep one text
record each.

Writing is a sequence of commits: shard objects (written by the embed workers) and index parts
first (content-addressed, so a rerun never overwrites a different object under a committed name), then
``_cache.json`` atomically (by one committer, :mod:`manifests.cache.writer`). A job killed
between commits, or a worker whose unit was redone elsewhere, leaves at most unreferenced
objects; the committed state is always consistent and a resumed job embeds exactly the samples the
index lacks (or holds stale). One committer at a time per cache folder.

Never stale: every sample and error row stores the **source key** of the manifest row it was made
from (:mod:`manifests.cache.freshness`) and the **generation** (the ``_cache.json`` commit that
wrote it). A changed image or caption is re-embedded into a new shard; for a sample id the row of
the highest generation wins, whether a record or an error row, and :func:`read_index` (the one
reader of the index: embed, the cache reader, verify and the report use it) returns only the
winners (``finish`` also drops the losers from the merged index; their bytes stay in old shards,
unreferenced). Records of samples that left the manifest stay: harmless, since plans are
drawn from the manifest and :func:`available_sample_ids` with a manifest returns fresh ids only.
"""

from __future__ import annotations

import io
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from manifests.cache.freshness import Freshness, IndexLookup, classify, manifest_samples, source_key
from manifests.cache.meta import (
    CACHE_FILE,
    CACHE_FORMAT_VERSION,
    KIND,
    MISSING_HINT,
    VERSION_HINT,
    CacheError,
    CacheIndex,
    CacheMeta,
    CacheMissingError,
    fingerprint_of,
)
from manifests.storage import join, open_url, read_artifact_meta, read_many, redact, storage_error

__all__ = [
    "CACHE_FILE",
    "CACHE_FORMAT_VERSION",
    "CacheError",
    "CacheMissingError",
    "CacheMeta",
    "SAMPLE_INDEX_SCHEMA",
    "TEXT_INDEX_SCHEMA",
    "CACHE_ERRORS_SCHEMA",
    "INDEX_SCHEMAS",
    "KIND",
    "SHARD_RECORDS",
    "SHARD_BYTES",
    "fingerprint_of",
    "settings_diff",
    "read_cache_meta",
    "read_meta",
    "newest_rows",
    "newest_texts",
    "inline_text_rows",
    "table_bytes",
    "read_index",
    "index_lookup",
    "IndexLookup",
    "available_sample_ids",
    "cache_freshness",
    "source_key",
    "Freshness",
]

SHARD_RECORDS = 1024  # records per shard: ~100 MB of SDXL latents, few enough objects for any store
SHARD_BYTES = 256 << 20

SAMPLE_INDEX_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.uint64(), nullable=False),
        pa.field("shard", pa.string(), nullable=False),  # path relative to the cache root
        pa.field("offset", pa.int64(), nullable=False),  # bytes into the shard
        pa.field("length", pa.int64(), nullable=False),  # bytes of the compressed record
        pa.field("crc32", pa.uint32(), nullable=False),  # of the compressed record
        pa.field("caption_key", pa.uint64(), nullable=False),  # -> texts index; the first caption's
        # every caption's key, in the manifest's order, when the sample has several captions; null: [caption_key]
        pa.field("caption_keys", pa.list_(pa.uint64())),
        pa.field("bucket", pa.string(), nullable=False),  # "WxH"
        pa.field("source_key", pa.uint64()),  # of the manifest row it was made from; null: unknown (stale)
        pa.field("generation", pa.int64()),  # the _cache.json commit that wrote it; the newest wins
        # the record holds its caption's text too (a caption only this sample has): one read; null: False
        pa.field("text_inline", pa.bool_()),
        # the latent's identity: hash of the image's sha256, bucket and geometry (pipeline.embed.reuse.latent_key);
        # what `embed --reuse` looks records up by. null: written before it existed (never taken)
        pa.field("latent_key", pa.uint64()),
    ]
)
TEXT_INDEX_SCHEMA = pa.schema(
    [
        pa.field("caption_key", pa.uint64(), nullable=False),
        pa.field("shard", pa.string(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("length", pa.int64(), nullable=False),
        pa.field("crc32", pa.uint32(), nullable=False),
    ]
)
CACHE_ERRORS_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.uint64(), nullable=False),
        pa.field("filename", pa.string(), nullable=False),
        pa.field("error", pa.string(), nullable=False),  # a manifests.schema.ERROR_KINDS kind
        pa.field("message", pa.string(), nullable=False),
        pa.field("source_key", pa.uint64()),
        pa.field("generation", pa.int64()),
    ]
)
INDEX_SCHEMAS = {"samples": SAMPLE_INDEX_SCHEMA, "texts": TEXT_INDEX_SCHEMA, "errors": CACHE_ERRORS_SCHEMA}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(d, list):
        out = {}
        for i, v in enumerate(d):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out if d else {prefix: []}
    return {prefix: d}


def settings_diff(old: dict[str, Any], new: dict[str, Any], *, only_new_keys: bool = False) -> list[str]:
    """Human-readable ``key: old -> new`` lines for every setting that differs.

    ``only_new_keys`` compares only the (nested) keys ``new`` sets, e.g. a request made before the
    models are loaded against the full settings of a cache.
    """
    a, b = _flatten(old), _flatten(new)
    keys = list(b) if only_new_keys else sorted(set(a) | set(b))
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in keys
            if a.get(k, "<absent>") != b.get(k, "<absent>")]  # fmt: skip


def table_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def read_cache_meta(url: str, storage_options: dict | None = None) -> CacheMeta:
    """Read and check ``CACHE/_cache.json``.

    Raises CacheError when the folder has none (not a cache, or no shard committed yet), when it is
    not a bucketeer cache, or when its format version is not this bucketeer's.
    """
    fs, root = open_url(url, storage_options)
    return read_meta(fs, root, url)


def read_meta(fs, root: str, url: str) -> CacheMeta:
    """:func:`read_cache_meta` on an open filesystem (``url``: for messages)."""
    meta = read_artifact_meta(fs, root, url, file=CACHE_FILE, kind=KIND, version=CACHE_FORMAT_VERSION,
                              error=CacheError, missing=CacheMissingError, missing_hint=MISSING_HINT,
                              version_hint=VERSION_HINT)  # fmt: skip
    return CacheMeta.from_json(meta, url)


def _conform_part(table: pa.Table, kind: str, names: Sequence[str] | None = None) -> pa.Table:
    schema = INDEX_SCHEMAS[kind]
    if names is not None:
        schema = pa.schema([schema.field(n) for n in names])
    for name in ("source_key", "generation", "caption_keys", "text_inline", "latent_key"):  # parts older than these
        if name in schema.names and name not in table.column_names:
            table = table.append_column(name, pa.nulls(table.num_rows, schema.field(name).type))
    return table.select(schema.names).cast(schema)


def _read_index_parts(
    fs, root: str, url: str, index: CacheIndex, kind: str, names: Sequence[str] | None = None
) -> pa.Table:
    """The index parts of ``kind`` as written, concatenated in commit order (no supersession applied);
    only the columns ``names`` (in that order) when given."""
    schema = INDEX_SCHEMAS[kind] if names is None else pa.schema([INDEX_SCHEMAS[kind].field(n) for n in names])
    paths = [join(root, p) for p in index.parts(kind)]
    if not paths:
        return schema.empty_table()
    blobs = read_many(fs, paths)  # one concurrent batch on object stores
    tables = []
    for rel, path, data in zip(index.parts(kind), paths, blobs):
        if isinstance(data, FileNotFoundError):
            raise CacheError(f"{redact(url)}: index part {rel} listed in {CACHE_FILE} is missing; "
                             "run `bucketeer verify` and re-embed into a new --out")  # fmt: skip
        if isinstance(data, Exception):
            raise storage_error(fs, "reading", path, data) from data
        try:
            file = pq.ParquetFile(io.BytesIO(data))
            present = None if names is None else [n for n in names if n in file.schema_arrow.names]
            tables.append(_conform_part(file.read(columns=present), kind, names))
        except pa.ArrowInvalid as e:
            raise CacheError(f"{redact(url)}: index part {rel} is not a readable parquet file ({e}); "
                             "run `bucketeer verify` and re-embed into a new --out") from None  # fmt: skip
    return pa.concat_tables(tables)


def newest_rows(samples: pa.Table, errors: pa.Table) -> tuple[pa.Table, pa.Table]:
    """Keep, per sample id, only the newest of its sample and error rows (highest generation).

    Ties (rows written before generations existed) go to the later row, and an error row beats
    a record of the same generation. Returns the surviving ``(samples, errors)`` rows, each in their original order.
    """
    ns = samples.num_rows
    ids = np.concatenate([t.column("sample_id").to_numpy().astype(np.uint64) for t in (samples, errors)])  # (m,)
    gens = np.concatenate([t.column("generation").combine_chunks().fill_null(0).to_numpy(zero_copy_only=False)
                           for t in (samples, errors)]).astype(np.int64)  # (m,) fmt: skip
    if len(np.unique(ids)) == len(ids):
        return samples, errors  # the common case: nothing superseded
    order = np.lexsort((np.arange(len(ids)), gens, ids))  # by id, then generation, then position
    last = np.append(ids[order][1:] != ids[order][:-1], True)  # the newest row of each id
    winners = np.sort(order[last])
    return samples.take(winners[winners < ns]), errors.take(winners[winners >= ns] - ns)


def newest_texts(texts: pa.Table) -> pa.Table:
    """Keep one row per caption key, the last committed (a caption whose text moved into a sample record
    that was embedded again has a row per record; each names a record holding the same text)."""
    keys = texts.column("caption_key").to_numpy().astype(np.uint64)  # (m,)
    if len(np.unique(keys)) == len(keys):
        return texts
    _, last = np.unique(keys[::-1], return_index=True)
    return texts.take(np.sort(len(keys) - 1 - last))


def inline_text_rows(samples: pa.Table) -> pa.Table:
    """The text index rows of the captions that ``samples`` (index rows) hold inline: each names its sample's record."""
    if "text_inline" not in samples.column_names:
        return TEXT_INDEX_SCHEMA.empty_table()
    inline = samples.column("text_inline").combine_chunks().fill_null(False)
    return samples.filter(inline).select(TEXT_INDEX_SCHEMA.names).cast(TEXT_INDEX_SCHEMA)


def read_index(
    url: str,
    storage_options: dict | None = None,
    meta: CacheMeta | CacheIndex | None = None,
    *,
    superseded: bool = False,
    columns: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, pa.Table]:
    """The cache's ``samples``, ``texts`` and ``errors`` index tables (read via ``_cache.json``, or
    ``meta`` when the caller has it, or only the parts of a :class:`CacheIndex`), one concurrent
    read per kind.

    Superseded rows are left out: each sample id appears at most once, in ``samples`` (a record)
    or in ``errors`` (an image that failed), whichever its newest embedding produced. With
    ``superseded`` every row of every part is kept, in commit order (what ``finish`` merges).
    ``columns`` (kind -> names) reads only those columns of a kind; ``sample_id`` and
    ``generation`` are added for samples and errors, which supersession needs.
    Raises CacheError when ``url`` is not a committed cache or an index part is missing.
    """
    fs, root = open_url(url, storage_options)
    meta = meta or read_meta(fs, root, url)
    index = meta if isinstance(meta, CacheIndex) else meta.index
    names: dict[str, list[str] | None] = {kind: None for kind in INDEX_SCHEMAS}
    for kind, wanted in (columns or {}).items():
        extra = ["sample_id", "generation"] if kind != "texts" else []
        names[kind] = list(dict.fromkeys([*extra, *wanted]))
    tables = {kind: _read_index_parts(fs, root, url, index, kind, names[kind]) for kind in INDEX_SCHEMAS}
    if not superseded:
        tables["samples"], tables["errors"] = newest_rows(tables["samples"], tables["errors"])
        tables["texts"] = newest_texts(tables["texts"])
    return tables


def index_lookup(
    url: str, storage_options: dict | None = None, meta: CacheMeta | None = None
) -> tuple[IndexLookup, np.ndarray]:
    """What a resumed embed needs of a committed index, reading only those columns: the freshness
    lookup of its (newest) sample and error rows, and the sorted uint64 caption keys that have a
    text record. Raises CacheError as :func:`read_index` does."""
    tables = read_index(url, storage_options, meta, columns={"samples": ["source_key"], "texts": ["caption_key"],
                                                             "errors": ["source_key", "error"]})  # fmt: skip
    texts = np.unique(tables["texts"].column("caption_key").to_numpy().astype(np.uint64))
    return IndexLookup(tables["samples"], tables["errors"]), texts


def cache_freshness(
    url: str, manifest: Any, storage_options: dict | None = None, index: dict[str, pa.Table] | None = None
) -> Freshness:
    """For each row of ``manifest`` (a Manifest or its samples table): fresh, failed, stale or missing.

    ``index`` is the cache's index as :func:`read_index` returned it, when the caller has read it
    already. Raises CacheError when ``url`` is not a committed cache.
    """
    tables = index if index is not None else read_index(url, storage_options)
    return classify(tables["samples"], tables["errors"], manifest_samples(manifest))


def available_sample_ids(url: str, storage_options: dict | None = None, manifest: Any = None) -> np.ndarray:
    """Sorted uint64 ids of the samples with a committed record (cache error rows excluded).

    With ``manifest`` (a Manifest or its samples table), only the **fresh** ones: records made
    from the manifest row as it is now (same source key; see :mod:`manifests.cache.freshness`).
    """
    if manifest is not None:
        status = cache_freshness(url, manifest, storage_options)
        return np.unique(status.sample_ids[status.fresh])
    ids = read_index(url, storage_options)["samples"].column("sample_id").to_numpy()
    return np.unique(ids.astype(np.uint64))
