"""Writing a cache folder: workers write shards, one driver commits their index rows.

- :class:`ShardWriter` (a worker, e.g. an embed encoder actor) packs records into one shard
  object, writes it under a content-addressed name and returns the shard's index rows: a small
  Arrow table, the only thing that travels back to the driver.
- :class:`CacheCommitter` (the driver) collects those rows and commits them: an index part per
  kind, then ``_cache.json``, every ``commit_seconds`` (and at the end of each phase). Its
  metadata stays small: ``_cache.json`` names index parts, never shards, and the parts written by
  one run are merged as they accumulate (:data:`MERGE_FANIN` parts of one size into one part of
  the next), so ``_cache.json`` names O(log rows) parts and every commit rewrites a few KB.
- :class:`CacheWriter` is both in one process (tests, benchmarks, small tools).

Exactly once: a batch of work redone after a worker or node died writes its shard again (maybe
under another name, if the redone bytes differ); only the index rows the committer commits
count, and it commits each sample id and caption key at most once per run (a repeat is dropped
and counted in :attr:`CacheCommitter.redone`). A shard whose rows were never committed is
unreferenced: harmless, no reader ever looks at it (the cache is never listed).

The folder layout, the commit protocol and the supersession rule are described in
:mod:`manifests.cache.layout`; this module only writes what that module reads.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import time
from dataclasses import InitVar, dataclass, field, replace
from typing import Any, Callable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests import __version__, faults
from manifests.cache.layout import (
    CACHE_FILE,
    CACHE_FORMAT_VERSION,
    INDEX_SCHEMAS,
    KIND,
    SHARD_BYTES,
    SHARD_RECORDS,
    CacheError,
    CacheMissingError,
    fingerprint_of,
    inline_text_rows,
    newest_rows,
    newest_texts,
    read_index,
    read_meta,
    settings_diff,
    table_bytes,
)
from manifests.cache.meta import (
    CacheBytes,
    CacheCounts,
    CacheIndex,
    CacheMeta,
    CacheSettings,
    ComputeInfo,
    EmbedSummary,
    RecordsInfo,
)
from manifests.cache.codec import RECORD_LAYOUT, crc32
from manifests.storage import call_storage, join, open_url, redact, write_bytes_atomic, write_json_atomic

__all__ = ["ShardWriter", "CacheCommitter", "CacheWriter", "KeySet", "COMMIT_SECONDS", "MERGE_FANIN"]

COMMIT_SECONDS = 30.0  # default time between commits: what a killed job loses at most
MERGE_FANIN = 8  # this many index parts of one size are merged into one part of the next size
_KEY = {"samples": "sample_id", "errors": "sample_id", "texts": "caption_key"}


class ShardWriter:
    """Packs records into one shard object; :meth:`write` writes it and returns its index rows.

    ``kind`` is ``"samples"`` or ``"texts"``; ``append`` takes the compressed record and the
    index columns other than shard/offset/length/crc32/generation.
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

    def write(self, fs, root: str) -> tuple[pa.Table, int]:
        """Write the shard as ``shards/<kind>-<sha256[:24]>.bin`` (atomic, retried); returns its index
        rows (``INDEX_SCHEMAS[kind]``, generation null: the committer stamps it) and its bytes.
        The writer is empty afterwards. Raises StorageError when storage refuses the write."""
        assert self._rows, "empty shard"
        data = b"".join(self._chunks)
        shard = f"shards/{self.kind}-{hashlib.sha256(data).hexdigest()[:24]}.bin"
        write_bytes_atomic(fs, join(root, shard), data)
        schema = INDEX_SCHEMAS[self.kind]
        columns = {name: [shard if name == "shard" else r.get(name) for r in self._rows] for name in schema.names}
        rows = pa.table(columns, schema=schema)
        self._chunks, self._rows, self._size = [], [], 0
        return rows, len(data)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class KeySet:
    """A growing set of uint64 keys (sample ids, caption keys) in sorted numpy blocks: 8 bytes a
    key, never a Python object per key. A membership test is a binary search per block; recent
    keys are merged into the main block in bulk, so each key is re-sorted O(log n) times."""

    def __init__(self, keys: np.ndarray | None = None) -> None:
        self._sorted = np.unique(np.asarray(keys if keys is not None else [], np.uint64))
        self._recent: list[np.ndarray] = []
        self._recent_rows = 0

    def __len__(self) -> int:
        return len(self._sorted) + self._recent_rows

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """(n,) bool: which of ``keys`` are in the set."""
        keys = np.asarray(keys, np.uint64)
        found = np.zeros(len(keys), bool)
        for block in [self._sorted, *self._recent]:
            if len(block):
                pos = np.minimum(np.searchsorted(block, keys), len(block) - 1)
                found |= block[pos] == keys
        return found

    def add_new(self, keys: np.ndarray) -> np.ndarray:
        """(n,) bool: the first occurrence of each key of ``keys`` not in the set; adds those."""
        keys = np.asarray(keys, np.uint64)
        first = np.zeros(len(keys), bool)
        first[np.unique(keys, return_index=True)[1]] = True
        new = first & ~self.contains(keys)
        self._recent.append(np.sort(keys[new]))
        self._recent_rows += int(new.sum())
        if self._recent_rows > max(1 << 16, len(self._sorted) // 4):
            self._sorted = np.sort(np.concatenate([self._sorted, *self._recent]))
            self._recent, self._recent_rows = [], 0
        return new


def records_info(meta: CacheMeta) -> RecordsInfo:
    """``_cache.json`` ``records`` once this bucketeer writes into the cache of ``meta``: its layouts so far
    (a cache without ``records`` that holds records is ``plain``) and the one written now."""
    before = meta.records.layouts if meta.records else (("plain",) if meta.counts.samples or meta.counts.texts else ())
    return RecordsInfo(layouts=tuple(dict.fromkeys([*before, RECORD_LAYOUT])), layout=RECORD_LAYOUT,
                       high_plane="deflate Huffman-only",
                       low_planes="stored", text="inline_when_unique")  # fmt: skip


def _live_bytes(tables: dict[str, pa.Table]) -> dict[str, Any]:
    """Compressed bytes of the live records: totals and means per sample and per caption (None when none)."""
    out: dict[str, Any] = {}
    texts = tables["texts"]  # a caption held inline in its sample's record is counted with the samples
    texts = texts.filter(pc.invert(pc.starts_with(texts.column("shard"), "shards/samples-")))
    for kind, rows, per in (("samples", tables["samples"], "per_sample"), ("texts", texts, "per_caption")):
        total = int(pc.sum(rows.column("length")).as_py() or 0)
        out[kind] = total
        out[per] = round(total / rows.num_rows) if rows.num_rows else None
    return out


@dataclass
class CacheCommitter:
    """Driver-side commits: index rows in, index parts and ``_cache.json`` out.

    Opening refuses an existing cache whose fingerprint differs from ``settings``' (CacheError that
    lists what differs); ``meta`` is the committed ``_cache.json`` when the caller read it already.
    ``info``: what ``_cache.json`` says besides the settings (``family``, ``latent``, ``text``, ``gzip``,
    ``storage_options``), as JSON, parsed here once into :attr:`meta`.
    :meth:`add` queues rows (repeats of a key already queued in this run are dropped),
    :meth:`commit` writes them with a new generation; :meth:`due` says when ``commit_seconds``
    have passed since the last commit. ``clock`` (monotonic seconds) is there for tests.
    """

    url: str
    settings: dict[str, Any]  # exactly as hashed into the fingerprint
    info: Mapping[str, Any] = field(default_factory=dict)  # non-fingerprinted facts (latent/text layout)
    storage_options: dict | None = None
    meta: CacheMeta | None = None
    commit_seconds: float = COMMIT_SECONDS
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.fs, self.root = open_url(self.url, self.storage_options)
        self.fingerprint = fingerprint_of(self.settings)
        if self.meta is None:
            try:
                self.meta = read_meta(self.fs, self.root, self.url)
            except CacheMissingError:  # a new cache
                self.meta = CacheMeta(kind=KIND, format_version=CACHE_FORMAT_VERSION, created_at=_now(),
                                      fingerprint=self.fingerprint, settings=CacheSettings.from_json(self.settings),
                                      index=CacheIndex(), counts=CacheCounts(), manifests=())  # fmt: skip
        if self.meta.fingerprint != self.fingerprint:
            diff = settings_diff(self.meta.settings.to_json(), self.settings)
            raise CacheError(
                f"{redact(self.url)} was embedded with other settings (fingerprint "
                f"{self.meta.fingerprint[:12]} vs {self.fingerprint[:12]}); differences:\n  "
                + "\n  ".join(diff or ["(settings equal but fingerprints differ: other bucketeer format)"])
                + "\nMixing them would silently train on inconsistent tensors: use a new --out for these settings."
            )
        meta = self.meta.to_json()
        meta.pop("shards", None)  # written by bucketeer before 0.2: a list of every shard, no longer kept
        self.meta = CacheMeta.from_json({**meta, **self.info, "tool_version": __version__, "complete": False,
                                         "records": records_info(self.meta).to_json()}, self.url)  # fmt: skip
        self._pending: dict[str, list[pa.Table]] = {k: [] for k in INDEX_SCHEMAS}
        self._seen = {"samples": KeySet(), "texts": KeySet()}  # errors share the samples' keys
        self._parts: dict[str, list[tuple[str, int]]] = {k: [] for k in INDEX_SCHEMAS}  # (path, level) of this run
        self._last = self.clock()
        self.redone = 0  # rows dropped because their key was committed already in this run
        self.metadata_bytes = 0  # bytes of _cache.json written by this committer
        self.index_bytes = 0  # bytes of index parts written (merges included)

    def add(self, kind: str, rows: pa.Table) -> int:
        """Queue index rows of ``kind`` (``INDEX_SCHEMAS[kind]``, generation ignored); returns how
        many were new (a key queued before in this run is dropped: redone work). Sample rows whose
        record holds its caption's text (``text_inline``) also queue that caption's text row, naming
        the same record."""
        if kind == "samples":
            self.add("texts", inline_text_rows(rows))
        keep = self._seen["texts" if kind == "texts" else "samples"].add_new(rows.column(_KEY[kind]).to_numpy())
        if not keep.all():
            self.redone += int((~keep).sum())
            rows = rows.filter(pa.array(keep))
        if rows.num_rows:
            self._pending[kind].append(rows)
        return rows.num_rows

    @property
    def pending(self) -> int:
        return sum(t.num_rows for tables in self._pending.values() for t in tables)

    def due(self) -> bool:
        """True when rows are queued and ``commit_seconds`` have passed since the last commit."""
        return self.pending > 0 and self.clock() - self._last >= self.commit_seconds

    def set_compute(self, compute: ComputeInfo) -> None:
        """Where the encoders ran (not fingerprinted); written with the next commit."""
        self.meta = replace(self.meta, compute=compute)

    def _set_index(self, index: dict[str, list[str]], counts: dict[str, int], **changes: Any) -> None:
        self.meta = replace(self.meta, index=replace(self.meta.index, **{k: tuple(v) for k, v in index.items()}),
                            counts=replace(self.meta.counts, **counts), **changes)  # fmt: skip

    def commit(self) -> None:
        """Write the queued rows as one index part per kind (generation: this commit's number), merge
        parts of this run that reached :data:`MERGE_FANIN` of a size, then write ``_cache.json``."""
        generation = int(self.meta.generation or 0) + 1
        wrote_samples = bool(self._pending["samples"])
        index = {k: list(self.meta.index.parts(k)) for k in INDEX_SCHEMAS}
        counts = {k: self.meta.counts.to_json()[k] for k in INDEX_SCHEMAS}
        removed: list[str] = []
        for kind, tables in self._pending.items():
            if not tables:
                continue
            rows = pa.concat_tables(tables)
            if "generation" in rows.column_names:
                rows = rows.set_column(rows.column_names.index("generation"), "generation",
                                       pa.array(np.full(rows.num_rows, generation, np.int64)))  # fmt: skip
            index[kind].append(self._write_part(kind, rows))
            counts[kind] += rows.num_rows
            self._parts[kind].append((index[kind][-1], 0))
            removed += self._merge(kind, index[kind])
            self._pending[kind] = []
        self._set_index(index, counts, generation=generation)
        self._write_meta()
        self._remove(removed)
        self._last = self.clock()
        if wrote_samples:
            faults.hit("cache.samples_committed")  # tests: stop or kill an embed job between two commits

    def _write_part(self, kind: str, rows: pa.Table) -> str:
        blob = table_bytes(rows)
        part = f"index/{kind}-{hashlib.sha256(blob).hexdigest()[:24]}.parquet"
        write_bytes_atomic(self.fs, join(self.root, part), blob)
        self.index_bytes += len(blob)
        return part

    def _merge(self, kind: str, names: list[str]) -> list[str]:
        """Merge the newest MERGE_FANIN parts of this run while they share a level (``names``: the
        parts of ``kind`` to commit, changed in place); returns the replaced parts (removed once the
        new ``_cache.json`` no longer names them)."""
        removed: list[str] = []
        parts = self._parts[kind]
        while len(parts) >= MERGE_FANIN and len({level for _, level in parts[-MERGE_FANIN:]}) == 1:
            group, level = [p for p, _ in parts[-MERGE_FANIN:]], parts[-1][1]
            rows = read_index(self.url, self.storage_options, CacheIndex(**{kind: tuple(group)}),
                              superseded=True)[kind]  # fmt: skip
            merged = self._write_part(kind, rows)  # commit order kept: supersession reads generations
            assert names[-MERGE_FANIN:] == group
            names[-MERGE_FANIN:] = [merged]
            parts[-MERGE_FANIN:] = [(merged, level + 1)]
            removed += group
        return removed

    def _remove(self, paths: list[str]) -> None:
        keep = {p for kind in INDEX_SCHEMAS for p in self.meta.index.parts(kind)}
        for path in set(paths) - keep:  # no committed _cache.json names it any more
            target = join(self.root, path)
            call_storage(self.fs, "removing", target, lambda: self.fs.rm(target))

    def _write_meta(self) -> None:
        self.meta = replace(self.meta, updated_at=_now())
        self.metadata_bytes += write_json_atomic(self.fs, join(self.root, CACHE_FILE), self.meta.to_json())

    def finish(self, manifest_fingerprint: str | None = None, summary: EmbedSummary | None = None) -> CacheMeta:
        """Commit what is queued, merge the index parts into one per kind, mark the cache complete.

        The merged index keeps only the newest row per sample id; ``counts`` become the live rows,
        ``bytes`` their compressed sizes (totals, and the means ``per_sample`` and ``per_caption``),
        ``superseded_records`` the sample records that newer ones replaced (their bytes stay in
        old shards, unreferenced). ``summary``: what this run did (None: written as ``{}``).
        """
        if self.pending:
            self.commit()
        old = {k: list(self.meta.index.parts(k)) for k in INDEX_SCHEMAS}
        raw = read_index(self.url, self.storage_options, self.meta, superseded=True)
        tables = dict(raw)
        tables["samples"], tables["errors"] = newest_rows(raw["samples"], raw["errors"])
        tables["texts"] = newest_texts(raw["texts"])
        index, counts = dict(old), {}
        for kind, key in _KEY.items():
            counts[kind] = tables[kind].num_rows
            if len(old[kind]) <= 1 and tables[kind].num_rows == raw[kind].num_rows:
                continue
            index[kind] = [self._write_part(kind, tables[kind].sort_by(key))]
        manifests = self.meta.manifests
        if manifest_fingerprint and manifest_fingerprint not in manifests:
            manifests = (*manifests, manifest_fingerprint)
        self._set_index(index, counts, manifests=manifests, bytes=CacheBytes(**_live_bytes(tables)),
                        superseded_records=raw["samples"].num_rows - tables["samples"].num_rows,
                        summary=summary or EmbedSummary.from_json({}), complete=True)  # fmt: skip
        self._write_meta()
        self._remove([p for parts in old.values() for p in parts])
        return self.meta


@dataclass
class CacheWriter:
    """Shards and commits in one process: appends records into shards and commits after each shard.

    Opening refuses an existing cache whose fingerprint differs from ``settings``' (CacheError that
    lists what differs). ``done_samples`` / ``done_texts`` / ``done_errors`` say what is committed
    (newest row per sample id), from ``index`` when the caller has read the committed index already
    (:func:`manifests.cache.read_index`), else read here. A sample already in the cache may be
    added again (its source changed): the new row supersedes the old one. Adding one sample twice
    in one run is a bug. The embed job does not use it: its workers write shards
    (:class:`ShardWriter`) and its driver commits (:class:`CacheCommitter`).
    """

    url: str
    settings: dict[str, Any]
    info: Mapping[str, Any] = field(default_factory=dict)
    storage_options: dict | None = None
    shard_records: int = SHARD_RECORDS
    shard_bytes: int = SHARD_BYTES
    index: InitVar[dict[str, pa.Table] | None] = None

    def __post_init__(self, index: dict[str, pa.Table] | None) -> None:
        self.committer = CacheCommitter(self.url, self.settings, self.info, self.storage_options, commit_seconds=0)
        tables = index if index is not None else read_index(self.url, self.storage_options, self.meta)
        self.done_samples = set(tables["samples"].column("sample_id").to_numpy().tolist())
        self.done_texts = set(tables["texts"].column("caption_key").to_numpy().tolist())
        self.done_errors = set(tables["errors"].column("sample_id").to_numpy().tolist())
        self._shards = {k: ShardWriter(k, self.shard_records, self.shard_bytes) for k in ("samples", "texts")}
        self._errors: list[dict[str, Any]] = []
        self._added: set[int] = set()  # sample ids given a record or error row by this writer

    @property
    def meta(self) -> CacheMeta:
        """``_cache.json`` as committed last (or to be committed first)."""
        return self.committer.meta

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
        self, sample_id: int, data: bytes, caption_key: int, bucket: str, source_key: int | None = None,
        caption_keys: list[int] | None = None, text_inline: bool = False,
    ) -> bool:
        """Queue a sample record made from the manifest row with ``source_key``; True when a shard was committed.

        ``caption_keys``: the keys of all the sample's captions when it has several (the first is ``caption_key``).
        ``text_inline``: ``data`` holds the caption's text too (``encode_sample(..., inline_text=True)``, a
        caption no other sample has): the caption needs no :meth:`add_text`, and its text row names this record.
        """
        self._claim(sample_id)
        self._shards["samples"].append(data, sample_id=sample_id, caption_key=caption_key, bucket=bucket,
                                       source_key=source_key, caption_keys=caption_keys,
                                       text_inline=text_inline)  # fmt: skip
        if text_inline:
            self.done_texts.add(caption_key)
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
        """Write the pending shards of ``kinds`` (all when empty) and pending errors, then commit."""
        for kind in kinds or ("texts", "samples"):
            if len(self._shards[kind]):
                rows, _ = self._shards[kind].write(self.committer.fs, self.committer.root)
                self.committer.add(kind, rows)
        if self._errors:
            self.committer.add("errors", pa.Table.from_pylist(self._errors, schema=INDEX_SCHEMAS["errors"]))
            self._errors = []
        self.committer.commit()

    def finish(self, manifest_fingerprint: str | None = None, summary: EmbedSummary | None = None) -> CacheMeta:
        """Commit what is pending, merge the index parts into one per kind, mark the cache complete."""
        self.commit()
        return self.committer.finish(manifest_fingerprint, summary)
