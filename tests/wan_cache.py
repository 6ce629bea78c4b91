"""A tiny Wan video cache and its plans, written with the project's cache and plan writers (no Ray, no VAE run).

What ``bucketeer embed --family wan`` writes for a video manifest, in small: sample records whose latent is
``(C, F', H', W')`` (the posterior mean, not normalised; BF16), a clip of a longer video as a variant of its
sample record, UMT5 text of the ``wan`` layout (masked, real tokens only, up to 512), the empty caption and two
validation prompts, and ``_cache.json`` ``latent`` with the VAE's ``latents_mean``/``latents_std`` and
``temporal_factor``. The model is the tiny random ``WanPipeline`` folder (``build_tiny("wan")``); the cache
names it as its ``--model``, so the trainer starts from it.

Buckets ``WxHxF``: ``64x64x9`` (4 clips, latents ``(16, 3, 8, 8)``) and ``64x32x5`` (2 clips,
``(16, 2, 4, 8)``); sample 0 holds 2 clips (variants). Plans: 1 rank x 2 and 2 ranks x 1, 3 epochs of 3 steps.
``build(base, family)`` writes the same for ``wan2.2-a14b`` (the two-expert folder, Wan 2.1's VAE) and
``wan2.2-ti2v-5b`` (Wan 2.2's VAE: 48 channels, 16x spatial: ``(48, 3, 4, 4)`` and ``(48, 2, 2, 4)``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from manifests.buckets import BucketSpec
from manifests.cache import CacheWriter, TextLayout
from manifests.cache.records import SampleRecord, TextRecord, caption_key, encode_sample, encode_text
from manifests.plan import DatasetSamples, PlanConfig, write_plan
from tests.test_cache_format import bf16_bits

CAPTIONS = ("a red cat", "a blue dog", None)
PROMPTS = ("a red cat", "the thing")
# (bucket, clips): the first sample is a video long enough for two 9-frame clips
CLIPS = [("64x64x9", 2), ("64x64x9", 1), ("64x64x9", 1), ("64x64x9", 1), ("64x32x5", 1), ("64x32x5", 1)]
TEMPORAL, SPATIAL, TEXT_TOKENS = 4, 8, 512


@dataclass(frozen=True)
class WanData:
    model: str  # the tiny WanPipeline folder
    cache: str
    plan: str  # 1 rank x 2 clips, 3 epochs of 3 steps
    plan2: str  # 2 ranks x 1 clip, the same global batches


VAES = {"wan": (16, SPATIAL), "wan2.2-a14b": (16, SPATIAL), "wan2.2-ti2v-5b": (48, 16)}  # (channels, factor)


def latent_shape(bucket: str, family: str = "wan") -> tuple[int, int, int, int]:
    """``(C, F', H', W')`` of a ``WxHxF`` bucket's clip through the family's VAE (causal: ``(F - 1) / 4 + 1``
    frames)."""
    w, h, f = (int(x) for x in bucket.split("x"))
    channels, factor = VAES[family]
    return channels, (f - 1) // TEMPORAL + 1, h // factor, w // factor


def _text(caption: str | None, width: int, rng: np.random.Generator) -> TextRecord:
    rows = 1 if not caption else 3 + len(caption) % 4  # real tokens only (the empty caption: </s>)
    return TextRecord(caption_key=caption_key(caption), tokens=(bf16_bits(rng.normal(size=(rows, width))),),
                      pooled=None, dtype="BF16")  # fmt: skip


def _sample(i: int, bucket: str, clips: int, caption: str | None, mean: np.ndarray, std: np.ndarray,
            rng: np.random.Generator, family: str) -> SampleRecord:  # fmt: skip
    shape = latent_shape(bucket, family)
    draws = [bf16_bits(mean[:, None, None, None] + std[:, None, None, None] * rng.normal(size=shape))
             for _ in range(clips)]  # fmt: skip
    w, h, _ = (int(x) for x in bucket.split("x"))
    extra = {}
    if clips > 1:  # a long video: its clips are variants of one record, chosen per epoch
        extra = dict(variant_latents=np.stack(draws[1:]), variant_crops=np.zeros((clips, 2), np.int32),
                     variant_flips=np.zeros(clips, np.uint8))  # fmt: skip
    return SampleRecord(sample_id=1000 + i, bucket=bucket, latent=draws[0], dtype="BF16", original_size=(h, w),
                        resized_size=(h, w), crop_top_left=(0, 0), target_size=(h, w), caption_key=caption_key(caption),
                        **extra)  # fmt: skip


def build(base: Path, family: str = "wan") -> WanData:
    """Write the model folder, cache and plans of ``family`` under ``base`` (once; later calls reuse them)."""
    from pipeline.embed.families.tiny import UMT5_WIDTH, build_tiny

    data = WanData(str(base / family), str(base / "cache"), str(base / "plan"), str(base / "plan2"))
    if (Path(data.plan2) / "_plan.json").exists():
        return data
    build_tiny(family, data.model)
    channels, factor = VAES[family]
    vae = json.loads((Path(data.model) / "vae" / "config.json").read_text())
    mean, std = np.asarray(vae["latents_mean"]), np.asarray(vae["latents_std"])
    layout = TextLayout(family=family, join="features", masked=True, lengths=(TEXT_TOKENS,), widths=(UMT5_WIDTH,))
    settings = {"family": family, "dtype": "BF16", "model": data.model, "latent": "posterior_mean",
                "buckets": BucketSpec(area=64 * 64, step=32).to_json(),
                "vae": {"id": data.model, "subfolder": "vae", "class": "AutoencoderKLWan", "factor": factor,
                        "channels": channels}}  # fmt: skip
    info = {"family": family,
            "latent": {"kind": "posterior_mean", "dtype": "BF16", "channels": channels, "factor": factor,
                       "latents_mean": mean.tolist(), "latents_std": std.tolist(), "temporal_factor": TEMPORAL},
            "text": {"family": family, "pipeline": "WanPipeline", "dtype": "BF16", "layout": layout.to_json(),
                     "empty_caption_key": caption_key(""),
                     "validation_prompts": [{"prompt": p, "caption_key": caption_key(p)} for p in PROMPTS]},
            }  # fmt: skip
    rng = np.random.default_rng(28)
    return write(data, settings, info, UMT5_WIDTH, rng, CLIPS,
                 lambda i, bucket, clips, caption: _sample(i, bucket, clips, caption, mean, std, rng, family))


def write(data: WanData, settings: dict, info: dict, width: int, rng: np.random.Generator,
          videos: list[tuple[str, int]], sample) -> WanData:
    """The cache (one text record per caption, ``sample(i, bucket, clips, caption)`` per ``(bucket, clips)`` of
    ``videos``) and its two plans (1 rank x 2, 2 ranks x 1) under ``data``: what a video family's train tests
    read."""
    writer = CacheWriter(data.cache, settings, info=info, shard_records=4)
    for caption in dict.fromkeys(c or "" for c in (*CAPTIONS, "", *PROMPTS)):  # one text record per caption
        writer.add_text(caption_key(caption), encode_text(_text(caption, width, rng)))
    writer.commit("texts")
    records = [sample(i, bucket, clips, CAPTIONS[i % 3]) for i, (bucket, clips) in enumerate(videos)]
    for r in records:
        writer.add_sample(r.sample_id, encode_sample(r), r.caption_key, r.bucket)
    meta = writer.finish()
    ids = np.asarray([r.sample_id for r in records], np.uint64)
    buckets = pa.array([r.bucket for r in records])
    for url, world, batch in ((data.plan, 1, 2), (data.plan2, 2, 1)):  # the project's plan writer over WxHxF
        write_plan(url, [DatasetSamples(ids, buckets, cache_fingerprint=meta.fingerprint, cache=data.cache)],
                   PlanConfig(world_size=world, batch_size=batch, epochs=3, seed=5))  # fmt: skip
    return data

