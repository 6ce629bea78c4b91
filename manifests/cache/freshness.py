"""Is a cached record still the one a manifest row asks for? Source keys and cache freshness.

A sample record is determined by the cache's settings (fingerprinted in ``_cache.json``) and by
the manifest row it was made from: the image bytes, the caption and the bucket. The manifest
describes the bytes by ``size`` and ``etag`` (``mtime`` when the store gives no etag), so the
**source key** of a row is a 64-bit hash of ``(size, etag or mtime, caption, bucket)``. Each index
row of the cache (records and error rows) stores the key of the row it was made from; a manifest
row whose key differs from the cached one is **stale** and gets re-embedded by the next
``bucketeer embed``. A null caption and an empty one give the same key (they embed the same).
A row with several captions (the manifest's ``captions`` list) hashes the whole list in place of
``caption``, so a change to any of them makes the row stale; a row without a list keeps the key
it always had.
The bucket is part of the key because the latent's shape is the bucket's: a plan drawn from a
manifest whose buckets moved must not pair it with latents of the old ones.

An error row made from the same inputs is **failed** and not retried when its kind says
something about the image (``not_an_image``, ``truncated``, ``decode_failed``,
``too_many_pixels``, ...): the same bytes would fail the same way. A ``read_failed`` row says
only that storage did not deliver the bytes that time (transient errors that outlived their
retries, a denied or missing object); it is **retry**: the next ``bucketeer embed`` reads the
image again, and a record made then supersedes the error row. See :data:`RETRIED_ERRORS`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["source_key", "manifest_samples", "Freshness", "IndexLookup", "classify", "RETRIED_ERRORS"]

_CHUNK_ROWS = 1 << 20  # hash a million rows at a time: bounded memory for any manifest
_VIA_ETAG, _VIA_MTIME, _VIA_NONE = 1, 2, 3
# error kinds that describe the storage, not the image: such rows are embedded again on a rerun
RETRIED_ERRORS = frozenset({"read_failed"})


def _column(table: pa.Table, name: str, type_: pa.DataType) -> pa.Array:
    if name not in table.column_names:
        return pa.nulls(table.num_rows, type_)
    return table.column(name).combine_chunks().cast(type_)


def _caption_text(rows: pa.Table) -> pa.Array:
    """What a row's key hashes of its captions: ``caption``, or the JSON of its ``captions`` list when it has one."""
    caption = _column(rows, "caption", pa.string()).fill_null("")
    lists = _column(rows, "captions", pa.list_(pa.string()))
    if lists.null_count == len(lists):
        return caption
    texts = [json.dumps(many, ensure_ascii=False) if many else one
             for one, many in zip(caption.to_pylist(), lists.to_pylist())]  # fmt: skip
    return pa.array(texts, pa.string())


def _chunk_keys(rows: pa.Table) -> np.ndarray:
    n = rows.num_rows
    size = _column(rows, "size", pa.int64()).fill_null(-1).to_numpy(zero_copy_only=False)
    etag = _column(rows, "etag", pa.string())
    mtime = _column(rows, "mtime", pa.float64())
    caption = _caption_text(rows)
    bucket = _column(rows, "bucket", pa.string()).fill_null("")
    has_etag = etag.is_valid().to_numpy(zero_copy_only=False)
    has_mtime = mtime.is_valid().to_numpy(zero_copy_only=False) & ~has_etag
    etag = etag.fill_null("")
    # fixed-width part, (n, 5) int64: size, how the version is given, mtime bits, etag and caption
    # lengths (the lengths make the concatenated text below unambiguous)
    fixed = np.zeros((n, 5), np.int64)
    fixed[:, 0] = size
    fixed[:, 1] = np.where(has_etag, _VIA_ETAG, np.where(has_mtime, _VIA_MTIME, _VIA_NONE))
    fixed[:, 2] = np.where(has_mtime, mtime.fill_null(0.0).to_numpy(zero_copy_only=False), 0.0).view(np.int64)
    fixed[:, 3] = pc.binary_length(etag).to_numpy(zero_copy_only=False)
    fixed[:, 4] = pc.binary_length(caption).to_numpy(zero_copy_only=False)
    fixed_bytes = fixed.astype("<i8").tobytes()  # (n * 40,)
    text = pc.binary_join_element_wise(etag, caption, bucket, "").cast(pa.large_binary()).to_pylist()
    blake2b = hashlib.blake2b
    keys = np.fromiter(
        (int.from_bytes(blake2b(fixed_bytes[40 * i : 40 * i + 40] + t, digest_size=8).digest(), "big")
         for i, t in enumerate(text)),
        dtype=np.uint64, count=n,
    )  # fmt: skip
    return _with_clip_starts(_with_mask(_with_conditioning(keys, rows), rows), rows)


def _with_clip_starts(keys: np.ndarray, rows: pa.Table) -> np.ndarray:
    """Video rows whose clips were cut at scene changes (``clip_starts``) hash the starts in too, and each clip's
    caption index (``clip_captions``, shots captioned) when they have them, so clips cut or captioned anew
    re-embed their video; rows without them keep their key (a row without ``clip_captions`` its key of before)."""
    starts = _column(rows, "clip_starts", pa.list_(pa.int32()))
    if starts.null_count == rows.num_rows:
        return keys
    on = _column(rows, "clip_captions", pa.list_(pa.int32())).to_pylist()
    keys = keys.copy()
    for i, at in enumerate(starts.to_pylist()):
        if at is not None:
            text = json.dumps(["clip_starts", int(keys[i]), at, *([] if on[i] is None else [on[i]])])
            keys[i] = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return keys


def _with_mask(keys: np.ndarray, rows: pa.Table) -> np.ndarray:
    """Rows with a loss mask (``scan --masks``) hash where it is and its version in too, so a mask that
    appears, goes or changes re-embeds its sample; rows without one keep their key."""
    masks = _column(rows, "mask", pa.string())
    if masks.null_count == rows.num_rows:
        return keys
    versions = zip(masks.to_pylist(), *(_column(rows, c, t).to_pylist() for c, t in (
        ("mask_offset", pa.int64()), ("mask_size", pa.int64()), ("mask_etag", pa.string()),
        ("mask_mtime", pa.float64()))))  # fmt: skip
    keys = keys.copy()
    for i, (mask, offset, size, etag, mtime) in enumerate(versions):
        if mask is not None:
            text = json.dumps(["mask", int(keys[i]), mask, offset, size, etag, None if etag is not None else mtime])
            keys[i] = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return keys


def _with_conditioning(keys: np.ndarray, rows: pa.Table) -> np.ndarray:
    """Rows paired with a conditioning image (``scan --conditioning``) hash its path and version in too,
    so a changed conditioning image re-embeds its sample; rows without one keep their key."""
    paths = _column(rows, "conditioning", pa.string())
    if paths.null_count == rows.num_rows:
        return keys
    versions = zip(paths.to_pylist(), *(_column(rows, c, t).to_pylist() for c, t in (
        ("conditioning_size", pa.int64()), ("conditioning_etag", pa.string()), ("conditioning_mtime", pa.float64()))))
    keys = keys.copy()
    for i, (path, size, etag, mtime) in enumerate(versions):
        if path is not None:
            text = json.dumps([int(keys[i]), path, size, etag, None if etag is not None else mtime]).encode()
            keys[i] = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")
    return keys


def source_key(samples: pa.Table) -> np.ndarray:
    """(n,) uint64 source key of each manifest row: hash of (size, etag or mtime, caption(s), bucket).

    ``samples`` is a manifest samples table (``manifests.schema.SAMPLES_SCHEMA``; ``etag`` and
    ``mtime`` may be absent or null). About 1 µs per row, in bounded memory.
    """
    if samples.num_rows == 0:
        return np.zeros(0, np.uint64)
    return np.concatenate(
        [_chunk_keys(samples.slice(i, _CHUNK_ROWS)) for i in range(0, samples.num_rows, _CHUNK_ROWS)]
    )


def manifest_samples(manifest: Any) -> pa.Table:
    """The samples table of a :class:`manifests.manifest.Manifest` (or the table itself)."""
    if isinstance(manifest, pa.Table):
        return manifest
    samples = getattr(manifest, "samples", None)
    if not isinstance(samples, pa.Table):
        raise TypeError(f"expected a Manifest or its samples table, got {type(manifest).__name__}")
    return samples


@dataclass(frozen=True)
class Freshness:
    """What a cache holds for each manifest row, in manifest order; all arrays are ``(n,)`` bool.

    ``fresh``: a good record made from this row's inputs. ``failed``: an error row made from these
    inputs whose kind is about the image (it cannot be embedded; not retried). ``retry``: an
    error row made from these inputs whose kind is a storage failure (:data:`RETRIED_ERRORS`;
    embedded again). ``stale``: a record or error row made from other inputs (changed bytes,
    caption or bucket; or written before source keys existed). ``missing``: nothing cached.
    """

    sample_ids: np.ndarray
    fresh: np.ndarray
    failed: np.ndarray
    stale: np.ndarray
    retry: np.ndarray

    @property
    def missing(self) -> np.ndarray:
        return ~(self.fresh | self.failed | self.stale | self.retry)

    @property
    def todo(self) -> np.ndarray:
        """Rows the embed job has to (re-)embed: stale, retry or missing."""
        return ~(self.fresh | self.failed)

    def counts(self) -> dict[str, int]:
        return {"fresh": int(self.fresh.sum()), "failed": int(self.failed.sum()), "retry": int(self.retry.sum()),
                "stale": int(self.stale.sum()), "missing": int(self.missing.sum())}  # fmt: skip

    @classmethod
    def empty_cache(cls, sample_ids: np.ndarray) -> "Freshness":
        """Every row missing (there is no cache yet)."""
        none = np.zeros(len(sample_ids), bool)
        return cls(sample_ids=sample_ids, fresh=none, failed=none, stale=none, retry=none)


class IndexLookup:
    """A committed index reduced to what freshness needs, sorted by sample id: 19 bytes a row.

    Built once from the resolved index (at most one row per sample id, see
    ``manifests.cache.read_index``); :meth:`classify` then judges any slice of a manifest, so a
    job can stream the manifest in row groups instead of holding it whole.
    """

    def __init__(self, samples_index: pa.Table, errors_index: pa.Table):
        ids = np.concatenate([t.column("sample_id").to_numpy().astype(np.uint64)
                              for t in (samples_index, errors_index)])  # (m,) fmt: skip
        key_cols = [t.column("source_key").combine_chunks() for t in (samples_index, errors_index)]
        keys = np.concatenate([c.fill_null(0).to_numpy(zero_copy_only=False).astype(np.uint64) for c in key_cols])
        known = np.concatenate([c.is_valid().to_numpy(zero_copy_only=False) for c in key_cols])  # (m,)
        is_error = np.arange(len(ids)) >= samples_index.num_rows  # (m,)
        kinds = errors_index.column("error").combine_chunks()
        retried_kind = pc.is_in(kinds, value_set=pa.array(sorted(RETRIED_ERRORS), kinds.type)).fill_null(False)
        retryable = np.concatenate([np.zeros(samples_index.num_rows, bool),
                                    retried_kind.to_numpy(zero_copy_only=False)])  # (m,) fmt: skip
        order = np.argsort(ids, kind="stable")
        self.ids, self.keys, self.known = ids[order], keys[order], known[order]
        self.is_error, self.retryable = is_error[order], retryable[order]

    @classmethod
    def empty(cls) -> "IndexLookup":
        """The lookup of a cache that holds nothing yet: every row is missing."""
        ids = pa.array([], pa.uint64())
        samples = pa.table({"sample_id": ids, "source_key": pa.array([], pa.uint64())})
        return cls(samples, samples.append_column("error", pa.array([], pa.string())))

    def __len__(self) -> int:
        return len(self.ids)

    def classify(self, samples: pa.Table, keys: np.ndarray | None = None) -> Freshness:
        """Freshness of the manifest rows ``samples`` (any slice; ``keys``: their source keys, if known)."""
        ids = samples.column("sample_id").to_numpy().astype(np.uint64)  # (n,)
        keys = source_key(samples) if keys is None else keys  # (n,)
        pos = np.minimum(np.searchsorted(self.ids, ids), max(len(self.ids) - 1, 0))  # (n,)
        if len(self.ids):
            found = self.ids[pos] == ids
            same = found & self.known[pos] & (self.keys[pos] == keys)
            error, storage = self.is_error[pos], self.retryable[pos]
        else:
            found = same = error = storage = np.zeros(len(ids), bool)
        return Freshness(sample_ids=ids, fresh=same & ~error, failed=same & error & ~storage,
                         stale=found & ~same, retry=same & error & storage)  # fmt: skip


def classify(samples_index: pa.Table, errors_index: pa.Table, samples: pa.Table) -> Freshness:
    """Compare a cache's (resolved) sample and error index with manifest ``samples``.

    The index tables hold at most one row per sample id between them (see
    ``manifests.cache.read_index``), a nullable ``source_key`` column, and the errors index an
    ``error`` column (the kind, which decides failed vs retry).
    """
    return IndexLookup(samples_index, errors_index).classify(samples)
