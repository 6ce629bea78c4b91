"""``embed --reuse CACHE[,CACHE...]``: take the records other caches already hold for the same image or caption.

A latent is identified by the image's content (sha256 of its bytes), the VAE's identity and the exact geometry:
bucket, original and resized size, every crop's box and the flips (:func:`manifests.cache.identity.latent_key`,
stored per record in the ``latent_key`` index column and, as ``content``, in the record itself). A text record is
identified by its caption (the caption key, a hash of the text) and the text encoders with every setting that
changes their output. Two caches' latents are interchangeable when every setting that makes a latent is equal
(:func:`latent_identity`: the VAE's class, weights and normalisation, the stored dtype, mean or posterior, the
variants, the features, and neither holding masks, conditioning images or clips); their text records when every
text setting is (:func:`text_identity`: the family, the dtype and each encoder's id, layer and length; the
weights are compared once this run loads its text encoders, :func:`check_text_weights`). So Flux 2 and
Flux 2 Klein, which share a VAE, share latents, and each encodes its own text.

The design: the new cache **copies** what it takes (a record is decoded, checked and written again under the new
sample's identity), so it stays self-contained. The trainer and ``verify`` read one cache, with no reference to
another that could be moved, re-embedded or deleted under it; the price is the bytes of the copy, not GPU time.
A content store shared by every cache would store each latent once, but every cache would then depend on it and
no cache could be deleted without knowing who else refers to its records.

How a record is taken, with the one read of the image that embedding needs anyway: the driver builds
:class:`ReuseTable` from the other caches' indexes (a sorted array of keys and where each record is, ~40 bytes a
record); the decode tasks hash each image's bytes (:func:`take_latents`), look the key of the geometry this run
would give (:func:`expected_latent_key`, from the manifest row's display size) up, read the record (one ranged
read), check its checksum, its content and its geometry, and hand it on instead of pixels; the encoder actor
writes it under the new sample id (:func:`retarget`). Text records are looked up by caption key in the text
actors and the image actors (inline captions) the same way (:meth:`ReuseTable.take_texts`). A record that fails
a check is encoded instead and counted as refused.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np
import pyarrow.compute as pc

from manifests.buckets import parse_bucket
from manifests.cache import CacheMeta, read_cache_meta, read_index, settings_diff
from manifests.cache.identity import latent_key, record_latent_key
from manifests.cache.records import RecordError, SampleRecord, TextRecord, crc32, decode_sample, decode_text
from manifests.errors import UsageError
from manifests.frames import is_video_bucket
from manifests.storage import join, open_url, read_many, redact
from pipeline.embed.imaging import cover_and_crop, fetch_images

__all__ = ["ReuseTable", "latent_identity", "text_identity", "expected_latent_key", "content_hash", "take_latents",
           "retarget", "build_reuse", "check_text_weights", "parse_reuse", "held_latents"]  # fmt: skip

_SAMPLE_COLUMNS = ["latent_key", "shard", "offset", "length", "crc32"]
_TEXT_COLUMNS = ["caption_key", "shard", "offset", "length", "crc32"]
_NO_VARIANTS = {"crops": 1, "flip": False}


def parse_reuse(value: str | None) -> tuple[str, ...]:
    """``--reuse A,B`` -> ``("A", "B")`` (empty entries dropped)."""
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def content_hash(data: bytes) -> str:
    """The image's content identity: sha256 (hex) of the bytes read for it (a tar member's bytes, a parquet cell's)."""
    return hashlib.sha256(data).hexdigest()


def latent_identity(settings: Mapping[str, Any]) -> dict[str, Any]:
    """What of a cache's fingerprinted settings makes its latents: equal identities, interchangeable latents.
    Paths and hub ids are left out (the same weights under another path are the same VAE); the crop policy and
    seed too (each record's geometry is in its key)."""
    vae = {k: v for k, v in settings.get("vae", {}).items() if k not in ("id", "subfolder")}
    features = settings.get("features")
    return {"dtype": settings.get("dtype"), "resample": settings.get("resample"), "pixels": settings.get("pixels"),
            "latent": settings.get("latent"), "vae": vae, "variants": settings.get("variants") or _NO_VARIANTS,
            "features": None if features is None else {k: v for k, v in features.items() if k != "id"},
            # records that hold more than the image's latents are never taken
            "masks": "masks" in settings, "conditioning": "conditioning" in settings, "video": "video" in settings}


def text_identity(settings: Mapping[str, Any]) -> dict[str, Any]:
    """What of a cache's settings (the requested ones suffice) makes its text records: the family (its template and
    layout), the stored dtype, and each encoder's id, subfolder, layer and length. The weights behind the ids are
    compared when this run loads its encoders (:func:`check_text_weights`)."""
    text = settings.get("text", {})
    return {"family": settings.get("family"), "dtype": settings.get("dtype"), "layer": text.get("layer"),
            "max_text_tokens": text.get("max_text_tokens"), "compact": text.get("compact"),
            "encoders": [{"id": e.get("id"), "subfolder": e.get("subfolder")} for e in text.get("encoders", [])]}


@dataclass(frozen=True)
class ReuseSource:
    """One ``--reuse`` cache: its URL, its ``_cache.json``, and what of it this run can take (with why not)."""

    url: str
    meta: CacheMeta
    latents: bool
    texts: bool
    why_not: tuple[str, ...] = ()


@dataclass
class ReuseTable:
    """Where the records this run may take are: per kind, sorted uint64 keys and each record's source, shard and
    byte range. Plain numpy arrays and strings (what Ray ships to the workers, no pickle of our objects needed)."""

    urls: tuple[str, ...] = ()
    storage_options: dict = field(default_factory=dict)
    shards: tuple[str, ...] = ()  # "source index / relative shard path" -> the position in these
    latent_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    latent_where: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.int64))  # (n, 4) shard, off, len, crc
    latent_source: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    text_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    text_where: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.int64))
    text_source: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    text_described: dict | None = None  # the text encoders' description of the source its text records come from

    @property
    def latents(self) -> int:
        return len(self.latent_keys)

    @property
    def texts(self) -> int:
        return len(self.text_keys)

    def __bool__(self) -> bool:
        return bool(self.latents or self.texts)

    def _find(self, keys: np.ndarray, wanted: np.ndarray) -> np.ndarray:
        """(n,) int64 position in ``keys`` of each of ``wanted``, -1 where absent."""
        wanted = np.asarray(wanted, np.uint64)
        if not len(keys):
            return np.full(len(wanted), -1, np.int64)
        pos = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
        return np.where(keys[pos] == wanted, pos, -1)

    def has_latents(self, keys: np.ndarray) -> np.ndarray:
        return self._find(self.latent_keys, keys) >= 0

    def has_texts(self, keys: np.ndarray) -> np.ndarray:
        return self._find(self.text_keys, keys) >= 0

    def _read(self, where: np.ndarray, sources: np.ndarray) -> list[bytes | BaseException]:
        """The record bytes at ``where`` (m, 4) of ``sources`` (m,), one concurrent ranged read per source; a read
        that fails, or bytes whose crc32 is not the index's, come back as an exception."""
        out: list[bytes | BaseException] = [RecordError("not read")] * len(where)
        for s in np.unique(sources):
            at = np.flatnonzero(sources == s)
            fs, root = open_url(self.urls[int(s)], self.storage_options)
            paths = [join(root, self.shards[int(where[i, 0])].split("/", 1)[1]) for i in at]
            blobs = read_many(fs, paths, [int(where[i, 1]) for i in at],
                              [int(where[i, 1] + where[i, 2]) for i in at])  # fmt: skip
            for i, blob in zip(at, blobs):
                if not isinstance(blob, BaseException) and crc32(blob) != int(where[i, 3]):
                    blob = RecordError("crc32 differs from its index row")
                out[i] = blob
        return out

    def take_texts(self, keys: list[int]) -> dict[int, TextRecord]:
        """The text records of the caption ``keys`` this table has, read and checked (checksum, the caption key
        in the record); the others (and any that fails a check) are left out: they get encoded."""
        pos = self._find(self.text_keys, np.asarray(keys, np.uint64))
        found = np.flatnonzero(pos >= 0)
        if not len(found):
            return {}
        blobs = self._read(self.text_where[pos[found]], self.text_source[pos[found]])
        out: dict[int, TextRecord] = {}
        for i, blob in zip(found, blobs):
            if isinstance(blob, BaseException):
                continue
            try:
                record = decode_text(blob)
            except RecordError:
                continue
            if record.caption_key == int(keys[i]):
                out[int(keys[i])] = record
        return out

    def take_samples(self, keys: np.ndarray) -> list[tuple[bytes, int] | BaseException | None]:
        """Per latent key: ``(record bytes, source)`` read and checksummed; None where no cache holds it; the exception
        where one does but its record could not be read or failed its checksum."""
        pos = self._find(self.latent_keys, keys)
        out: list[tuple[bytes, int] | BaseException | None] = [None] * len(keys)
        found = np.flatnonzero(pos >= 0)
        if len(found):
            blobs = self._read(self.latent_where[pos[found]], self.latent_source[pos[found]])
            for i, blob in zip(found, blobs):
                out[i] = blob if isinstance(blob, BaseException) else (blob, int(self.latent_source[pos[i]]))
        return out


def expected_latent_key(content: str, bucket: str, height: int, width: int, sample_id: int, *, crop: str, seed: int,
                        crops: int, flip: bool) -> int:
    """The :func:`~manifests.cache.identity.latent_key` this run would give a manifest row: ``(height, width)`` its
    display size (the manifest's, which the scan read from the headers: what decoding gives), the crops drawn as
    :func:`~pipeline.embed.imaging.cover_and_crop` draws them for ``sample_id``."""
    bw, bh = parse_bucket(bucket)
    views = [cover_and_crop((height, width), (bh, bw), crop, seed, sample_id, None if crops == 1 else k)
             for k in range(crops)]  # fmt: skip
    return latent_key(content, bucket, (height, width), views[0][0], [v[1] for v in views], 2 if flip else 1)


def take_latents(table: ReuseTable, bucket: str, rows: list[dict], blobs: list, *, crop: str, seed: int, crops: int,
                 flip: bool, max_pixels: int, dtype: str) -> tuple[list[str | None], dict[int, tuple[bytes, int]], int]:
    """What a unit of ``bucket`` can take instead of decoding: ``(content of each row (None: unread), {row position:
    (record bytes, source)}, refused)``. A row is looked up when it is an image with neither a mask nor a conditioning
    image; a found record is taken when its checksum, content, bucket, geometry, dtype and pixel count (within
    ``max_pixels``) are this row's; ``refused`` counts found records that failed a check (they are encoded)."""
    contents = [None if isinstance(b, BaseException) or not b else content_hash(b) for b in blobs]
    if not table.latents or is_video_bucket(bucket):
        return contents, {}, 0
    candidates = [i for i, (r, c) in enumerate(zip(rows, contents))
                  if c is not None and r.get("width") and r.get("height") and not r.get("mask")
                  and not r.get("conditioning")]  # fmt: skip
    keys = np.array([expected_latent_key(contents[i], bucket, rows[i]["height"], rows[i]["width"],
                                         rows[i]["sample_id"], crop=crop, seed=seed, crops=crops, flip=flip)
                     for i in candidates], np.uint64)  # fmt: skip
    taken, refused = {}, 0
    for i, key, found in zip(candidates, keys, table.take_samples(keys)):
        if found is None:
            continue
        try:
            if isinstance(found, BaseException):
                raise RecordError(str(found))
            record = decode_sample(found[0])
        except RecordError:
            refused += 1
            continue
        h, w = record.original_size
        if record.content != contents[i] or record_latent_key(record) != int(key) or record.dtype != dtype or \
                record.bucket != bucket or h * w > max_pixels:  # fmt: skip
            refused += 1
            continue
        taken[i] = found
    return contents, taken, refused


def held_latents(table: ReuseTable, rows: list[dict], source: str, storage_options: dict, image_column: str | None,
                 *, crop: str, seed: int, crops: int, flip: bool) -> tuple[Counter, int]:
    """``(rows per bucket whose record ``table`` holds, image bytes read)``: what ``bucketeer estimate --reuse``
    counts. Each image of ``rows`` (manifest rows to embed) is read and hashed, its key looked up as the decode tasks
    look it up (:func:`take_latents`; the record itself is not read)."""
    fs, root = open_url(source, storage_options)
    buckets, keys, read = [], [], 0
    for row, blob in zip(rows, fetch_images(fs, root, rows, image_column=image_column)):
        if isinstance(blob, BaseException) or not blob:
            continue
        read += len(blob)
        if row.get("mask") or row.get("conditioning") or not row.get("width") or not row.get("height"):
            continue
        buckets.append(row["bucket"])
        keys.append(expected_latent_key(content_hash(blob), row["bucket"], row["height"], row["width"],
                                        row["sample_id"], crop=crop, seed=seed, crops=crops, flip=flip))  # fmt: skip
    held = table.has_latents(np.array(keys, np.uint64))  # one lookup for the rows
    return Counter(b for b, h in zip(buckets, held) if h), read


def retarget(data: bytes, row: dict) -> SampleRecord:
    """A taken record (its bytes) as the record of ``row``: its sample id and captions, no inline text (the writer
    adds this row's), its latents, geometry, features and content as they were."""
    record = decode_sample(data)
    return replace(record, sample_id=int(row["sample_id"]), caption_key=int(row["caption_key"]), text=None,
                   caption_keys=None if row.get("caption_keys") is None else tuple(row["caption_keys"]))


def build_reuse(urls: tuple[str, ...], storage_options: dict, settings: Mapping[str, Any],
                request: Mapping[str, Any], reference: bool) -> tuple[ReuseTable, list[ReuseSource]]:
    """The :class:`ReuseTable` of ``urls`` for a run whose latent settings are ``settings`` (the request with the
    VAE's description) and whose requested settings are ``request``; ``reference``: a family whose text depends on
    each sample's image (no text record is taken). Raises UsageError for a URL that is not a committed cache."""
    table = ReuseTable(urls=tuple(urls), storage_options=dict(storage_options))
    sources: list[ReuseSource] = []
    shards: dict[str, int] = {}
    latent_parts, text_parts = [], []
    want_latents, want_text = latent_identity(settings), text_identity(request)
    for s, url in enumerate(urls):
        try:
            meta = read_cache_meta(url, storage_options)
        except UsageError as e:
            raise UsageError(f"--reuse {redact(url)}: {e}") from None
        hashed = meta.settings.hashed
        why = [f"latents: {line}" for line in settings_diff(latent_identity(hashed), want_latents)]
        why += [f"text: {line}" for line in settings_diff(text_identity(hashed), want_text)]
        if reference:
            why.append("text: this family's text depends on each sample's reference image")
        if want_text["compact"]:  # quantized again, read-back values would not give a fresh encode's scales
            why.append("text: --text-dtype fp8 records are encoded, not copied")
        latents = not any(w.startswith("latents:") for w in why)
        texts = not reference and not any(w.startswith("text:") for w in why)
        sources.append(ReuseSource(url, meta, latents, texts, tuple(why)))
        if not (latents or texts):
            continue
        index = read_index(url, storage_options, meta, columns={"samples": _SAMPLE_COLUMNS, "texts": _TEXT_COLUMNS,
                                                                 "errors": []})  # fmt: skip
        for kind, wanted, key, parts in (("samples", latents, "latent_key", latent_parts),
                                         ("texts", texts, "caption_key", text_parts)):  # fmt: skip
            rows = index[kind]
            if not wanted or not rows.num_rows:
                continue
            rows = rows.filter(pc.is_valid(rows.column(key)))
            names = rows.column("shard").to_pylist()
            ids = np.fromiter((shards.setdefault(f"{s}/{n}", len(shards)) for n in names), np.int64, len(names))
            where = np.stack([ids, *(rows.column(c).to_numpy(zero_copy_only=False).astype(np.int64)
                                     for c in ("offset", "length", "crc32"))], axis=1)  # fmt: skip
            parts.append((rows.column(key).to_numpy(zero_copy_only=False).astype(np.uint64), where,
                          np.full(len(where), s, np.int32)))
        if texts and table.text_described is None:
            from pipeline.embed.settings import committed_text

            table.text_described = committed_text(meta)
    table.shards = tuple(shards)
    for parts, attr in ((latent_parts, "latent"), (text_parts, "text")):
        if not parts:
            continue
        keys = np.concatenate([p[0] for p in parts])
        where, source = np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts])
        order = np.argsort(keys, kind="stable")  # the first --reuse cache wins a key several hold
        keys, where, source = keys[order], where[order], source[order]
        first = np.append(True, keys[1:] != keys[:-1])
        setattr(table, f"{attr}_keys", keys[first])
        setattr(table, f"{attr}_where", where[first])
        setattr(table, f"{attr}_source", source[first])
    return table, sources


def check_text_weights(taken_from: Mapping[str, Any] | None, loaded: Mapping[str, Any]) -> None:
    """Refuse to mix text records taken from a ``--reuse`` cache (``taken_from``: its text encoders' description as
    its ``_cache.json`` holds it) with text this run encodes by other encoders (``loaded``: theirs, ``describe()``):
    the same ids and settings, but other weights, template or layout. Called where the encoders load."""
    if not taken_from:
        return
    keys = ("class", "weights_sha256", "max_length", "hidden_size", "processor")
    mine = lambda d: {"pipeline": d.get("pipeline"), "layout": d.get("layout"), "pooled_dim": d.get("pooled_dim"),  # noqa: E731
                      "encoders": [{k: e.get(k) for k in keys} for e in d.get("encoders", [])]}  # fmt: skip
    diff = settings_diff(mine(taken_from), mine(loaded))
    if diff:
        raise UsageError("--reuse: the text records it takes were made by other text encoders than this run loads "
                         f"(same ids and settings): {'; '.join(diff[:3])}. Rerun without the --reuse cache whose "
                         "text settings these are, or with the encoders it was made with")  # fmt: skip
