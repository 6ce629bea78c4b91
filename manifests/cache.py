"""The cache folder: shards of records, their index, ``_cache.json``, the writer and the reader.

Layout of ``CACHE/`` (every name below is listed in ``_cache.json``; nothing is ever listed)::

    _cache.json                          settings + fingerprint, shard and index parts, counts
    shards/samples-<sha256[:24]>.bin     concatenated sample records (latent + geometry)
    shards/texts-<sha256[:24]>.bin       concatenated text records, one per unique caption
    index/samples-<sha>.parquet          sample_id, shard, offset, length, crc32, caption_key, bucket
    index/texts-<sha>.parquet            caption_key, shard, offset, length, crc32
    index/errors-<sha>.parquet           sample_id, filename, error, message (images that failed)

A record is ``gzip(safetensors)`` (:mod:`manifests.cache_format`), readable alone with one ranged
read. Writing is a sequence of commits: shard objects and index parts first (content-addressed,
so a rerun never overwrites a different object under a committed name), then ``_cache.json``
atomically. A job killed between commits leaves at most unreferenced objects; the committed state
is always consistent and a resumed job embeds exactly the samples the index lacks. One writer at a
time per cache folder.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from manifests import __version__
from manifests.cache_format import crc32
from manifests.storage import join, open_url, read_json, redact, write_bytes_atomic, write_json_atomic

__all__ = [
    "CACHE_FILE",
    "CACHE_FORMAT_VERSION",
    "CacheError",
    "SAMPLE_INDEX_SCHEMA",
    "TEXT_INDEX_SCHEMA",
    "CACHE_ERRORS_SCHEMA",
    "fingerprint_of",
    "settings_diff",
    "read_cache_meta",
    "read_index",
    "available_sample_ids",
    "ShardWriter",
    "CacheWriter",
    "CacheReader",
]

CACHE_FILE = "_cache.json"
CACHE_FORMAT_VERSION = 1
_KIND = "bucketeer.cache"
SHARD_RECORDS = 1024  # records per shard: ~100 MB of SDXL latents, few enough objects for any store
SHARD_BYTES = 256 << 20

SAMPLE_INDEX_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.uint64(), nullable=False),
        pa.field("shard", pa.string(), nullable=False),  # path relative to the cache root
        pa.field("offset", pa.int64(), nullable=False),  # bytes into the shard
        pa.field("length", pa.int64(), nullable=False),  # bytes of the compressed record
        pa.field("crc32", pa.uint32(), nullable=False),  # of the compressed record
        pa.field("caption_key", pa.uint64(), nullable=False),  # -> texts index
        pa.field("bucket", pa.string(), nullable=False),  # "WxH"
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
    ]
)
_SCHEMAS = {"samples": SAMPLE_INDEX_SCHEMA, "texts": TEXT_INDEX_SCHEMA, "errors": CACHE_ERRORS_SCHEMA}


class CacheError(ValueError):
    """A cache folder that is missing, of another version or settings, or has a bad record."""


def fingerprint_of(settings: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of the preprocessing settings (encoders, weights, dtype, crop...)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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


def settings_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable ``key: old -> new`` lines for every setting that differs."""
    a, b = _flatten(old), _flatten(new)
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in sorted(set(a) | set(b))
            if a.get(k, "<absent>") != b.get(k, "<absent>")]  # fmt: skip


def _table_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def read_cache_meta(url: str, storage_options: dict | None = None) -> dict:
    """Read and check ``CACHE/_cache.json``.

    Raises CacheError when the folder has none (not a cache, or no shard committed yet), when it is
    not a bucketeer cache, or when its format version is not this bucketeer's.
    """
    fs, root = open_url(url, storage_options)
    return _read_meta(fs, root, url)


def _read_meta(fs, root: str, url: str) -> dict:
    try:
        meta = read_json(fs, join(root, CACHE_FILE))
    except FileNotFoundError:
        raise CacheError(
            f"{redact(url)} has no {CACHE_FILE}: it is not a bucketeer cache, or its embed job has not "
            "committed a shard yet. Run `bucketeer embed MANIFEST --out CACHE` to build it."
        ) from None
    except json.JSONDecodeError as e:
        raise CacheError(f"{redact(url)}/{CACHE_FILE} is not valid JSON ({e.msg})") from None
    if not isinstance(meta, dict) or meta.get("kind") != _KIND:
        raise CacheError(f"{redact(url)}/{CACHE_FILE} is not a bucketeer cache (kind={meta.get('kind')!r})")
    if meta.get("format_version") != CACHE_FORMAT_VERSION:
        raise CacheError(
            f"{redact(url)} has cache format version {meta.get('format_version')!r}; this bucketeer reads "
            f"version {CACHE_FORMAT_VERSION}. Re-embed into a new --out, or use the bucketeer that wrote it."
        )
    return meta


def _read_parts(fs, root: str, url: str, meta: dict, kind: str) -> pa.Table:
    paths = [join(root, p) for p in meta["index"][kind]]
    if not paths:
        return _SCHEMAS[kind].empty_table()
    blobs = fs.cat(paths, on_error="return")  # one concurrent batch on object stores
    tables = []
    for rel, path in zip(meta["index"][kind], paths):
        data = blobs.get(path) if isinstance(blobs, dict) else blobs
        if isinstance(data, BaseException) or data is None:
            raise CacheError(f"{redact(url)}: index part {rel} listed in {CACHE_FILE} is missing or unreadable; "
                             "run `bucketeer verify` and re-embed into a new --out")  # fmt: skip
        tables.append(pq.read_table(io.BytesIO(data)).select(_SCHEMAS[kind].names).cast(_SCHEMAS[kind]))
    return pa.concat_tables(tables)


def read_index(url: str, storage_options: dict | None = None, meta: dict | None = None) -> dict[str, pa.Table]:
    """The cache's ``samples``, ``texts`` and ``errors`` index tables (read via ``_cache.json``)."""
    fs, root = open_url(url, storage_options)
    meta = meta or _read_meta(fs, root, url)
    return {kind: _read_parts(fs, root, url, meta, kind) for kind in _SCHEMAS}


def available_sample_ids(url: str, storage_options: dict | None = None) -> np.ndarray:
    """Sorted uint64 ids of the samples with a committed record (cache error rows excluded)."""
    fs, root = open_url(url, storage_options)
    meta = _read_meta(fs, root, url)
    ids = _read_parts(fs, root, url, meta, "samples").column("sample_id").to_numpy()
    return np.unique(ids.astype(np.uint64))


class ShardWriter:
    """Packs records into one shard object; :meth:`commit` writes it and its index part.

    ``kind`` is ``"samples"`` or ``"texts"``; ``append`` takes the compressed record and the
    index columns other than shard/offset/length/crc32.
    """

    def __init__(self, kind: str, max_records: int = SHARD_RECORDS, max_bytes: int = SHARD_BYTES):
        assert kind in ("samples", "texts")
        self.kind = kind
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._chunks: list[bytes] = []
        self._rows: list[dict[str, Any]] = []
        self._size = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def full(self) -> bool:
        return len(self._rows) >= self.max_records or self._size >= self.max_bytes

    def append(self, data: bytes, **columns: Any) -> None:
        self._rows.append({**columns, "offset": self._size, "length": len(data), "crc32": crc32(data)})
        self._chunks.append(data)
        self._size += len(data)

    def commit(self, fs, root: str) -> tuple[dict[str, Any], str]:
        """Write the shard, then its index part; returns ``(shard entry, index part path)``."""
        assert self._rows, "empty shard"
        data = b"".join(self._chunks)
        digest = hashlib.sha256(data).hexdigest()
        shard = f"shards/{self.kind}-{digest[:24]}.bin"
        write_bytes_atomic(fs, join(root, shard), data)
        schema = _SCHEMAS[self.kind]
        columns = {name: [r.get(name, shard) for r in self._rows] for name in schema.names}
        table = pa.table(columns, schema=schema)
        blob = _table_bytes(table)
        index = f"index/{self.kind}-{hashlib.sha256(blob).hexdigest()[:24]}.parquet"
        write_bytes_atomic(fs, join(root, index), blob)
        entry = {"path": shard, "kind": self.kind, "records": len(self._rows), "bytes": len(data), "sha256": digest}
        self._chunks, self._rows, self._size = [], [], 0
        return entry, index


@dataclass
class CacheWriter:
    """Driver-side writer: appends records into shards and commits ``_cache.json`` after each shard.

    Opening refuses an existing cache whose fingerprint differs from ``settings``' (CacheError that
    lists what differs). ``done_samples`` / ``done_texts`` / ``done_errors`` say what is committed.
    """

    url: str
    settings: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)  # non-fingerprinted facts (latent/text layout)
    storage_options: dict | None = None
    shard_records: int = SHARD_RECORDS
    shard_bytes: int = SHARD_BYTES

    def __post_init__(self) -> None:
        self.fs, self.root = open_url(self.url, self.storage_options)
        self.fingerprint = fingerprint_of(self.settings)
        now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        try:
            self.meta = _read_meta(self.fs, self.root, self.url)
        except CacheError as e:
            if f"no {CACHE_FILE}" not in str(e):
                raise
            self.meta = {
                "kind": _KIND, "format_version": CACHE_FORMAT_VERSION, "created_at": now,
                "fingerprint": self.fingerprint, "settings": self.settings, "shards": [],
                "index": {k: [] for k in _SCHEMAS}, "counts": {k: 0 for k in _SCHEMAS}, "manifests": [],
            }  # fmt: skip
        if self.meta["fingerprint"] != self.fingerprint:
            diff = settings_diff(self.meta.get("settings", {}), self.settings)
            raise CacheError(
                f"{redact(self.url)} was embedded with other settings (fingerprint "
                f"{self.meta['fingerprint'][:12]} vs {self.fingerprint[:12]}); differences:\n  "
                + "\n  ".join(diff or ["(settings equal but fingerprints differ: other bucketeer format)"])
                + "\nMixing them would silently train on inconsistent tensors: use a new --out for these settings."
            )
        self.meta.update(self.info, tool_version=__version__, complete=False)
        tables = read_index(self.url, self.storage_options, self.meta)
        self.done_samples = set(tables["samples"].column("sample_id").to_numpy().tolist())
        self.done_texts = set(tables["texts"].column("caption_key").to_numpy().tolist())
        self.done_errors = set(tables["errors"].column("sample_id").to_numpy().tolist())
        self._shards = {k: ShardWriter(k, self.shard_records, self.shard_bytes) for k in ("samples", "texts")}
        self._errors: list[dict[str, Any]] = []
        self.commits = 0

    def add_text(self, caption_key: int, data: bytes) -> bool:
        """Queue a text record; returns True when a shard was committed."""
        if caption_key in self.done_texts:
            return False
        self._shards["texts"].append(data, caption_key=caption_key)
        self.done_texts.add(caption_key)
        return self._commit_if_full("texts")

    def add_sample(self, sample_id: int, data: bytes, caption_key: int, bucket: str) -> bool:
        """Queue a sample record; returns True when a shard was committed."""
        assert sample_id not in self.done_samples, f"sample {sample_id} embedded twice"
        self._shards["samples"].append(data, sample_id=sample_id, caption_key=caption_key, bucket=bucket)
        self.done_samples.add(sample_id)
        return self._commit_if_full("samples")

    def add_error(self, sample_id: int, filename: str, error: str, message: str) -> None:
        """Record an image that could not be embedded (committed with the next shard)."""
        self._errors.append({"sample_id": sample_id, "filename": filename, "error": error, "message": message})
        self.done_errors.add(sample_id)

    def _commit_if_full(self, kind: str) -> bool:
        if self._shards[kind].full:
            self.commit(kind)
            return True
        return False

    def commit(self, *kinds: str) -> None:
        """Write the pending shards of ``kinds`` (all when empty) and pending errors, then ``_cache.json``."""
        for kind in kinds or ("texts", "samples"):
            shard = self._shards[kind]
            if len(shard):
                n = len(shard)
                entry, index = shard.commit(self.fs, self.root)
                self.meta["shards"].append(entry)
                self.meta["index"][kind].append(index)
                self.meta["counts"][kind] += n
        if self._errors:
            table = pa.Table.from_pylist(self._errors, schema=CACHE_ERRORS_SCHEMA)
            blob = _table_bytes(table)
            part = f"index/errors-{hashlib.sha256(blob).hexdigest()[:24]}.parquet"
            write_bytes_atomic(self.fs, join(self.root, part), blob)
            self.meta["index"]["errors"].append(part)
            self.meta["counts"]["errors"] += len(self._errors)
            self._errors = []
        self._write_meta()
        self.commits += 1

    def _write_meta(self) -> None:
        self.meta["updated_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        write_json_atomic(self.fs, join(self.root, CACHE_FILE), self.meta)

    def finish(self, manifest_fingerprint: str | None = None, summary: dict | None = None) -> dict:
        """Commit what is pending, merge the index parts into one per kind, mark the cache complete."""
        self.commit()
        old = {k: list(v) for k, v in self.meta["index"].items()}
        tables = read_index(self.url, self.storage_options, self.meta)
        for kind, key in (("samples", "sample_id"), ("texts", "caption_key"), ("errors", "sample_id")):
            if len(old[kind]) <= 1:
                continue
            blob = _table_bytes(tables[kind].sort_by(key))
            part = f"index/{kind}-{hashlib.sha256(blob).hexdigest()[:24]}.parquet"
            write_bytes_atomic(self.fs, join(self.root, part), blob)
            self.meta["index"][kind] = [part]
        if manifest_fingerprint and manifest_fingerprint not in self.meta["manifests"]:
            self.meta["manifests"].append(manifest_fingerprint)
        self.meta["summary"] = summary or {}
        self.meta["complete"] = True
        self._write_meta()
        keep = {p for parts in self.meta["index"].values() for p in parts}
        for path in {p for parts in old.values() for p in parts} - keep:
            self.fs.rm(join(self.root, path))  # superseded index parts; the committed meta no longer names them
        return self.meta


# the reader lives in its own module (one job each); importing it here keeps `manifests.cache.CacheReader`
from manifests.cache_reader import CacheReader  # noqa: E402
