"""Check every record of a cache: shard presence and size, checksum, decompression, shapes, finite values.

Each shard is read once, whole (one GET), and every record in it is checked against the index
and ``_cache.json``: latent ``(C, H / f, W / f)`` for bucket ``WxH`` and VAE factor ``f`` (and its
``latent_std`` in a cache embedded with ``--latents posterior``; the conditioning latent and the
``--flip``/``--crops`` variants its settings say; the DINOv2 features of ``embed --features``, grid and width as
``_cache.json`` says, and none in a cache without), the cache's dtype, finite values;
text records against the cache's ``text.layout`` (parts, widths, lengths, pooled). A caption held
inline in its sample's record (``text_inline``) is checked as a text record too (its text row names
that record). A bad text record makes every sample with that caption (any of its captions) bad.
Records of both layouts (``plain``, ``planar``: :mod:`manifests.cache.codec`) are checked alike.

Every record is also compared with the index row that named it (:func:`sample_mismatch`,
:func:`text_mismatch`: its sample id and caption keys, a text record's caption key; the latent key, of the
image's content and geometry, that ``embed --reuse`` looks records up by). A record that
is not the one its row names is not a bad record to re-embed but an index that no longer matches
its shards (rows swapped or edited): all the mismatches are counted and :func:`verify_cache` raises
one CacheError (one line, exit 2) naming the first, after checking the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from manifests.buckets import parse_bucket
from manifests.frames import parse_video_bucket
from manifests.cache.layout import CacheError, read_meta, read_index
from manifests.cache.meta import CacheMeta, LatentInfo
from manifests.cache.records import (
    RecordError,
    SampleRecord,
    crc32,
    decode_sample,
    decode_text,
    sample_mismatch,
    text_mismatch,
    to_float32,
)
from manifests.cache.identity import record_latent_key
from manifests.cache.text_layout import TextLayout
from manifests.progress import Progress
from manifests.storage import join, open_url, read_bytes, redact

__all__ = ["BadRecord", "VerifyResult", "verify_cache"]


@dataclass(frozen=True)
class BadRecord:
    """One sample that cannot be trained on, where it lives, and why."""

    sample_id: int
    shard: str
    reason: str


@dataclass
class VerifyResult:
    checked_samples: int = 0
    checked_texts: int = 0
    shards: int = 0
    bad: list[BadRecord] = field(default_factory=list)
    complete: bool = True

    @property
    def ok(self) -> bool:
        return not self.bad

    @property
    def bad_sample_ids(self) -> list[int]:
        return sorted({b.sample_id for b in self.bad})


def _check_finite(array: np.ndarray, tag: str) -> str | None:
    if not np.isfinite(to_float32(array, tag)).all():
        return "non-finite values (NaN/inf)"
    return None


class _NotNamed(Exception):
    """A record that is not the one its index row names (one clause of text)."""


def _check_sample(blob: bytes, row: dict, meta: CacheMeta) -> str | None:
    record = decode_sample(blob)
    problem = sample_mismatch(record, row["sample_id"], row["caption_key"], row.get("caption_keys"))
    if problem:
        raise _NotNamed(problem)
    if row.get("text_inline") and record.text is None:
        raise _NotNamed(f"the index says sample {record.sample_id}'s record holds its caption's text, but it does not")
    if row.get("latent_key") is not None and record_latent_key(record) != int(row["latent_key"]):
        raise _NotNamed(f"the index gives sample {record.sample_id} latent key {int(row['latent_key'])}, but its "
                        "record's image content and geometry give another")  # fmt: skip
    latent = meta.latent or LatentInfo()
    bucket = row["bucket"]
    video = meta.settings.video is not None
    w, h, frames = parse_video_bucket(bucket) if video else (*parse_bucket(bucket), None)
    f = int(8 if latent.factor is None else latent.factor)
    channels = int(record.latent.shape[0] if latent.channels is None else latent.channels)
    expected = (channels, h // f, w // f)
    if video:  # a clip: (C, F', h, w), F' = (F - 1) // temporal_factor + 1
        expected = (channels, (frames - 1) // int(latent.temporal_factor or 1) + 1, h // f, w // f)
    if tuple(record.latent.shape) != expected:
        return f"latent shape {tuple(record.latent.shape)} != {expected} (bucket {bucket} / factor {f})"
    if latent.dtype and record.dtype != latent.dtype:
        return f"latent dtype {record.dtype} != cache dtype {latent.dtype}"
    if record.target_size != (h, w):
        return f"target size {record.target_size} != bucket {bucket}"
    if (record.latent_std is not None) != (latent.kind == "posterior_mean_std"):
        return f"latent_std {'present' if record.latent_std is not None else 'missing'} in a {latent.kind} cache"
    want = meta.settings.variant_count
    if video:  # a video's variants are its clips (up to max_clips) x flips
        most, flips = int(meta.settings.video.max_clips or 1) * want, want
        if record.variants % flips or not flips <= record.variants <= most or record.clip_starts is None:
            return (f"{record.variants} variants (clip starts {record.clip_starts}), the cache's settings "
                    f"(--max-clips/--flip) allow {flips} to {most} in steps of {flips}")  # fmt: skip
        captions = len(record.caption_keys or (record.caption_key,))
        if record.variant_captions is not None and int(record.variant_captions.max()) >= captions:
            return (f"clip caption indices {record.variant_captions.tolist()} beyond its {captions} captions "
                    "(each clip's shot caption)")  # fmt: skip
    elif record.variants != want:
        return f"{record.variants} variants, the cache's settings (--crops/--flip) say {want}"
    if (record.cond_latent is not None) != (meta.settings.conditioning is not None):
        return f"conditioning latent {'present' if record.cond_latent is not None else 'missing'} in this cache"
    if record.mask is not None and meta.settings.masks is None:
        return "a loss mask in a cache whose settings say it has none (embedded without scan --masks)"
    problem = _check_features(record, meta)
    if problem:
        return problem
    tensors = (record.latent, record.latent_std, record.cond_latent, record.variant_latents,
               record.variant_cond_latents)
    return next((p for p in (_check_finite(t, record.dtype) for t in tensors if t is not None) if p), None)


def _check_features(record: SampleRecord, meta: CacheMeta) -> str | None:
    """``embed --features``: every record carries features of the grid and width ``settings.features`` says
    (float16, finite); a cache without them carries none."""
    want = meta.settings.features
    if want is None:
        return "DINOv2 features in a cache whose settings have none" if record.features is not None else None
    if record.features is None:
        return f"no DINOv2 features, but the cache's settings say {want.id} features (embed --features)"
    shape = (*(want.grid or ()), want.dim)
    for name, array in (("features", record.features), ("variant_features", record.variant_features)):
        if array is not None and tuple(array.shape[-3:]) != shape:
            return f"{name} shape {tuple(array.shape)} != grid x dim {shape} of _cache.json features"
        if array is not None and not np.isfinite(array.astype(np.float32)).all():
            return f"{name}: non-finite values (NaN/inf)"
    return None


def _check_text(blob: bytes, row: dict, meta: CacheMeta, layout: TextLayout) -> str | None:
    record = decode_text(blob)
    problem = text_mismatch(record, row["caption_key"])
    if problem:
        raise _NotNamed(problem)
    dtype = ("F32" if meta.text.compact else meta.text.dtype) if meta.text else None  # compact: read back widened
    problem = layout.check(record)
    if problem:
        return problem
    if dtype and record.dtype != dtype:
        return f"text dtype {record.dtype} != cache dtype {dtype}"
    for t in (*record.tokens, *(() if record.pooled is None else (record.pooled,))):
        problem = _check_finite(t, record.dtype)
        if problem:
            return problem
    return None


def _check(kind: str, blob: bytes, row: dict, meta: CacheMeta, layout: TextLayout) -> str | None:
    if len(blob) != row["length"]:
        return f"truncated shard: {len(blob)} of {row['length']} bytes at offset {row['offset']}"
    if crc32(blob) != row["crc32"]:
        return f"checksum mismatch at offset {row['offset']}"
    try:
        if kind == "samples":
            return _check_sample(blob, row, meta)
        return _check_text(blob, row, meta, layout)
    except RecordError as e:
        return f"undecodable record at offset {row['offset']}: {e}"


def verify_cache(url: str, storage_options: dict | None = None, *, progress: bool = False) -> VerifyResult:
    """Check every record; returns a :class:`VerifyResult` listing bad samples.

    ``progress``: report records checked (:class:`manifests.progress.Progress`, on stderr).
    Raises CacheError if there is no cache, or (after checking every record) when records are not
    the ones their index rows name: one line with their count and the first.
    """
    fs, root = open_url(url, storage_options)
    meta = read_meta(fs, root, url)
    layout = meta.text_layout
    tables = read_index(url, storage_options, meta)
    result = VerifyResult(complete=bool(meta.complete))
    rows = {kind: tables[kind].to_pylist() for kind in ("samples", "texts")}
    by_shard: dict[str, list[tuple[str, dict]]] = {}
    for kind, kind_rows in rows.items():
        for row in kind_rows:
            by_shard.setdefault(row["shard"], []).append((kind, row))
    bad_texts: dict[int, tuple[str, str]] = {}
    not_named: list[str] = []  # records that are not the ones their index rows name
    reporter = Progress("verify", "records", total=sum(map(len, rows.values())), unit="records", enabled=progress)
    for shard, items in sorted(by_shard.items()):
        result.shards += 1
        try:
            data = read_bytes(fs, join(root, shard))
        except FileNotFoundError:
            data = None
        # per-record checks name the damaged records; a whole-shard hash could only say "somewhere"
        shard_note = "shard is missing" if data is None else None
        for kind, row in items:
            if kind == "samples":
                result.checked_samples += 1
            else:
                result.checked_texts += 1
            try:
                problem = shard_note or _check(kind, data[row["offset"] : row["offset"] + row["length"]], row,
                                             meta, layout)  # fmt: skip
            except _NotNamed as e:
                what = f"sample {row['sample_id']}" if kind == "samples" else f"text record {row['caption_key']}"
                not_named.append(f"{what} in shard {shard} at offset {row['offset']}: {e}")
                continue
            if problem is None:
                continue
            if kind == "samples":
                result.bad.append(BadRecord(int(row["sample_id"]), shard, problem))
            else:
                bad_texts[int(row["caption_key"])] = (shard, problem)
        reporter.update(len(items), shards=result.shards, bad=len(result.bad) + len(bad_texts))
    reporter.close()
    if not_named:
        checked = result.checked_samples + result.checked_texts
        raise CacheError(redact(f"{url}: {len(not_named)} of {checked} records are not the ones the index names "
                                f"(first: {not_named[0]}); the index and the shards disagree (rows swapped or edited), "
                                "so samples would train on other samples' latents or captions: re-embed into a "
                                "new --out"))  # fmt: skip
    known_texts = {int(r["caption_key"]) for r in rows["texts"]}
    for row in rows["samples"]:
        for key in dict.fromkeys([int(row["caption_key"]), *(row.get("caption_keys") or ())]):  # every caption
            if key in bad_texts:
                shard, problem = bad_texts[key]
                result.bad.append(BadRecord(int(row["sample_id"]), shard, f"its caption's text record: {problem}"))
                break
            if key not in known_texts:
                result.bad.append(BadRecord(int(row["sample_id"]), row["shard"],
                                            f"no text record for caption key {key}"))
                break
    return result
