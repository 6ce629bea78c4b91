"""LTX-2 (``ltx-2``): the cache holds what ``LTX2Pipeline`` computes before its transformer, bit for bit in fp32.

A tiny random-weight pipeline of the real classes (:mod:`pipeline.embed.families.tiny_ltx2`), saved and loaded
back with ``from_pretrained``. Text: the cached rows are ``encode_prompt``'s real (unmasked) rows, in order; put
back on the left of 1024 rows (:func:`pipeline.embed.families.ltx2.left_pad`) the pipeline's own connectors give
from them exactly what they give from ``encode_prompt``'s output (its pad rows are never read), in fp32; bf16
records are that rounded once. Latents: a clip's stored latent is ``vae.encode(video).latent_dist.mean`` through
``LTX2Pipeline._normalize_latents`` (the VAE's ``latents_mean``/``latents_std`` buffers), pixels by the
pipeline's ``VideoProcessor``, for ``8k + 1`` frames at 32-pixel multiples.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from manifests.cache import TextLayout
from pipeline.embed.families.ltx2 import left_pad
from pipeline.embed.families.tiny import build_tiny
from pipeline.embed.families.tiny_ltx2 import GEMMA_LAYERS, GEMMA_WIDTH
from pipeline.embed.loading import quiet_loading
from tests.test_families_video import CAPTIONS, _clip, _records, _specs
from pipeline.embed.families.tiny_ltx2 import connectors_supported

pytestmark = pytest.mark.skipif(not connectors_supported(), reason="LTX-2's tiny pipeline needs the LTX-2 text "
                                "connectors of a newer diffusers than this one (0.42.1 has them; 0.37 does not)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    quiet_loading()
    return str(build_tiny("ltx-2", tmp_path_factory.mktemp("tiny-ltx2") / "ltx-2"))


@pytest.fixture(scope="module")
def tiny23(tmp_path_factory) -> str:
    """LTX-2.3's layout of the same classes (per-modality connectors, BWE vocoder): ``--family ltx-2`` takes it."""
    quiet_loading()
    return str(build_tiny("ltx-2", tmp_path_factory.mktemp("tiny-ltx23") / "ltx-2.3", variant="2.3"))


@pytest.mark.parametrize("variant", ["2.0", "2.3"])
def test_cached_text_is_encode_prompts_real_rows_and_the_connectors_give_the_same(request, variant):
    from diffusers import LTX2Pipeline

    tiny = request.getfixturevalue("tiny" if variant == "2.0" else "tiny23")
    encoders = _specs("ltx-2", tiny)[1].load()
    info = encoders.describe()
    layout = TextLayout.from_json(info["layout"])
    width = GEMMA_WIDTH * (GEMMA_LAYERS + 1)
    assert (layout.family, layout.lengths, layout.widths, layout.masked) == ("ltx-2", (1024,), (width,), True)
    assert info["family"] == "ltx-2" and info["pipeline"] == "LTX2Pipeline"
    encoded = encoders.encode(CAPTIONS)
    pipe = LTX2Pipeline.from_pretrained(tiny)
    with torch.no_grad():
        want, want_mask, _, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, device="cpu")
        want_video, want_audio, want_attn = pipe.connectors(want, want_mask, padding_side="left")
    assert want.shape == (len(CAPTIONS), 1024, width)
    counts = want_mask.sum(1)
    assert counts.tolist()[1] == 1 and counts.tolist()[2] == 1024  # "": <bos> alone; the long one truncated
    for dtype, cast in (("F32", lambda t: t), ("BF16", lambda t: t.to(torch.bfloat16).float())):
        joined, mask, pooled = layout.prompt_embeds(_records(encoded, dtype), pad_to=1024)
        assert pooled is None and mask.sum(1).tolist() == counts.tolist()
        for i, n in enumerate(counts.tolist()):  # the stored rows are the real ones, first to last
            assert np.array_equal(joined[i, :n], cast(want[i, 1024 - n :]).numpy()), (dtype, i)
        text, left = left_pad(torch.from_numpy(joined), torch.from_numpy(mask), 1024)
        assert torch.equal(left, want_mask)
        if dtype == "F32":
            with torch.no_grad():
                video, audio, attn = pipe.connectors(text, left, padding_side="left")
            assert torch.equal(video, want_video) and torch.equal(audio, want_audio) and torch.equal(attn, want_attn)


def _pipeline_latents(model: str, clips: np.ndarray, dtype=torch.float32) -> torch.Tensor:
    """The pipeline's VAE path: pixels by its ``VideoProcessor``, the posterior mean, ``_normalize_latents``; the
    VAE loaded and run in ``dtype``."""
    from diffusers import AutoencoderKLLTX2Video, LTX2Pipeline
    from diffusers.video_processor import VideoProcessor
    from PIL import Image

    vae = AutoencoderKLLTX2Video.from_pretrained(model, subfolder="vae", torch_dtype=dtype).eval()
    processor = VideoProcessor(vae_scale_factor=vae.spatial_compression_ratio)
    _, _, h, w, _ = clips.shape
    video = torch.cat([processor.preprocess_video([Image.fromarray(f) for f in c], height=h, width=w) for c in clips])
    with torch.no_grad():
        z = vae.encode(video.to(dtype)).latent_dist.mean
    return LTX2Pipeline._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


def test_bf16_clip_latents_are_within_one_ulp_of_the_pipelines_bf16_vae_path(tiny):
    """The GPU's path (``compute="BF16"`` on this CPU) against the pipeline's with its VAE loaded in bf16: the
    pipeline normalises in bf16, bucketeer in fp32 and rounds once, so they agree within one bf16 ulp (2^-7
    relative)."""
    encoder = _specs("ltx-2", tiny)[0].load(dtype="BF16", compute="BF16")
    clips = np.stack([_clip(17, 64, 96, seed) for seed in (1, 2)])
    got = encoder.encode(clips)["latent"].float()
    want = _pipeline_latents(tiny, clips, torch.bfloat16).float()
    assert got.shape == want.shape and bool(((got - want).abs() <= 2**-7 * want.abs()).all())


def test_clip_latents_are_the_pipelines_vae_path_and_normalisation(tiny):
    from diffusers import AutoencoderKLLTX2Video

    from train.data.batch import latent_normaliser

    encoder = _specs("ltx-2", tiny)[0].load(dtype="F32")
    clips = np.stack([_clip(17, 64, 96, seed) for seed in (1, 2)])  # 8k + 1 frames, 32-pixel multiples
    stored = encoder.encode(clips)["latent"]
    described = encoder.describe()
    want = _pipeline_latents(tiny, clips)
    assert stored.shape == want.shape == (2, 8, 3, 2, 3)
    assert torch.equal(stored, want)  # bit for bit in fp32, stored as the transformer denoises them
    vae = AutoencoderKLLTX2Video.from_pretrained(tiny, subfolder="vae")
    assert (described["class"], described["channels"], described["factor"], described["temporal_factor"]) == (
        "AutoencoderKLLTX2Video", 8, 32, 8)
    assert described["normalised"]["latents_std"] == [float(x) for x in vae.latents_std]
    assert not torch.equal(vae.latents_std, torch.ones(8))  # the normalisation is not the identity
    info = type("Info", (), {k: described.get(k) for k in ("latents_mean", "latents_std", "channels", "shift_factor",
                                                           "scaling_factor")})  # fmt: skip
    assert latent_normaliser(info) == (0.0, 1.0)  # nothing left for the trainer's loader to do
