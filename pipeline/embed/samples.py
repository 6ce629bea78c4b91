"""A sample record from what the VAE gave for an image's variants: which variant is which, and its crop box.

Kept apart from the Ray stages (:mod:`pipeline.embed.workers`): plain functions over numpy arrays that the
tests call directly.
"""

from __future__ import annotations

import numpy as np

from manifests.buckets import parse_bucket
from manifests.frames import parse_video_bucket
from manifests.cache.records import SampleRecord

__all__ = ["variant_pixels", "sample_record"]


def variant_pixels(pixels: np.ndarray, flips: int) -> np.ndarray:
    """``(b, K, H, W, 3)`` crops -> ``(b * K * flips, H, W, 3)`` variants, variant ``v`` = crop ``v // flips``,
    mirrored left-right when ``v % flips``."""
    if flips == 1:
        return pixels.reshape(-1, *pixels.shape[2:])
    both = np.stack([pixels, pixels[:, :, :, ::-1]], axis=2)  # (b, K, 2, H, W, 3)
    return both.reshape(-1, *pixels.shape[2:])


def sample_record(row: dict, bucket: str, dtype: str, latents: np.ndarray, conds: np.ndarray | None,
                  std: np.ndarray | None, flips: int, masks: np.ndarray | None = None, *,
                  features: np.ndarray | None = None, clip_starts: list[int] | None = None,
                  clip_captions: list[int] | None = None) -> SampleRecord:
    """One sample's record from its ``(V, C, h, w)`` variant latents (and its conditioning image's, and its
    variants' ``(V, gh, gw, D)`` float16 DINOv2 ``features``):
    variant 0 in ``latent``, the others in ``variant_latents``; a mirrored variant's crop box is
    mirrored as SDXL expects (``left -> resized_w - left - target_w``). ``masks``: ``(V, h, w)`` uint8
    loss masks of the variants at the latent grid (:func:`pipeline.embed.masks.to_latent_grid`), or None.
    Video (bucket ``WxHxF``): ``latents`` ``(V, C, F', h, w)``, the row's crops are its clips' (one box each)
    and ``clip_starts`` their first frames, ``clip_captions`` their caption indices (their shots', or None);
    variant ``v`` is clip ``v // flips``."""
    bw, bh = parse_video_bucket(bucket)[:2] if bucket.lower().count("x") == 2 else parse_bucket(bucket)
    crops = np.asarray(row["crops"], np.int32).reshape(-1, 2)  # (K, 2) (top, left)
    boxes = np.repeat(crops, flips, axis=0)  # (V, 2)
    flipped = np.tile(np.arange(flips, dtype=np.uint8), len(crops))  # (V,)
    boxes[flipped == 1, 1] = row["resized_w"] - boxes[flipped == 1, 1] - bw
    several = len(latents) > 1
    return SampleRecord(
        sample_id=row["sample_id"], bucket=bucket, latent=latents[0], dtype=dtype,
        original_size=(row["original_h"], row["original_w"]), resized_size=(row["resized_h"], row["resized_w"]),
        crop_top_left=(row["crop_top"], row["crop_left"]), target_size=(bh, bw), caption_key=row["caption_key"],
        caption_keys=None if row.get("caption_keys") is None else tuple(row["caption_keys"]),  # identity: every caption
        latent_std=std, cond_latent=None if conds is None else conds[0],
        variant_latents=latents[1:] if several else None,
        variant_cond_latents=conds[1:] if several and conds is not None else None,
        variant_crops=boxes if several else None, variant_flips=flipped if several else None,
        features=None if features is None else features[0],
        variant_features=features[1:] if several and features is not None else None,
        mask=None if masks is None else masks[0], variant_masks=masks[1:] if several and masks is not None else None,
        clip_starts=None if clip_starts is None else np.repeat(np.asarray(clip_starts, np.int32), flips),
        variant_captions=None if clip_captions is None else np.repeat(np.asarray(clip_captions, np.int32), flips),
        content=row.get("content"),  # the image's sha256: with the geometry, the latent's identity (embed --reuse)
    )  # fmt: skip
