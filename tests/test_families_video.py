"""Wan 2.2 (``wan2.2-a14b``, ``wan2.2-ti2v-5b``): the cache holds what ``WanPipeline`` gives its transformers.

Tiny random-weight pipelines of the real classes (:mod:`pipeline.embed.families.tiny_wan22`), saved and loaded
back with ``from_pretrained``: the cached text, zero-padded to 512 by the layout, equals ``encode_prompt`` bit for
bit in fp32 (bf16 records: that rounded once); a clip's latent, normalised as the trainer's loader normalises it,
equals the pipelines' VAE path (``retrieve_latents(vae.encode(video), sample_mode="argmax")``, then
``(z - latents_mean) * (1 / latents_std)``, as ``WanVideoToVideoPipeline.prepare_latents`` does) bit for bit in fp32,
for Wan 2.1's VAE (A14B) and Wan 2.2's 48-channel patchified one (TI2V-5B). A ``WanPipeline`` folder of another
kind (two experts, ``expand_timesteps``, neither) is refused at embed in one line naming its family.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from manifests.cache import TextLayout
from manifests.cache.records import TextRecord
from manifests.errors import UsageError
from pipeline.embed.encoders import encoder_specs
from pipeline.embed.families.tiny import UMT5_WIDTH, build_tiny
from pipeline.embed.loading import quiet_loading, to_storage

FAMILIES = ("wan2.2-a14b", "wan2.2-ti2v-5b")
# empty, long (truncated at 512 tokens), unicode and HTML entities (prompt_clean unescapes), a short one
CAPTIONS = ["a photo of the cat", "", "red dog " * 300, "  The RED Dog, naïve café &amp; 漢字 🙂  ", "thing 0"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    quiet_loading()
    base = tmp_path_factory.mktemp("tiny-wan22")
    return {f: str(build_tiny(f, base / f)) for f in FAMILIES}


def _specs(family: str, model: str):
    return encoder_specs(family=family, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                         text_subfolders=None)  # fmt: skip


def _records(encoded, dtype: str) -> list[TextRecord]:
    return [TextRecord(i, tuple(to_storage(t, dtype) for t in tokens), None if p is None else to_storage(p, dtype),
                       dtype) for i, (tokens, p) in enumerate(encoded)]  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_text_equals_the_pipelines_encode_prompt(tiny, family):
    from diffusers import WanPipeline

    encoders = _specs(family, tiny[family])[1].load()
    info = encoders.describe()
    layout = TextLayout.from_json(info["layout"])
    encoded = encoders.encode(CAPTIONS)
    pipe = WanPipeline.from_pretrained(tiny[family])
    with torch.no_grad():
        want, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, device="cpu",
                                       max_sequence_length=512)  # __call__'s length (its own default: 226)
    for dtype, cast in (("F32", lambda t: t), ("BF16", lambda t: t.to(torch.bfloat16).float())):
        joined, mask, pooled = layout.prompt_embeds(_records(encoded, dtype), pad_to=layout.length)
        assert np.array_equal(joined, cast(want).numpy()), dtype  # the real rows, then zeros: bit for bit
        assert pooled is None and mask.sum(1).tolist()[1] == 1  # "": </s> alone
    assert [t[0].shape[0] for t, _ in encoded][2] == 512  # truncated at 512, real tokens only stored
    assert (layout.family, layout.lengths, layout.widths, layout.masked) == (family, (512,), (UMT5_WIDTH,), True)
    assert info["family"] == family and info["pipeline"] == "WanPipeline"


def _clip(frames: int, h: int, w: int, seed: int) -> np.ndarray:
    """A smooth random clip ``(F, H, W, 3)`` uint8."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (frames, 4, 4, 3)).astype(np.float32)
    up = torch.nn.functional.interpolate(torch.from_numpy(base).permute(0, 3, 1, 2), size=(h, w), mode="bilinear")
    return up.permute(0, 2, 3, 1).round().clamp(0, 255).to(torch.uint8).numpy()


def _pipeline_latents(model: str, clips: np.ndarray, dtype=torch.float32, normalise: bool = True) -> torch.Tensor:
    """The pipelines' VAE path: pixels by its ``VideoProcessor``, the posterior's mode, normalised per channel
    (``normalise``); the VAE loaded and run in ``dtype`` as ``from_pretrained(torch_dtype=)`` loads it."""
    from diffusers import AutoencoderKLWan
    from diffusers.pipelines.wan.pipeline_wan_video2video import retrieve_latents
    from diffusers.video_processor import VideoProcessor
    from PIL import Image

    vae = AutoencoderKLWan.from_pretrained(model, subfolder="vae", torch_dtype=dtype).eval()
    processor = VideoProcessor(vae_scale_factor=vae.config.scale_factor_spatial)
    _, _, h, w, _ = clips.shape
    video = torch.cat([processor.preprocess_video([Image.fromarray(f) for f in c], height=h, width=w) for c in clips])
    c = vae.config.z_dim
    with torch.no_grad():
        z = retrieve_latents(vae.encode(video.to(dtype)), sample_mode="argmax")
    if not normalise:
        return z
    mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1)
    return (z - mean) * inv_std


@pytest.mark.parametrize("family", ["wan2.2-a14b", "wan2.2-ti2v-5b"])
def test_bf16_clip_latents_are_the_pipelines_bf16_vae_path(tiny, family):
    """The GPU's path (VAE and pixels in bf16; ``compute="BF16"`` on this CPU): the stored posterior mode equals the
    pipeline's with the VAE loaded in bf16, bit for bit (the trainer normalises per channel, in fp32)."""
    encoder = _specs(family, tiny[family])[0].load(dtype="BF16", compute="BF16")
    clips = np.stack([_clip(9, 32, 48, seed) for seed in (1, 2)])  # (B, F, H, W, 3)
    got = encoder.encode(clips)["latent"]
    want = _pipeline_latents(tiny[family], clips, torch.bfloat16, normalise=False)
    assert got.shape == want.shape and torch.equal(got.float(), want.float())


@pytest.mark.parametrize("family, shape", [("wan2.2-a14b", (16, 3, 4, 6)), ("wan2.2-ti2v-5b", (48, 3, 2, 3))])
def test_clip_latents_are_the_pipelines_vae_path_and_normalisation(tiny, family, shape):
    from train.data.batch import _per_channel, latent_normaliser

    encoder = _specs(family, tiny[family])[0].load(dtype="F32")
    clips = np.stack([_clip(9, 32, 48, seed) for seed in (1, 2)])  # (B, F, H, W, 3)
    stored = encoder.encode(clips)["latent"]  # the posterior mean, as cached (B, C, F', h, w)
    described = encoder.describe()
    info = SimpleNamespace(**{k: described.get(k) for k in ("latents_mean", "latents_std", "channels",
                                                             "shift_factor", "scaling_factor")})  # fmt: skip
    shift, scale = latent_normaliser(info)  # what the trainer's loader applies, (z - shift) * scale
    got = (stored - _per_channel(torch.from_numpy(shift), stored)) * _per_channel(torch.from_numpy(scale), stored)
    want = _pipeline_latents(tiny[family], clips)
    assert got.shape == want.shape == (2, *shape)
    assert torch.equal(got, want)  # bit for bit in fp32
    vae = json.loads((Path(tiny[family]) / "vae" / "config.json").read_text())
    factor = 16 if family == "wan2.2-ti2v-5b" else 8
    assert (described["class"], described["channels"], described["factor"], described["temporal_factor"]) == (
        "AutoencoderKLWan", shape[0], factor, 4)
    assert described["latents_std"] == vae["latents_std"] and len(described["latents_mean"]) == shape[0]


def test_a_folder_of_another_wan_kind_is_refused_at_embed_in_one_line(tiny, tmp_path):
    """One class, three families: the folder's model_index.json says which, before a weight is read."""
    wan21 = str(build_tiny("wan", tmp_path / "wan"))
    for family, model, kind in (("wan", tiny["wan2.2-a14b"], "wan2.2-a14b"), ("wan2.2-a14b", wan21, "wan"),
                                ("wan", tiny["wan2.2-ti2v-5b"], "wan2.2-ti2v-5b")):  # fmt: skip
        with pytest.raises(UsageError, match=rf"its model_index.json is a {kind} WanPipeline, not a {family} one; "
                                             rf"pass --family {kind}"):  # fmt: skip
            _specs(family, model)[1].load()
