"""Qwen-Image and Z-Image: the cached text equals the pipeline's ``encode_prompt``, the latents its VAE path.

Tiny random-weight pipelines of the real classes (:mod:`pipeline.embed.families.tiny_qwen`, saved and loaded
with ``from_pretrained``), encoded in process: every caption's stored rows equal the pipeline's own
``encode_prompt([caption])`` bit for bit in fp32 (Qwen-Image: the template's prefix dropped, the rows its mask
keeps; Z-Image: the second-to-last hidden states of the real tokens), bf16 records one rounding of them; the
latents equal what the pipeline's VAE path gives for the same crop (Qwen-Image: normalised per channel by
``QwenImageEditPipeline._encode_vae_image``; Z-Image: the posterior mean, scaled by the loader as the Z-Image
img2img pipeline scales it). A real embed job (Ray) writes the Qwen-Image cache and ``_cache.json`` says how.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from manifests.cache import TextLayout, read_cache_meta
from manifests.errors import UsageError
from manifests.manifest import read_manifest
from pipeline.embed.loading import quiet_loading, to_storage
from pipeline.embed.latents import LatentSpec
from pipeline.embed.encoders import encoder_specs
from pipeline.embed.families import qwen_image
from pipeline.embed.families.tiny import build_tiny
from pipeline.embed.families.tiny_qwen import QWEN3_WIDTH, QWEN_WIDTH
from tests.embed_data import embed_cache, make_dataset, records_by_id

FAMILIES = ("qwen-image", "z-image")
# empty, long (past Qwen-Image's 1024 + 34 tokens and Z-Image's 512: truncated), unicode, spaces, short ones of
# equal token counts (encoded in one group) and of other counts
CAPTIONS = ["a photo of the cat", "", "red dog " * 700, "  The RED Dog, naïve café 漢字 🙂  ", "thing 0",
            "a photo of the dog", "a blue picture"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    quiet_loading()
    base = tmp_path_factory.mktemp("tiny-qwen")
    return {f: str(build_tiny(f, base / f)) for f in FAMILIES}


def _text(family: str, model: str, **options):
    _, spec = encoder_specs(family=family, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None, **options)  # fmt: skip
    return spec.load()


def _reference(family: str, pipe, caption: str, **length) -> torch.Tensor:
    """The pipeline's ``encode_prompt([caption])``: ``(L, D)``, its mask's rows (a one-prompt batch has no pad)."""
    with torch.no_grad():
        if family == "qwen-image":  # as __call__ calls it: its max_sequence_length is 512 unless told otherwise
            length = {"max_sequence_length": qwen_image.CALL_TOKENS, **length}
            embeds, mask = pipe.encode_prompt([caption], device="cpu", **length)
            # all ones (a one-prompt batch): diffusers 0.37+ drops it, 0.36 returns it
            assert mask is None or bool(mask.all()) and mask.shape == embeds.shape[:2]
            return embeds[0]
        (embeds,), _ = pipe.encode_prompt([caption], device="cpu", do_classifier_free_guidance=False, **length)
        return embeds


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_text_equals_the_pipelines_encode_prompt(tiny, family):
    from diffusers import DiffusionPipeline

    encoders = _text(family, tiny[family])
    layout = TextLayout.from_json(encoders.describe()["layout"])
    width = QWEN_WIDTH if family == "qwen-image" else QWEN3_WIDTH
    assert (layout.masked, layout.lengths, layout.widths, layout.pooled_dim) == (True, (
        512,), (width,), None)  # fmt: skip # Qwen-Image: __call__'s 512, not encode_prompt's 1024
    pipe = DiffusionPipeline.from_pretrained(tiny[family])
    if family == "qwen-image":  # the template and the prefix dropped are the pipeline's
        assert (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx) == (qwen_image.TEMPLATE,
                                                                                        qwen_image.DROP)
    encoded = encoders.encode(list(CAPTIONS))
    for caption, (tokens, pooled) in zip(CAPTIONS, encoded):
        want = _reference(family, pipe, caption)
        assert pooled is None and len(tokens) == 1
        assert tokens[0].shape == want.shape and torch.equal(tokens[0], want), caption[:30]  # fp32: bit for bit
        stored = to_storage(tokens[0], "BF16")  # bf16: one rounding of it, no more
        assert np.array_equal(stored, to_storage(want, "BF16"))
    rows = [t[0].shape[0] for t, _ in encoded]
    # only what the transformer sees: Qwen-Image the caption's tokens and the template's 5 closing ones, Z-Image
    # the chat template's 3 + 5 around the caption; a long caption is cut at the pipeline's length
    assert rows[1] == (5 if family == "qwen-image" else 8) and rows[2] == layout.lengths[0]
    # a caption's rows do not depend on the captions encoded beside it
    alone = encoders.encode([CAPTIONS[3]])[0][0][0]
    assert torch.equal(alone, encoded[3][0][0])


@pytest.mark.parametrize("family, tokens", [("qwen-image", 1024), ("qwen-image", 100), ("z-image", 64)])
def test_max_text_tokens_is_the_pipelines_max_sequence_length(tiny, family, tokens):
    from diffusers import DiffusionPipeline

    encoders = _text(family, tiny[family], max_tokens=tokens)
    assert TextLayout.from_json(encoders.describe()["layout"]).lengths == (tokens,)
    pipe = DiffusionPipeline.from_pretrained(tiny[family])
    for caption, ((part,), _) in zip(CAPTIONS, encoders.encode(list(CAPTIONS))):
        assert torch.equal(part, _reference(family, pipe, caption, max_sequence_length=tokens))
    refusal = "the default is 512" if family == "qwen-image" else "it can only be lowered"
    with pytest.raises(UsageError, match=f"--max-text-tokens 4096 is above {family}'s .*{refusal}"):
        _text(family, tiny[family], max_tokens=4096)


def _crops(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (2, 32, 48, 3), dtype=np.uint8)  # (B, H, W, 3)


def _latent_encoder(model: str, family: str, latents: str = "mean"):
    source = encoder_specs(family=family, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                           text_subfolders=None)[0].source  # fmt: skip
    return LatentSpec(source, latents).load()


def test_qwen_image_latents_are_the_pipelines_normalised_vae_path(tiny):
    from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    encoder = _latent_encoder(tiny["qwen-image"], "qwen-image", "posterior")
    pixels = _crops()
    out = encoder.encode(pixels)
    vae = AutoencoderKLQwenImage.from_pretrained(tiny["qwen-image"], subfolder="vae")
    processor = VaeImageProcessor(vae_scale_factor=16)  # the edit pipeline's: 8 x its 2x2 packing
    images = processor.preprocess([Image.fromarray(p) for p in pixels], 32, 48).unsqueeze(2)  # (B, 3, 1, H, W)
    with torch.no_grad():  # the pipeline's own code: retrieve_latents(argmax), then (z - mean) / std per channel
        want = QwenImageEditPipeline._encode_vae_image(SimpleNamespace(vae=vae, latent_channels=16), images, None)
        std = vae.encode(images).latent_dist.std / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    assert out["latent"].shape == (2, 16, 4, 6) and torch.equal(out["latent"], want[:, :, 0])
    assert torch.equal(out["latent_std"], std[:, :, 0])
    info = encoder.describe()
    assert (info["scaling_factor"], info["shift_factor"], info["factor"]) == (1.0, None, 8)
    assert info["normalised"]["latents_std"] == [float(x) for x in vae.config.latents_std]


def test_z_image_latents_are_the_posterior_mean_scaled_as_the_pipeline_scales(tiny):
    from diffusers import AutoencoderKL

    from train.data.batch import latent_normaliser
    from manifests.cache.meta import LatentInfo

    encoder = _latent_encoder(tiny["z-image"], "z-image")
    pixels = _crops(1)
    out = encoder.encode(pixels)
    vae = AutoencoderKL.from_pretrained(tiny["z-image"], subfolder="vae")
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    with torch.no_grad():
        mean = vae.encode(x).latent_dist.mean
    assert torch.equal(out["latent"], mean)
    info = encoder.describe()
    shift, scale = latent_normaliser(LatentInfo(scaling_factor=info["scaling_factor"],
                                                shift_factor=info["shift_factor"]))  # fmt: skip
    # ZImagePipeline decodes latents / scaling_factor + shift_factor: the denoiser's latents are its inverse
    assert (shift, scale) == (vae.config.shift_factor, vae.config.scaling_factor)


@pytest.mark.ray
@pytest.mark.slow
def test_embed_job_writes_the_qwen_image_cache(tiny, tmp_path, ray_local):
    manifest, out = str(tmp_path / "manifest"), str(tmp_path / "cache")
    make_dataset(str(tmp_path / "data"), manifest, 4)
    embed_cache(manifest, out, family="qwen-image", model=tiny["qwen-image"], dtype="fp32")
    meta = read_cache_meta(out)
    assert meta.family == "qwen-image" and meta.text_layout.lengths == (512,)
    assert (meta.latent.scaling_factor, meta.latent.shift_factor, meta.latent.latents_mean) == (1.0, None, None)
    assert "stored normalised" in meta.latent.usage and meta.latent._extra["normalised"]["how"]
    assert meta.settings.hashed["vae"]["normalised"] == meta.latent._extra["normalised"]
    captions = {r["sample_id"]: r["caption"] for r in read_manifest(manifest).samples.to_pylist()}
    records = records_by_id(out)
    assert set(records) == set(captions)
    encoders = _text("qwen-image", tiny["qwen-image"])
    for sample_id, record in records.items():
        (want,), _ = encoders.encode([captions[sample_id] or ""])[0]  # a null caption embeds as ""
        assert record.latent.shape == (16, *(n // 8 for n in record.target_size)) and record.text.dtype == "F32"
        assert np.array_equal(record.text.tokens[0], want.numpy())
