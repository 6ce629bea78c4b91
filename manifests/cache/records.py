"""The cache's records: what a sample record and a text record hold, and their bytes.

The bytes of a record (gzip'd tensors and string metadata, no pickle; the ``planar`` layout that
writers write and the ``plain`` one of older caches) are :mod:`manifests.cache.codec`'s; its names
are re-exported here. Tensors come back as numpy arrays (a BF16 tensor as its raw ``uint16`` bits
with the tag ``"BF16"``); :func:`to_torch` turns ``(array, tag)`` into a torch tensor (torch
imported only when called).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from manifests.cache.compact import compact_tokens, expanded_tokens
from manifests.cache.codec import (
    DTYPES,
    GZIP_BACKEND,
    RECORD_LAYOUT,
    RecordError,
    crc32,
    decode_record,
    decode_tensors,
    encode_record,
    encode_tensors,
    gzip_compress,
    gzip_decompress,
)

__all__ = [
    "GZIP_BACKEND",
    "RECORD_LAYOUT",
    "RecordError",
    "gzip_compress",
    "gzip_decompress",
    "crc32",
    "encode_tensors",
    "decode_tensors",
    "encode_record",
    "decode_record",
    "caption_key",
    "to_torch",
    "to_float32",
    "DTYPES",
    "SampleRecord",
    "TextRecord",
    "encode_sample",
    "decode_sample",
    "encode_text",
    "decode_text",
    "sample_mismatch",
    "text_mismatch",
]


def caption_key(caption: str | None) -> int:
    """uint64 key of a caption's text record; a missing caption is the empty string's embedding."""
    text = caption or ""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def to_float32(array: np.ndarray, tag: str) -> np.ndarray:
    """Widen a stored tensor to float32 numpy (BF16 bits shifted into the high half of a float32)."""
    if tag == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def to_torch(array: np.ndarray, tag: str):
    """A torch tensor with the stored dtype (``torch.bfloat16`` for BF16); imports torch lazily.

    The tensor owns a copy of the data (the record's buffer is read-only).
    """
    import torch

    if tag == "BF16":
        return torch.from_numpy(array.astype(np.int16, copy=True)).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


@dataclass(frozen=True)
class TextRecord:
    """Text embeddings of one unique caption (the null caption is stored as ``""``).

    ``tokens[i]``: ``(L_i, D_i)`` token embeddings of text part ``i``; ``pooled``: ``(P,)`` or None.
    What the parts are (which encoder and layer, padded or only the real tokens) and how they join
    into the model family's prompt embeddings is the cache's ``text.layout``
    (:class:`manifests.cache.text_layout.TextLayout`). Arrays are in ``dtype`` (a safetensors tag;
    BF16 as raw uint16 bits, see :func:`to_torch`).
    """

    caption_key: int
    tokens: tuple[np.ndarray, ...]
    pooled: np.ndarray | None
    dtype: str

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(int(t.shape[0]) for t in self.tokens)


@dataclass(frozen=True)
class SampleRecord:
    """Everything the trainer needs for one image, with its caption's text embeddings joined in.

    Sizes and positions are ``(height, width)`` / ``(top, left)`` in pixels, the order SDXL's
    micro-conditioning uses (``original_size``, ``crops_coords_top_left``, ``target_size``):

    - ``original_size``: the decoded image, display orientation (after EXIF transpose);
    - ``resized_size``: after resizing to cover the bucket; the crop box lives in these pixels:
      ``crop_box = (top, left, top + target_h, left + target_w)``;
    - ``target_size``: the bucket, ``(height, width)``; ``bucket`` is the same as ``"WxH"``.

    ``latent``: ``(C, target_h / f, target_w / f)``, the VAE posterior **mean** (not a sample), NOT
    yet multiplied by ``scaling_factor`` (see ``_cache.json["latent"]``). ``latent_std``: the
    posterior's standard deviation, same shape, only in caches embedded with ``--latents posterior``
    (a sample is ``latent + latent_std * noise``). ``text``: the caption's :class:`TextRecord`.
    ``dtype`` is the safetensors tag of ``latent`` and ``latent_std`` (BF16 as uint16 bits).

    Additive, absent from caches made without them (old readers ignore the extra tensors):
    ``cond_latent`` (C, h, w): the paired conditioning image (``scan --conditioning``) encoded with the
    same resize and crop (a reference family's, Qwen-Image-Edit: then resized to its reference size, so its
    ``(h, w)`` may differ from ``latent``'s; ``_cache.json`` ``settings.conditioning`` says which).
    Variants (``embed --flip`` / ``--crops K``; V = K crops x 1 or 2 flips, variant ``v`` = crop ``v // flips``,
    flipped when ``v % flips``): ``latent``, ``cond_latent`` and
    ``crop_top_left`` are variant 0; ``variant_latents`` and ``variant_cond_latents`` (V-1, C, h, w)
    the others; ``variant_crops`` (V, 2) int32 every variant's ``(top, left)`` (a flipped variant's
    mirrored, as SDXL expects: ``left -> resized_w - left - target_w``); ``variant_flips`` (V,) uint8.
    :meth:`variant` gives one variant as a plain record. ``features`` (gh, gw, D) float16 (``F16``, whatever
    ``dtype`` says): DINOv2 patch tokens of variant 0's pixels (``embed --features``, REPA; how they were made is
    ``_cache.json`` ``features``), ``variant_features`` (V-1, gh, gw, D) the other variants'.
    ``content``: the sha256 (hex) of the image bytes the latents were made from (None in records written before it);
    with the bucket and the geometry it is the latent's identity (:func:`manifests.cache.identity.latent_key`), by
    which ``embed --reuse`` takes the record for the same image in another dataset.
    ``caption_keys``: every caption's key of a sample embedded with several (the first is ``caption_key``), as the
    index lists them; None otherwise.
    ``mask`` (h, w) uint8 0..255: the sample's loss mask (``scan --masks``) at the latent grid, cropped and
    flipped like variant 0 and area-averaged over each latent pixel (255 = inside); ``variant_masks``
    (V-1, h, w) the other variants'. None for a sample without a mask (it trains unmasked).

    A video cache's records (bucket ``WxHxF``): ``latent`` is ``(C, F', h, w)``, F' = (F - 1) //
    temporal_factor + 1 (``_cache.json`` latent), ``variant_latents`` ``(V-1, C, F', h, w)``; each variant is a
    clip (or a clip mirrored, with ``--flip``) and ``clip_starts`` (V,) int32 gives the first frame of each
    variant's clip in the video (0 for an image of a video manifest, a 1-frame clip). None in image caches.
    ``variant_captions`` (V,) int32: each variant's index into the sample's captions (``caption_keys``, or the one
    ``caption_key``): the caption of the shot its clip lies in (``rebucket --scenes`` of captioned shots); the
    trainer takes that caption with the variant (:func:`train.data.draws.variant_text_keys`). None otherwise.
    """

    sample_id: int
    bucket: str
    latent: np.ndarray
    dtype: str
    original_size: tuple[int, int]
    resized_size: tuple[int, int]
    crop_top_left: tuple[int, int]
    target_size: tuple[int, int]
    caption_key: int
    text: TextRecord | None = None
    latent_std: np.ndarray | None = None
    cond_latent: np.ndarray | None = None
    variant_latents: np.ndarray | None = None
    variant_cond_latents: np.ndarray | None = None
    variant_crops: np.ndarray | None = None
    variant_flips: np.ndarray | None = None
    caption_keys: tuple[int, ...] | None = None
    features: np.ndarray | None = None
    variant_features: np.ndarray | None = None
    mask: np.ndarray | None = None
    variant_masks: np.ndarray | None = None
    clip_starts: np.ndarray | None = None
    variant_captions: np.ndarray | None = None
    content: str | None = None  # sha256 (hex) of the image's bytes: with the geometry, the latent's identity

    @property
    def variants(self) -> int:
        """How many variants the record holds (1 without ``--flip`` / ``--crops``)."""
        return 1 if self.variant_latents is None else 1 + len(self.variant_latents)

    def variant(self, v: int) -> SampleRecord:
        """Variant ``v`` (0 <= v < :attr:`variants`) as a one-variant record: its latent(s) and crop box."""
        if not 0 <= v < self.variants:
            raise IndexError(f"sample {self.sample_id} has {self.variants} variants, not {v + 1}")
        one = {"variant_latents": None, "variant_cond_latents": None, "variant_crops": None, "variant_flips": None,
               "variant_features": None, "variant_masks": None,
               "clip_starts": None if self.clip_starts is None else self.clip_starts[v : v + 1],
               "variant_captions": None if self.variant_captions is None else self.variant_captions[v : v + 1]}
        if v == 0:
            return replace(self, **one)
        cond = None if self.variant_cond_latents is None else self.variant_cond_latents[v - 1]
        features = None if self.variant_features is None else self.variant_features[v - 1]
        mask = None if self.variant_masks is None else self.variant_masks[v - 1]
        top, left = (int(x) for x in self.variant_crops[v])
        return replace(self, latent=self.variant_latents[v - 1], cond_latent=cond, crop_top_left=(top, left),
                       features=features, mask=mask, **one)  # fmt: skip

    @property
    def crop_box(self) -> tuple[int, int, int, int]:
        """``(top, left, bottom, right)`` of the crop, in resized pixels."""
        top, left = self.crop_top_left
        return top, left, top + self.target_size[0], left + self.target_size[1]

    def torch(self) -> dict[str, Any]:
        """The tensors as torch tensors in their stored dtype (imports torch only here).

        Keys: ``latent`` (C, h, w) and ``latent_std``, ``cond_latent`` when present; ``tokens_<i>`` (L_i, D_i) per
        text part; ``pooled`` (D,) when present; ``time_ids`` int64 (6,) = original_size +
        crop_top_left + target_size.
        """
        import torch

        out = {"latent": to_torch(self.latent, self.dtype)}
        if self.latent_std is not None:
            out["latent_std"] = to_torch(self.latent_std, self.dtype)
        if self.cond_latent is not None:
            out["cond_latent"] = to_torch(self.cond_latent, self.dtype)
        if self.text is not None:
            for i, t in enumerate(self.text.tokens):
                out[f"tokens_{i}"] = to_torch(t, self.text.dtype)
            if self.text.pooled is not None:
                out["pooled"] = to_torch(self.text.pooled, self.text.dtype)
        out["time_ids"] = torch.tensor([*self.original_size, *self.crop_top_left, *self.target_size])
        return out


def _pair(text: str) -> tuple[int, int]:
    a, b = text.split(",")
    return int(a), int(b)


def encode_sample(record: SampleRecord, inline_text: bool = False, layout: str = RECORD_LAYOUT,
                  compact: str | None = None) -> bytes:  # fmt: skip
    """The compressed bytes of a sample record.

    Its text is stored separately, by caption, unless ``inline_text``: then ``record.text`` (the text
    record of ``record.caption_key``, a caption no other sample has) goes into the same record (``compact``: as
    :func:`encode_text`), so a reader fetches both with one ranged read, and the caption's text index row names
    this record too. ``layout``: :mod:`manifests.cache.codec`'s (``plain``: to write caches as older versions did).
    """
    meta = {
        "kind": "sample",
        "sample_id": str(record.sample_id),
        "bucket": record.bucket,
        "original_size": "%d,%d" % record.original_size,
        "resized_size": "%d,%d" % record.resized_size,
        "crop_top_left": "%d,%d" % record.crop_top_left,
        "target_size": "%d,%d" % record.target_size,
        "caption_key": str(record.caption_key),
    }
    if record.content is not None:  # the image's identity (embed --reuse checks it on a record it takes)
        meta["content"] = record.content
    if record.caption_keys:  # the sample's identity covers every caption a plan may choose
        meta["caption_keys"] = ",".join(str(int(k)) for k in record.caption_keys)
    tensors = {"latent": (record.latent, record.dtype)}
    if record.latent_std is not None:
        tensors["latent_std"] = (record.latent_std, record.dtype)
    for name in ("cond_latent", "variant_latents", "variant_cond_latents"):
        if getattr(record, name) is not None:
            tensors[name] = (getattr(record, name), record.dtype)
    for name in ("features", "variant_features"):  # float16 whatever the latents' dtype
        if getattr(record, name) is not None:
            tensors[name] = (np.asarray(getattr(record, name), "<f2"), "F16")
    if record.variant_crops is not None:
        tensors["variant_crops"] = (np.asarray(record.variant_crops, "<i4"), "I32")
        tensors["variant_flips"] = (np.asarray(record.variant_flips, "u1"), "U8")
    for name in ("mask", "variant_masks"):  # loss masks: uint8 at the latent grid (additive: old readers skip them)
        if getattr(record, name) is not None:
            tensors[name] = (np.asarray(getattr(record, name), "u1"), "U8")
    if record.clip_starts is not None:  # video: each variant's first frame in its video
        tensors["clip_starts"] = (np.asarray(record.clip_starts, "<i4"), "I32")
    if record.variant_captions is not None:  # each variant's caption index (its shot's); old readers skip it
        tensors["variant_captions"] = (np.asarray(record.variant_captions, "<i4"), "I32")
    if inline_text:
        text = record.text
        assert text is not None and text.caption_key == record.caption_key, "inline text: the sample's own caption's"
        tensors.update(_text_tensors(text, "text.", compact))
        meta["text_encoders"] = str(len(text.tokens))
    return encode_record(tensors, meta, layout)


def decode_sample(data: bytes) -> SampleRecord:
    """Inverse of :func:`encode_sample` (``text`` is None unless the record holds it inline); raises
    RecordError for bad bytes."""
    tensors, meta = decode_record(data)
    try:
        if meta.get("kind") != "sample" or "latent" not in tensors:
            raise KeyError("kind")
        latent, tag = tensors["latent"]
        std = tensors.get("latent_std")
        if std is not None and (std[1] != tag or std[0].shape != latent.shape):
            raise ValueError("latent_std")
        extra = _variants(tensors, latent, tag)
        return SampleRecord(
            sample_id=int(meta["sample_id"]),
            bucket=meta["bucket"],
            latent=latent,
            dtype=tag,
            original_size=_pair(meta["original_size"]),
            resized_size=_pair(meta["resized_size"]),
            crop_top_left=_pair(meta["crop_top_left"]),
            target_size=_pair(meta["target_size"]),
            caption_key=int(meta["caption_key"]),
            latent_std=None if std is None else std[0],
            caption_keys=tuple(int(k) for k in meta["caption_keys"].split(",")) if meta.get("caption_keys") else None,
            text=_inline_text(tensors, meta),
            content=meta.get("content"),
            **extra,
        )
    except (KeyError, ValueError):
        raise RecordError("payload is not a sample record (metadata or latent missing, or a latent_std, variant "
                          "or mask tensors that do not match the latent)") from None


def _variants(tensors: dict[str, tuple[np.ndarray, str]], latent: np.ndarray, tag: str) -> dict[str, Any]:
    """The optional conditioning and variant tensors of a sample record, checked against its latent."""
    out: dict[str, Any] = {}
    for name in ("cond_latent", "variant_latents", "variant_cond_latents"):
        if name in tensors:
            array, t = tensors[name]
            # a conditioning latent has the latent's channels, at its own grid (a reference's may differ)
            like = array.shape if name == "cond_latent" else array.shape[-latent.ndim:]
            if t != tag or len(like) != latent.ndim or like[0] != latent.shape[0] or \
                    (name == "variant_latents" and like != latent.shape):  # fmt: skip
                raise ValueError(name)
            out[name] = array
    if "features" in tensors:
        features, t = tensors["features"]
        if t != "F16" or features.ndim != 3:
            raise ValueError("features")
        out["features"] = features
    if "variant_features" in tensors:
        many, t = tensors["variant_features"]
        if "features" not in out or t != "F16" or many.shape[1:] != out["features"].shape or \
                "variant_latents" not in out or len(many) != len(out["variant_latents"]):  # fmt: skip
            raise ValueError("variant_features")
        out["variant_features"] = many
    if "variant_latents" in out:
        if "features" in out and "variant_features" not in out:
            raise ValueError("variant_features")
        v = len(out["variant_latents"]) + 1
        crops, flips = tensors["variant_crops"][0], tensors["variant_flips"][0]
        if crops.shape != (v, 2) or flips.shape != (v,):
            raise ValueError("variant_crops")
        conds = out.get("variant_cond_latents")
        if (conds is not None) != ("cond_latent" in out) or (conds is not None and (
                len(conds) != v - 1 or conds.shape[1:] != out["cond_latent"].shape)):  # fmt: skip
            raise ValueError("variant_cond_latents")
        out["variant_crops"], out["variant_flips"] = crops, flips
    if "mask" in tensors:  # a loss mask: (h, w) and (V-1, h, w) uint8 at the latent grid
        mask, t = tensors["mask"]
        if t != "U8" or mask.shape != latent.shape[-2:]:
            raise ValueError("mask")
        out["mask"] = mask
        want = (len(out["variant_latents"]), *latent.shape[-2:]) if "variant_latents" in out else None
        masks = tensors.get("variant_masks")
        if (masks is None) != (want is None) or (masks is not None and (masks[1] != "U8" or masks[0].shape != want)):
            raise ValueError("variant_masks")
        if masks is not None:
            out["variant_masks"] = masks[0]
    if "clip_starts" in tensors:  # video: (V,) int32, one per variant
        starts, t = tensors["clip_starts"]
        if t != "I32" or starts.shape != (len(out.get("variant_latents", ())) + 1,):
            raise ValueError("clip_starts")
        out["clip_starts"] = starts
    if "variant_captions" in tensors:  # (V,) int32, one per variant, within the sample's captions
        on, t = tensors["variant_captions"]
        if t != "I32" or on.shape != (len(out.get("variant_latents", ())) + 1,) or (on < 0).any():
            raise ValueError("variant_captions")
        out["variant_captions"] = on
    return out


def _text_tensors(record: TextRecord, prefix: str = "", mode: str | None = None) -> dict[str, tuple[np.ndarray, str]]:
    tensors = compact_tokens([to_float32(t, record.dtype) for t in record.tokens], prefix, mode) if mode else \
        {f"{prefix}tokens.{i}": (t, record.dtype) for i, t in enumerate(record.tokens)}  # compact: float8 + scales
    if record.pooled is not None:
        tensors[f"{prefix}pooled"] = (record.pooled, record.dtype)
    return tensors


def _text_of(tensors: dict[str, tuple[np.ndarray, str]], key: str, count: str, prefix: str = "") -> TextRecord:
    """The TextRecord of caption ``key`` from ``count`` token parts named ``<prefix>tokens.<i>``; KeyError/ValueError
    when they are missing."""
    n = int(count)
    tokens = tuple(tensors[f"{prefix}tokens.{i}"][0] for i in range(n))
    tags = {tensors[f"{prefix}tokens.{i}"][1] for i in range(n)}
    pooled = tensors[f"{prefix}pooled"][0] if f"{prefix}pooled" in tensors else None
    if "F8_E4M3" in tags:  # compact: the token parts dequantized, the pooled vector widened, all float32
        tokens, tags = expanded_tokens(tensors, prefix, n), {"F32"}
        pooled = None if pooled is None else to_float32(pooled, tensors[f"{prefix}pooled"][1])
    return TextRecord(caption_key=int(key), tokens=tokens, pooled=pooled, dtype=tags.pop() if tags else "F32")


def _inline_text(tensors: dict[str, tuple[np.ndarray, str]], meta: dict[str, str]) -> TextRecord | None:
    """A sample record's inline text (its first caption's), or None when its text is stored apart."""
    if "text_encoders" not in meta:
        return None
    return _text_of(tensors, meta["caption_key"], meta["text_encoders"], "text.")


def encode_text(record: TextRecord, layout: str = RECORD_LAYOUT, compact: str | None = None) -> bytes:
    """The compressed bytes of a caption's text record; ``compact="fp8"``: its token parts as float8 codes
    (:func:`manifests.cache.compact.compact_tokens`), which :func:`decode_text` gives back as float32 (``F32``)."""
    meta = {"kind": "text", "caption_key": str(record.caption_key), "encoders": str(len(record.tokens))}
    return encode_record(_text_tensors(record, mode=compact), meta, layout)


def decode_text(data: bytes) -> TextRecord:
    """Inverse of :func:`encode_text`, or the inline text of a sample record (:func:`encode_sample` with
    ``inline_text``: a caption only that sample has; its text index row names the sample's record).
    Raises RecordError for bad bytes."""
    tensors, meta = decode_record(data)
    try:
        if meta.get("kind") == "sample" and "text_encoders" in meta:
            return _inline_text(tensors, meta)
        if meta.get("kind") != "text":
            raise KeyError("kind")
        return _text_of(tensors, meta["caption_key"], meta["encoders"])
    except (KeyError, ValueError):
        raise RecordError("payload is not a text record (metadata or tensors missing)") from None


def sample_mismatch(record: SampleRecord, sample_id: int, caption_key: int, caption_keys=None) -> str | None:
    """What of ``record``'s own identity differs from the index row that named it (``sample_id``, the
    first caption's ``caption_key``, every caption's ``caption_keys`` or None); None when it is that row's.

    A record written before it carried ``caption_keys`` is compared on the rest. The text is one clause
    for a one-line error: the index and the shards disagree, so a sample would train on another's
    latent or caption.
    """
    if record.sample_id != int(sample_id):
        return f"the index names sample {int(sample_id)} but the record holds sample {record.sample_id}"
    if record.caption_key != int(caption_key):
        return (f"the index gives sample {record.sample_id} caption key {int(caption_key)} but its record was "
                f"embedded with caption key {record.caption_key}")  # fmt: skip
    listed = None if caption_keys is None or len(caption_keys) == 0 else tuple(int(k) for k in caption_keys)
    if record.caption_keys is not None and listed is not None and record.caption_keys != listed:
        return (f"the index gives sample {record.sample_id} caption keys {list(listed)} but its record was "
                f"embedded with {list(record.caption_keys)}")  # fmt: skip
    return None


def text_mismatch(record: TextRecord, caption_key: int) -> str | None:
    """How ``record`` is not the text record of ``caption_key`` that the index named; None when it is."""
    if record.caption_key != int(caption_key):
        return f"the index names caption key {int(caption_key)} but the text record holds {record.caption_key}"
    return None
