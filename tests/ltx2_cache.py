"""A tiny LTX-2 video cache and its plans, written with the project's cache and plan writers (no Ray, no VAE run).

What ``bucketeer embed --family ltx-2`` writes for a video manifest, in small: sample records whose latent is
``(8, F', h, w)`` (stored normalised, as the transformer denoises it; BF16), a clip of a longer video as a variant
of its sample record, Gemma text of the ``ltx-2`` layout (masked, real rows only, 96 features: 32 wide x 3 hidden
states), the empty caption and two validation prompts, and ``_cache.json`` ``latent`` with ``temporal_factor`` 8
and ``normalised``. The model is the tiny random ``LTX2Pipeline`` folder (``build_tiny("ltx-2")``).

Buckets ``WxHxF``: ``64x64x9`` (4 clips, latents ``(8, 2, 2, 2)``) and ``96x64x17`` (2 clips, ``(8, 3, 2, 3)``);
sample 0 holds 2 clips (variants). Plans: 1 rank x 2 and 2 ranks x 1, 3 epochs of 3 steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from manifests.buckets import BucketSpec
from manifests.cache import TextLayout
from manifests.cache.records import SampleRecord, caption_key
from tests.test_cache_format import bf16_bits
from tests.wan_cache import PROMPTS, WanData, write

CLIPS = [("64x64x9", 2), ("64x64x9", 1), ("64x64x9", 1), ("64x64x9", 1), ("96x64x17", 1), ("96x64x17", 1)]
CHANNELS, SPATIAL, TEMPORAL, TEXT_TOKENS = 8, 32, 8, 1024


def latent_shape(bucket: str) -> tuple[int, int, int, int]:
    """``(C, F', h, w)`` of a ``WxHxF`` bucket's clip through LTX-2's VAE (causal: ``(F - 1) / 8 + 1`` frames)."""
    w, h, f = (int(x) for x in bucket.split("x"))
    return CHANNELS, (f - 1) // TEMPORAL + 1, h // SPATIAL, w // SPATIAL


def _sample(i: int, bucket: str, clips: int, caption: str | None, rng: np.random.Generator) -> SampleRecord:
    draws = [bf16_bits(rng.normal(size=latent_shape(bucket))) for _ in range(clips)]
    w, h, _ = (int(x) for x in bucket.split("x"))
    extra = {}
    if clips > 1:  # a long video: its clips are variants of one record, chosen per epoch
        extra = dict(variant_latents=np.stack(draws[1:]), variant_crops=np.zeros((clips, 2), np.int32),
                     variant_flips=np.zeros(clips, np.uint8))  # fmt: skip
    return SampleRecord(sample_id=1000 + i, bucket=bucket, latent=draws[0], dtype="BF16", original_size=(h, w),
                        resized_size=(h, w), crop_top_left=(0, 0), target_size=(h, w), caption_key=caption_key(caption),
                        **extra)  # fmt: skip


def build(base: Path) -> WanData:
    """Write the model folder, cache and plans under ``base`` (once; later calls reuse them)."""
    from pipeline.embed.families.ltx2 import LATENT_USAGE, NORMALISED
    from pipeline.embed.families.tiny import build_tiny
    from pipeline.embed.families.tiny_ltx2 import GEMMA_LAYERS, GEMMA_WIDTH

    data = WanData(str(base / "ltx-2"), str(base / "cache"), str(base / "plan"), str(base / "plan2"))
    if (Path(data.plan2) / "_plan.json").exists():
        return data
    build_tiny("ltx-2", data.model)
    width = GEMMA_WIDTH * (GEMMA_LAYERS + 1)
    layout = TextLayout(family="ltx-2", join="features", masked=True, lengths=(TEXT_TOKENS,), widths=(width,))
    settings = {"family": "ltx-2", "dtype": "BF16", "model": data.model, "latent": "posterior_mean",
                "buckets": BucketSpec(area=64 * 64, step=32).to_json(),
                "vae": {"id": data.model, "subfolder": "vae", "class": "AutoencoderKLLTX2Video", "factor": SPATIAL,
                        "channels": CHANNELS}}  # fmt: skip
    info = {"family": "ltx-2",
            "latent": {"kind": "posterior_mean", "dtype": "BF16", "channels": CHANNELS, "factor": SPATIAL,
                       "scaling_factor": 1.0, "usage": LATENT_USAGE, "temporal_factor": TEMPORAL,
                       "normalised": {"how": NORMALISED}},
            "text": {"family": "ltx-2", "pipeline": "LTX2Pipeline", "dtype": "BF16", "layout": layout.to_json(),
                     "empty_caption_key": caption_key(""),
                     "validation_prompts": [{"prompt": p, "caption_key": caption_key(p)} for p in PROMPTS]},
            }  # fmt: skip
    rng = np.random.default_rng(41)
    return write(data, settings, info, width, rng, CLIPS,
                 lambda i, bucket, clips, caption: _sample(i, bucket, clips, caption, rng))
