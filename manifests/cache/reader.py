"""Random access to a committed cache: records by sample id, one ranged read each, batched.

The reader loads ``_cache.json`` and the index once and never lists storage afterwards; the
trainer constructs one per process (it is picklable for DataLoader workers) and calls ``read``,
from several threads at once if it likes: ``read`` is thread-safe.
Records of one shard that lie within ``max_gap`` bytes of each other are fetched with one ranged
read (:func:`merge_reads`): on an object store a request costs far more than a few KB of gap.
For a window-shuffled plan (``bucketeer plan --shuffle window``), whose next steps draw on a few
contiguous ranges of records, :meth:`CacheReader.read_in_chunks` makes the reader fetch whole aligned
chunks of a shard (one GET per chunk, adjacent ones merged) and keep them in a byte-bounded LRU, so a
window costs about its bytes / the chunk size in requests instead of one request per record.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Sequence

import numpy as np
import pyarrow.compute as pc

from manifests.cache.layout import TEXT_INDEX_SCHEMA, CacheError, read_meta, read_index
from manifests.cache.meta import CacheMeta
from manifests.cache.records import (
    RecordError,
    SampleRecord,
    TextRecord,
    crc32,
    decode_sample,
    decode_text,
    sample_mismatch,
    text_mismatch,
)
from manifests.localfiles import LocalFiles
from manifests.storage import is_local, join, open_url, read_many, redact, storage_error

__all__ = ["CacheReader", "merge_reads", "MAX_GAP", "MAX_BLOCK", "CHUNK_BYTES"]

MAX_GAP = 64 << 10  # bytes: ~one request's latency worth of transfer on S3-like stores
MAX_BLOCK = 16 << 20  # bytes: never fetch more than this in one merged read
CHUNK_BYTES = 8 << 20  # bytes: the aligned chunk read_in_chunks fetches (~25 SDXL-512 records)


def merge_reads(
    ranges: Sequence[tuple[str, int, int]], max_gap: int | None = MAX_GAP, max_block: int = MAX_BLOCK
) -> tuple[list[tuple[str, int, int]], list[tuple[int, int]]]:
    """Merge byte ranges ``(path, start, end)`` of one object that are at most ``max_gap`` apart.

    Returns ``(reads, where)``: the reads to issue, and per input range ``(read index, offset of
    the range in that read)``. Repeated and overlapping ranges share a read. ``max_gap=None``
    merges nothing (one read per range); a merged read never grows past ``max_block`` bytes.
    """
    if max_gap is None:
        return list(ranges), [(i, 0) for i in range(len(ranges))]
    reads: list[tuple[str, int, int]] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(ranges)
    for i in sorted(range(len(ranges)), key=lambda k: ranges[k]):
        path, start, end = ranges[i]
        if reads:
            p, s, e = reads[-1]
            if p == path and start - e <= max_gap and max(e, end) - s <= max_block:
                reads[-1] = (p, s, max(e, end))
                where[i] = (len(reads) - 1, start - s)
                continue
        reads.append((path, start, end))
        where[i] = (len(reads) - 1, 0)
    return reads, where


class CacheReader:
    """Random access to committed records by sample id: one ranged read per record, batched.

    Loads ``_cache.json`` and the index once at construction and never lists storage afterwards.
    Text records are joined into each :class:`SampleRecord`: a caption only that sample has is inside
    its record (``text_inline``: one ranged read); a shared caption's text record is read apart, and
    recently read ones are kept in a small LRU since such captions repeat. ``read`` may be called from several
    threads at once (the LRU is the only state it changes, and it is changed under a lock).
    """

    def __init__(
        self,
        url: str,
        storage_options: dict | None = None,
        text_cache_size: int = 4096,
        max_gap: int | None = MAX_GAP,
    ):
        self.url = url
        self.max_gap = max_gap  # merge reads of records this close in a shard; None: one read per record
        self.fs, self.root = open_url(url, storage_options)
        self._files = self._local_files()  # a local cache: shard files held open, read by pread
        self.meta: CacheMeta = read_meta(self.fs, self.root, url)
        tables = read_index(url, storage_options, self.meta)
        samples = tables["samples"].sort_by("sample_id")
        self._ids = samples.column("sample_id").to_numpy().astype(np.uint64)  # (n,) sorted
        self._samples = {name: samples.column(name).to_numpy() for name in ("offset", "length", "crc32", "caption_key")}
        # (n,) the record holds its (only) caption's text: one ranged read gives both
        self._inline = samples.column("text_inline").combine_chunks().fill_null(False).to_numpy(zero_copy_only=False)
        # every caption key of a sample with several captions: flat keys + where each sample's start (0 long: none)
        lists = samples.column("caption_keys").combine_chunks()
        self._caption_counts = pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False)  # (n,)
        self._caption_starts = np.cumsum(self._caption_counts) - self._caption_counts  # (n,)
        self._caption_flat = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.uint64)
        shard = samples.column("shard").combine_chunks().dictionary_encode()
        self._sample_shard = shard.indices.to_numpy(zero_copy_only=False)
        self._sample_shard_names = shard.dictionary.to_pylist()
        texts = tables["texts"]
        self._texts = {
            int(k): (s, int(o), int(n), int(c))
            for k, s, o, n, c in zip(*(texts.column(c).to_pylist() for c in TEXT_INDEX_SCHEMA.names))
        }
        self._text_lru: OrderedDict[int, TextRecord] = OrderedDict()
        self._text_lru_size = text_cache_size
        self._text_lock = threading.Lock()  # guards _text_lru and _chunks: concurrent reads look up, insert, evict
        self.chunk_bytes: int | None = None  # read_in_chunks: aligned chunks fetched whole, kept in _chunks
        self._chunks: OrderedDict[tuple[str, int], memoryview] = OrderedDict()
        self._chunks_held, self._chunk_budget = 0, 0
        ends = np.asarray(self._samples["offset"], np.int64) + np.asarray(self._samples["length"], np.int64)
        self._shard_end: dict[str, int] = {}  # bytes of each shard the index names (a chunk never reads past it)
        if len(ends):
            per_shard = np.zeros(len(self._sample_shard_names), np.int64)
            np.maximum.at(per_shard, self._sample_shard, ends)
            self._shard_end = dict(zip(self._sample_shard_names, per_shard.tolist()))
        for shard, offset, length, _ in self._texts.values():
            self._shard_end[shard] = max(self._shard_end.get(shard, 0), offset + length)

    def read_in_chunks(self, chunk_bytes: int = CHUNK_BYTES, budget_bytes: int = 256 << 20) -> None:
        """From now on fetch records by whole aligned ``chunk_bytes`` chunks of their shard, keeping up to
        ``budget_bytes`` of chunks (least recently used dropped first). For plans whose steps read
        contiguous runs of records (a window shuffle); under a full shuffle it would read ~chunk / record
        times the bytes. Raises ValueError for a chunk or budget below 1 byte."""
        if chunk_bytes < 1 or budget_bytes < 1:
            raise ValueError(f"chunk_bytes ({chunk_bytes}) and budget_bytes ({budget_bytes}) must be >= 1")
        with self._text_lock:
            self.chunk_bytes, self._chunk_budget = chunk_bytes, budget_bytes

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_text_lock"], state["_files"]  # locks and descriptors do not pickle; a copy gets its own
        state.update(_chunks=OrderedDict(), _chunks_held=0)  # nor are held chunks worth shipping
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._text_lock = threading.Lock()
        self._files = self._local_files()

    def _local_files(self) -> LocalFiles | None:
        """Held shard files for a local cache (one ``pread`` per range), None elsewhere (or without ``os.pread``)."""
        return LocalFiles() if LocalFiles.available and is_local(self.fs) else None

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def sample_ids(self) -> np.ndarray:
        """Sorted uint64 ids of all readable samples."""
        return self._ids

    def _locate(self, sample_ids: Sequence[int]) -> np.ndarray:
        want = np.asarray(sample_ids, dtype=np.uint64)  # (k,)
        pos = np.searchsorted(self._ids, want)
        found = (pos < len(self._ids)) & (self._ids[np.minimum(pos, len(self._ids) - 1)] == want)
        if not found.all():
            missing = want[~found][:5].tolist()
            raise CacheError(f"samples {missing} are not in cache {redact(self.url)} (not embedded, or an error row); "
                             "plan with --cache so plans only hold cached samples")  # fmt: skip
        return pos

    def _fetch(self, items: list[tuple[str, int, int, int, str]]) -> list[bytes]:
        """Ranged reads of ``(shard, offset, length, crc32, what)``; checks length and checksum.

        A missing shard is a CacheError (a bad cache); any other failed read (after the retries of
        :func:`manifests.storage.read_many`) a StorageError: the records may be fine.
        """
        if not items:
            return []
        if self.chunk_bytes:
            got = self._read_chunked([(s, o, o + n) for s, o, n, *_ in items])
        else:
            reads, where = merge_reads([(join(self.root, s), o, o + n) for s, o, n, *_ in items], self.max_gap)
            blocks = read_many(self.fs, *(list(c) for c in zip(*reads)), files=self._files)
            got = [(reads[k][0], blocks[k] if isinstance(blocks[k], Exception) else blocks[k][at : at + n])
                   for (_, _, n, *_), (k, at) in zip(items, where)]  # fmt: skip
        out = []
        for (shard, offset, length, crc, what), (path, blob) in zip(items, got):
            if isinstance(blob, FileNotFoundError):
                raise CacheError(self._bad(what, shard, "shard is missing"))
            if isinstance(blob, Exception):
                raise storage_error(self.fs, f"reading {what} from", path, blob) from blob
            # short if truncated
            if len(blob) != length:
                raise CacheError(self._bad(what, shard, f"shard is truncated ({len(blob)} of {length} bytes "
                                                        f"at offset {offset})"))  # fmt: skip
            if crc32(blob) != crc:
                raise CacheError(self._bad(what, shard, f"checksum mismatch at offset {offset}"))
            out.append(blob)
        return out

    def _read_chunked(self, ranges: list[tuple[str, int, int]]) -> list[tuple[str, memoryview | bytes | Exception]]:
        """``(path, bytes or the read's error)`` per ``(shard, start, end)``, through the chunk LRU: the chunks
        not held are fetched (adjacent ones in one read, up to MAX_BLOCK), then kept. A record inside one chunk
        is a view of it (no copy: decode and crc read it in place)."""
        size = self.chunk_bytes or 1
        spans = [(s, a // size, (max(b, a + 1) - 1) // size) for s, a, b in ranges]  # first and last chunk
        wanted = dict.fromkeys((s, c) for s, c0, c1 in spans for c in range(c0, c1 + 1))
        held: dict[tuple[str, int], memoryview | Exception] = {}
        with self._text_lock:
            for key in wanted:
                if key in self._chunks:
                    self._chunks.move_to_end(key)
                    held[key] = self._chunks[key]
        need = [k for k in wanted if k not in held]
        chunk_ranges = [(join(self.root, s), c * size, min((c + 1) * size, max(self._shard_end.get(s, 0), c * size)))
                        for s, c in need]  # fmt: skip
        reads, where = merge_reads(chunk_ranges, 0)
        blocks = read_many(self.fs, *(list(c) for c in zip(*reads)), files=self._files) if reads else []
        for key, (path, a, b), (k, at) in zip(need, chunk_ranges, where):
            block = blocks[k]  # a view of a merged read: no chunk is copied out of it
            held[key] = block if isinstance(block, Exception) else memoryview(block)[at : at + b - a]
        with self._text_lock:
            for key in need:
                if not isinstance(held[key], Exception) and key not in self._chunks:
                    self._chunks[key] = held[key]  # type: ignore[assignment]
                    self._chunks_held += len(held[key])  # type: ignore[arg-type]
            while self._chunks_held > self._chunk_budget and self._chunks:
                self._chunks_held -= len(self._chunks.popitem(last=False)[1])
        out: list[tuple[str, memoryview | bytes | Exception]] = []
        for (s, a, b), (_, c0, c1) in zip(ranges, spans):
            parts = [held[(s, c)] for c in range(c0, c1 + 1)]
            error = next((p for p in parts if isinstance(p, Exception)), None)
            if error is not None:
                out.append((join(self.root, s), error))
                continue
            # each chunk's share of the range: a view of the one chunk, or only the range's bytes copied
            pieces = [p[max(a - c * size, 0) : b - c * size] for c, p in zip(range(c0, c1 + 1), parts)]
            out.append((join(self.root, s), pieces[0] if len(pieces) == 1 else b"".join(pieces)))  # type: ignore
        return out

    def _bad(self, what: str, shard: str, problem: str) -> str:
        return redact(f"{what} in shard {shard} of {self.url}: {problem}; run `bucketeer verify {self.url}`")

    def _not_named(self, what: str, shard: str, problem: str) -> CacheError:
        """The one-line error for a record that is not the one the index named (see :func:`sample_mismatch`)."""
        return CacheError(redact(f"{what} in shard {shard} of {self.url}: {problem}; the index and the shards "
                                 "disagree: re-embed into a new --out"))  # fmt: skip

    def caption_counts(self, sample_ids: Sequence[int]) -> np.ndarray:
        """(k,) how many captions each of ``sample_ids`` was embedded with (1 for a single caption)."""
        return np.maximum(self._caption_counts[self._locate(sample_ids)], 1)

    def _caption_keys(self, pos: np.ndarray, caption_index: Sequence[int] | None) -> np.ndarray:
        """(k,) the caption key of caption ``caption_index[i]`` of the sample at index row ``pos[i]``."""
        keys = self._samples["caption_key"][pos].astype(np.uint64)
        if caption_index is None:
            return keys
        index = np.asarray(caption_index, np.int64)  # (k,)
        counts = np.maximum(self._caption_counts[pos], 1)
        bad = (index < 0) | (index >= counts)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise CacheError(f"sample {int(self._ids[pos[i]])}: the plan chose caption {int(index[i])} but cache "
                             f"{redact(self.url)} holds {int(counts[i])}; plan and cache come from different "
                             "manifests (re-embed, or re-plan from the manifest the cache was embedded from)")
        listed = (index > 0) & (self._caption_counts[pos] > 0)
        keys[listed] = self._caption_flat[self._caption_starts[pos[listed]] + index[listed]]
        return keys

    def read(self, sample_ids: Sequence[int], caption_index: Sequence[int] | None = None) -> list[SampleRecord]:
        """Records for ``sample_ids`` in the given order, each with its caption's text joined in:
        caption ``caption_index[i]`` of sample ``i`` (the first when None) when it has several.

        Raises CacheError naming the sample id and shard when a record is missing, truncated,
        fails its checksum or does not decode, is not the record the index named (its sample id or
        caption keys, or its text record's caption key, differ from the index row's: a few integer
        compares per record), or a caption index is beyond the sample's captions.
        """
        pos = self._locate(sample_ids)
        keys = self._caption_keys(pos, caption_index)
        inline = self._inline[pos] & (keys == self._samples["caption_key"][pos].astype(np.uint64))  # (k,)
        items = [
            (self._sample_shard_names[self._sample_shard[p]], int(self._samples["offset"][p]),
             int(self._samples["length"][p]), int(self._samples["crc32"][p]), f"sample {int(self._ids[p])}")
            for p in pos
        ]  # fmt: skip
        apart = dict.fromkeys(int(k) for k in keys[~inline].tolist())  # text records to look up or fetch
        texts = self._cached_texts(apart)
        need = [k for k in apart if k not in texts]
        text_items = self._text_items(need)
        blobs = self._fetch(items + text_items)  # samples and texts in one batch of ranged reads
        self._decode_texts(need, text_items, blobs[len(items) :], texts)
        records = []
        for item, blob, key, p, own in zip(items, blobs, keys, pos, inline):
            try:
                record = decode_sample(blob)
            except RecordError as e:
                raise CacheError(self._bad(item[-1], item[0], str(e))) from None
            problem = sample_mismatch(record, self._ids[p], self._samples["caption_key"][p], self._listed_keys(p))
            if own and problem is None and record.text is None:
                problem = f"the index says sample {record.sample_id}'s record holds its caption's text, but it does not"
            if problem:
                raise self._not_named(item[-1], item[0], problem)
            if own and record.caption_key == int(key):
                records.append(record)  # its own caption, inline: nothing to join (a replace costs ~5% of a read)
            else:
                records.append(replace(record, text=record.text if own else texts[int(key)], caption_key=int(key)))
        return records

    def _listed_keys(self, p: int) -> np.ndarray:
        """(m,) every caption key the index lists for the sample at index row ``p`` (0 long: one caption)."""
        start = self._caption_starts[p]
        return self._caption_flat[start : start + self._caption_counts[p]]

    def read_texts(self, caption_keys: Sequence[int]) -> list[TextRecord]:
        """Text records by caption key, in the given order: e.g. the empty caption's
        (``_cache.json["text"]["empty_caption_key"]``, for caption dropout) and the validation
        prompts' (``["text"]["validation_prompts"]``). Raises CacheError like :meth:`read`."""
        keys = [int(k) for k in caption_keys]
        texts = self._cached_texts(dict.fromkeys(keys))
        need = [k for k in dict.fromkeys(keys) if k not in texts]
        items = self._text_items(need)
        self._decode_texts(need, items, self._fetch(items), texts)
        return [texts[k] for k in keys]

    def _text_items(self, keys: list[int]) -> list[tuple[str, int, int, int, str]]:
        """What :meth:`_fetch` reads for the text records of ``keys``; CacheError for a key without one."""
        for k in keys:
            if k not in self._texts:
                raise CacheError(f"caption key {k} has no text record in {redact(self.url)}; "
                                 f"run `bucketeer verify {redact(self.url)}`")  # fmt: skip
        return [(*self._texts[k], f"text record {k}") for k in keys]

    def _decode_texts(self, keys: list[int], items: list, blobs: list[bytes], texts: dict[int, TextRecord]) -> None:
        """Decode the fetched text records of ``keys`` into ``texts`` and remember them."""
        for k, blob, item in zip(keys, blobs, items):
            try:
                texts[k] = decode_text(blob)
            except RecordError as e:
                raise CacheError(self._bad(item[-1], item[0], str(e))) from None
            problem = text_mismatch(texts[k], k)
            if problem:
                raise self._not_named(item[-1], item[0], problem)
            self._remember(k, texts[k])

    def _cached_texts(self, keys) -> dict[int, TextRecord]:
        """The text records of ``keys`` that are in the LRU, looked up (and marked used) under the lock."""
        found = {}
        with self._text_lock:  # one lookup per key: another thread may evict right after
            for k in keys:
                text = self._text_lru.get(k)
                if text is not None:
                    self._text_lru.move_to_end(k)
                    found[k] = text
        return found

    def _remember(self, key: int, text: TextRecord) -> None:
        with self._text_lock:
            self._text_lru[key] = text
            self._text_lru.move_to_end(key)
            while len(self._text_lru) > self._text_lru_size:
                self._text_lru.popitem(last=False)
