"""Writing a cache folder: :class:`ShardWriter` packs records into one shard object,
:class:`CacheWriter` (on the embed job's driver) commits shards, index parts and ``_cache.json``.

The folder layout, the commit protocol and the supersession rule are described in
:mod:`manifests.cache`; this module only writes what that module reads.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
from dataclasses import InitVar, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from manifests import __version__, faults
from manifests.cache.layout import (
    KIND,
    INDEX_SCHEMAS,
    CACHE_ERRORS_SCHEMA,
    CACHE_FILE,
    CACHE_FORMAT_VERSION,
    SHARD_BYTES,
    SHARD_RECORDS,
    CacheError,
    CacheMissingError,
    read_meta,
    table_bytes,
    fingerprint_of,
    newest_rows,
    read_index,
    settings_diff,
)
from manifests.cache.records import crc32
from manifests.storage import call_storage, join, open_url, redact, write_bytes_atomic, write_json_atomic

__all__ = ["ShardWriter", "CacheWriter"]


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

    def commit(self, fs, root: str, generation: int = 0) -> tuple[dict[str, Any], str]:
        """Write the shard, then its index part; returns ``(shard entry, index part path)``.

        ``generation`` is stamped on sample rows (the ``_cache.json`` commit that writes them).
        """
        assert self._rows, "empty shard"
        data = b"".join(self._chunks)
        digest = hashlib.sha256(data).hexdigest()
        shard = f"shards/{self.kind}-{digest[:24]}.bin"
        write_bytes_atomic(fs, join(root, shard), data)
        schema = INDEX_SCHEMAS[self.kind]
        fixed = {"shard": shard, "generation": generation}
        columns = {name: [fixed[name] if name in fixed else r.get(name) for r in self._rows] for name in schema.names}
        table = pa.table(columns, schema=schema)
        blob = table_bytes(table)
        index = f"index/{self.kind}-{hashlib.sha256(blob).hexdigest()[:24]}.parquet"
        write_bytes_atomic(fs, join(root, index), blob)
        entry = {"path": shard, "kind": self.kind, "records": len(self._rows), "bytes": len(data), "sha256": digest}
        self._chunks, self._rows, self._size = [], [], 0
        return entry, index


def _live_bytes(tables: dict[str, pa.Table]) -> dict[str, Any]:
    """Compressed bytes of the live records: totals and means per sample and per caption (None when none)."""
    out: dict[str, Any] = {}
    for kind, per in (("samples", "per_sample"), ("texts", "per_caption")):
        total = int(pc.sum(tables[kind].column("length")).as_py() or 0)
        out[kind] = total
        out[per] = round(total / tables[kind].num_rows) if tables[kind].num_rows else None
    return out


@dataclass
class CacheWriter:
    """Driver-side writer: appends records into shards and commits ``_cache.json`` after each shard.

    Opening refuses an existing cache whose fingerprint differs from ``settings``' (CacheError that
    lists what differs). ``done_samples`` / ``done_texts`` / ``done_errors`` say what is committed
    (newest row per sample id), from ``index`` when the caller has read the committed index already
    (:func:`manifests.cache.read_index`; embed reads it once, for freshness), else read here. A
    sample already in the cache may be added again (its source changed): the new row supersedes
    the old one. Adding one sample twice in one run is a bug.
    """

    url: str
    settings: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)  # non-fingerprinted facts (latent/text layout)
    storage_options: dict | None = None
    shard_records: int = SHARD_RECORDS
    shard_bytes: int = SHARD_BYTES
    index: InitVar[dict[str, pa.Table] | None] = None

    def __post_init__(self, index: dict[str, pa.Table] | None) -> None:
        self.fs, self.root = open_url(self.url, self.storage_options)
        self.fingerprint = fingerprint_of(self.settings)
        now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        try:
            self.meta = read_meta(self.fs, self.root, self.url)
        except CacheMissingError:  # a new cache
            self.meta = {
                "kind": KIND, "format_version": CACHE_FORMAT_VERSION, "created_at": now,
                "fingerprint": self.fingerprint, "settings": self.settings, "shards": [],
                "index": {k: [] for k in INDEX_SCHEMAS}, "counts": {k: 0 for k in INDEX_SCHEMAS}, "manifests": [],
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
        tables = index if index is not None else read_index(self.url, self.storage_options, self.meta)
        self.done_samples = set(tables["samples"].column("sample_id").to_numpy().tolist())
        self.done_texts = set(tables["texts"].column("caption_key").to_numpy().tolist())
        self.done_errors = set(tables["errors"].column("sample_id").to_numpy().tolist())
        self._shards = {k: ShardWriter(k, self.shard_records, self.shard_bytes) for k in ("samples", "texts")}
        self._errors: list[dict[str, Any]] = []
        self._added: set[int] = set()  # sample ids given a record or error row by this writer

    def add_text(self, caption_key: int, data: bytes) -> bool:
        """Queue a text record; returns True when a shard was committed."""
        if caption_key in self.done_texts:
            return False
        self._shards["texts"].append(data, caption_key=caption_key)
        self.done_texts.add(caption_key)
        return self._commit_if_full("texts")

    def _claim(self, sample_id: int) -> None:
        assert sample_id not in self._added, f"sample {sample_id} embedded twice in one run"
        self._added.add(sample_id)

    def add_sample(
        self, sample_id: int, data: bytes, caption_key: int, bucket: str, source_key: int | None = None
    ) -> bool:
        """Queue a sample record made from the manifest row with ``source_key``; True when a shard was committed."""
        self._claim(sample_id)
        self._shards["samples"].append(data, sample_id=sample_id, caption_key=caption_key, bucket=bucket,
                                       source_key=source_key)  # fmt: skip
        self.done_samples.add(sample_id)
        self.done_errors.discard(sample_id)
        return self._commit_if_full("samples")

    def add_error(self, sample_id: int, filename: str, error: str, message: str, source_key: int | None = None) -> None:
        """Record an image that could not be embedded (committed with the next shard)."""
        self._claim(sample_id)
        self._errors.append({"sample_id": sample_id, "filename": filename, "error": error, "message": message,
                             "source_key": source_key})  # fmt: skip
        self.done_errors.add(sample_id)
        self.done_samples.discard(sample_id)

    def _commit_if_full(self, kind: str) -> bool:
        if self._shards[kind].full:
            self.commit(kind)
            return True
        return False

    def commit(self, *kinds: str) -> None:
        """Write the pending shards of ``kinds`` (all when empty) and pending errors, then ``_cache.json``."""
        generation = int(self.meta.get("generation", 0)) + 1
        wrote_samples = "samples" in (kinds or ("samples",)) and len(self._shards["samples"]) > 0
        for kind in kinds or ("texts", "samples"):
            shard = self._shards[kind]
            if len(shard):
                n = len(shard)
                entry, index = shard.commit(self.fs, self.root, generation)
                self.meta["shards"].append(entry)
                self.meta["index"][kind].append(index)
                self.meta["counts"][kind] += n
        if self._errors:
            rows = [{**e, "generation": generation} for e in self._errors]
            table = pa.Table.from_pylist(rows, schema=CACHE_ERRORS_SCHEMA)
            blob = table_bytes(table)
            part = f"index/errors-{hashlib.sha256(blob).hexdigest()[:24]}.parquet"
            write_bytes_atomic(self.fs, join(self.root, part), blob)
            self.meta["index"]["errors"].append(part)
            self.meta["counts"]["errors"] += len(self._errors)
            self._errors = []
        self.meta["generation"] = generation
        self._write_meta()
        if wrote_samples:
            faults.hit("cache.samples_committed")  # tests: kill an embed job between two commits

    def _write_meta(self) -> None:
        self.meta["updated_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        write_json_atomic(self.fs, join(self.root, CACHE_FILE), self.meta)

    def finish(self, manifest_fingerprint: str | None = None, summary: dict | None = None) -> dict:
        """Commit what is pending, merge the index parts into one per kind, mark the cache complete.

        The merged index keeps only the newest row per sample id; ``counts`` become the live rows,
        ``bytes`` their compressed sizes (totals, and the means ``per_sample`` and ``per_caption``).
        """
        self.commit()
        old = {k: list(v) for k, v in self.meta["index"].items()}
        raw = read_index(self.url, self.storage_options, self.meta, superseded=True)
        tables = dict(raw)
        tables["samples"], tables["errors"] = newest_rows(raw["samples"], raw["errors"])
        for kind, key in (("samples", "sample_id"), ("texts", "caption_key"), ("errors", "sample_id")):
            self.meta["counts"][kind] = tables[kind].num_rows
            if len(old[kind]) <= 1 and tables[kind].num_rows == raw[kind].num_rows:
                continue
            blob = table_bytes(tables[kind].sort_by(key))
            part = f"index/{kind}-{hashlib.sha256(blob).hexdigest()[:24]}.parquet"
            write_bytes_atomic(self.fs, join(self.root, part), blob)
            self.meta["index"][kind] = [part]
        if manifest_fingerprint and manifest_fingerprint not in self.meta["manifests"]:
            self.meta["manifests"].append(manifest_fingerprint)
        self.meta["bytes"] = _live_bytes(tables)
        written = sum(s["records"] for s in self.meta["shards"] if s["kind"] == "samples")
        self.meta["superseded_records"] = written - tables["samples"].num_rows  # bytes left in old shards
        self.meta["summary"] = summary or {}
        self.meta["complete"] = True
        self._write_meta()
        keep = {p for parts in self.meta["index"].values() for p in parts}
        for path in {p for parts in old.values() for p in parts} - keep:
            target = join(self.root, path)  # a superseded index part; the committed meta no longer names it
            call_storage(self.fs, "removing", target, lambda: self.fs.rm(target))
        return self.meta
