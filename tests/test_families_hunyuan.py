"""HunyuanVideo 1.5 (``hunyuanvideo-1.5``): the cache holds what ``HunyuanVideo15Pipeline`` gives its transformer.

A tiny random-weight pipeline of the real classes (:mod:`pipeline.embed.families.tiny_hunyuan`), saved and loaded
back with ``from_pretrained``: both cached text streams, split and zero-padded by the layout (join ``streams``),
equal ``encode_prompt``'s four outputs bit for bit in fp32 where its mask is 1 (and its masks exactly); the pad
rows the pipeline computes are not inputs of the transformer, which gives bit-identical outputs for them and for
zeros; a clip's latent, scaled as the trainer's loader scales it, equals the pipelines' VAE path bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from manifests.cache import TextLayout
from manifests.cache.records import TextRecord, decode_text, encode_text
from pipeline.embed.encoders import encoder_specs
from pipeline.embed.families.tiny import build_tiny
from pipeline.embed.families.tiny_hunyuan import BYT5_WIDTH, HUNYUAN_WIDTH, LATENT_CHANNELS
from pipeline.embed.loading import quiet_loading, to_storage

FAMILY = "hunyuanvideo-1.5"
# no quotes (ByT5 stream empty), empty, quoted glyph text (straight and curly), long (truncated), unicode
CAPTIONS = ["a photo of the cat", "", 'a sign that says "OPEN" and “café 漢字”', "red dog " * 700,
            "  The RED Dog, naïve 🙂  "]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    quiet_loading()
    return str(build_tiny(FAMILY, tmp_path_factory.mktemp("tiny-hunyuan") / FAMILY))


def _specs(model: str):
    return encoder_specs(family=FAMILY, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                         text_subfolders=None)  # fmt: skip


def _records(encoded, dtype: str) -> list[TextRecord]:
    return [decode_text(encode_text(TextRecord(i, tuple(to_storage(t, dtype) for t in tokens), None, dtype)))
            for i, (tokens, _) in enumerate(encoded)]  # through the record's bytes  # fmt: skip


def test_cached_streams_equal_the_pipelines_encode_prompt(tiny):
    from diffusers import HunyuanVideo15Pipeline

    encoders = _specs(tiny)[1].load(dtype="F32")
    info = encoders.describe()
    layout = TextLayout.from_json(info["layout"])
    assert (layout.join, layout.lengths, layout.widths, layout.masked) == ("streams", (1000, 256),
                                                                           (HUNYUAN_WIDTH, BYT5_WIDTH), True)
    encoded = encoders.encode(CAPTIONS)
    pipe = HunyuanVideo15Pipeline.from_pretrained(tiny)
    with torch.no_grad():
        want = pipe.encode_prompt(CAPTIONS, device="cpu", batch_size=len(CAPTIONS))
        alone = [pipe.encode_prompt([c], device="cpu") for c in CAPTIONS[:3]]
    for dtype, cast in (("F32", lambda t: t), ("BF16", lambda t: t.to(torch.bfloat16).float())):
        joined, mask, pooled = layout.prompt_embeds(_records(encoded, dtype))
        assert pooled is None and mask.shape[-1] == 2
        for i, (embeds, keep) in enumerate(layout.streams(torch.from_numpy(joined), torch.from_numpy(mask))):
            ref, ref_mask = want[2 * i], want[2 * i + 1]
            assert torch.equal(keep, ref_mask), (dtype, i)  # the pipeline's mask exactly
            assert torch.equal(embeds, cast(ref) * ref_mask[..., None]), (dtype, i)  # its real rows, zeros after
    rows = [[t.shape[0] for t in tokens] for tokens, _ in encoded]
    assert [r[1] for r in rows] == [0, 0, rows[2][1], 0, 0] and rows[2][1] > 0  # glyph text only where quoted
    assert rows[3][0] == 1000  # truncated at tokenizer_max_length
    for j, (e, m, e2, m2) in enumerate(alone):  # a caption's rows do not depend on its batch
        n, n2 = int(m.sum()), int(m2.sum())
        assert torch.equal(encoded[j][0][0], e[0, :n]) and torch.equal(encoded[j][0][1], e2[0, :n2])


def test_the_transformer_gives_the_same_output_for_zeroed_pad_rows(tiny):
    """What the cache drops (the pad rows ``encode_prompt`` computes) is not an input: bit-identical outputs."""
    from diffusers import HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(tiny)
    with torch.no_grad():
        e, m, e2, m2 = pipe.encode_prompt(CAPTIONS[:3], device="cpu", batch_size=3)
        latents = torch.randn(3, 2 * LATENT_CHANNELS + 1, 2, 2, 2, generator=torch.Generator().manual_seed(0))
        image = torch.zeros(3, 729, pipe.transformer.config.image_embed_dim)
        t = torch.full((3,), 700.0)

        def run(a, b):
            return pipe.transformer(hidden_states=latents, timestep=t, encoder_hidden_states=a,
                                    encoder_attention_mask=m, encoder_hidden_states_2=b, encoder_attention_mask_2=m2,
                                    image_embeds=image, return_dict=False)[0]  # fmt: skip

        assert torch.equal(run(e, e2), run(e * m[..., None], e2 * m2[..., None]))
        assert not torch.equal(e, e * m[..., None])  # the pipeline's pad rows are not zeros


def _clip(frames: int, h: int, w: int, seed: int) -> np.ndarray:
    """A smooth random clip ``(F, H, W, 3)`` uint8."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (frames, 4, 4, 3)).astype(np.float32)
    up = torch.nn.functional.interpolate(torch.from_numpy(base).permute(0, 3, 1, 2), size=(h, w), mode="bilinear")
    return up.permute(0, 2, 3, 1).round().clamp(0, 255).to(torch.uint8).numpy()


def test_bf16_clip_latents_are_the_pipelines_bf16_vae_path(tiny):
    """The GPU's path (``compute="BF16"`` on this CPU): the stored posterior mode equals the one of the VAE loaded in
    bf16 (``torch_dtype``), clip by clip as the pipeline encodes, bit for bit (the trainer scales, in fp32)."""
    from diffusers import AutoencoderKLHunyuanVideo15
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5_image2video import retrieve_latents
    from diffusers.video_processor import VideoProcessor
    from PIL import Image

    encoder = _specs(tiny)[0].load(dtype="BF16", compute="BF16")
    clips = np.stack([_clip(5, 32, 48, seed) for seed in (1, 2)])  # (B, F, H, W, 3)
    got = encoder.encode(clips)["latent"]
    vae = AutoencoderKLHunyuanVideo15.from_pretrained(tiny, subfolder="vae", torch_dtype=torch.bfloat16).eval()
    processor = VideoProcessor(vae_scale_factor=vae.config.spatial_compression_ratio)
    video = torch.cat([processor.preprocess_video([Image.fromarray(f) for f in c], height=32, width=48)
                       for c in clips]).to(torch.bfloat16)  # fmt: skip
    with torch.no_grad():
        want = torch.cat([retrieve_latents(vae.encode(v[None]), sample_mode="argmax") for v in video])
    assert got.shape == want.shape and torch.equal(got.float(), want.float())


def test_clip_latents_are_the_pipelines_vae_path_and_scaling(tiny):
    from diffusers import AutoencoderKLHunyuanVideo15
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5_image2video import retrieve_latents
    from diffusers.video_processor import VideoProcessor
    from PIL import Image

    from train.data.batch import latent_normaliser

    encoder = _specs(tiny)[0].load(dtype="F32")
    clips = np.stack([_clip(5, 32, 48, seed) for seed in (1, 2)])  # (B, F, H, W, 3)
    stored = encoder.encode(clips)["latent"]  # the posterior mean, as cached (B, C, F', h, w)
    described = encoder.describe()
    shift, scale = latent_normaliser(SimpleNamespace(**{k: described.get(k) for k in (
        "latents_mean", "latents_std", "channels", "shift_factor", "scaling_factor")}))  # fmt: skip
    got = (stored - shift) * scale  # what the trainer's loader applies
    vae = AutoencoderKLHunyuanVideo15.from_pretrained(tiny, subfolder="vae").eval()
    processor = VideoProcessor(vae_scale_factor=vae.config.spatial_compression_ratio)
    video = torch.cat([processor.preprocess_video([Image.fromarray(f) for f in c], height=32, width=48)
                       for c in clips])  # fmt: skip
    with torch.no_grad():  # HunyuanVideo15ImageToVideoPipeline._get_image_latents' ops, on a clip (one: its VAE's
        # attention mask does not broadcast over a batch in diffusers 0.42.1)
        want = torch.cat([retrieve_latents(vae.encode(v[None]), sample_mode="argmax") for v in video])
        want = want * vae.config.scaling_factor
    assert got.shape == want.shape == (2, LATENT_CHANNELS, 2, 2, 3)
    assert torch.equal(got, want)  # bit for bit in fp32
    assert (described["class"], described["factor"], described["temporal_factor"], described["scaling_factor"]) == (
        "AutoencoderKLHunyuanVideo15", 16, 4, vae.config.scaling_factor)


def test_a_streams_layout_keeps_each_part_and_its_mask_apart():
    """``join: streams``: parts side by side with one mask column each; :meth:`streams` gives each part back at
    its own length (padded with zero rows and mask 0, or cut); the JSON round trip and the row check hold."""
    layout = TextLayout(family=FAMILY, join="streams", masked=True, lengths=(6, 3), widths=(2, 1))
    assert TextLayout.from_json(layout.to_json()) == layout and (layout.width, layout.length) == (3, 6)
    a = TextRecord(1, (np.full((4, 2), 1.0, np.float32), np.zeros((0, 1), np.float32)), None, "F32")
    b = TextRecord(2, (np.full((2, 2), 2.0, np.float32), np.full((3, 1), 3.0, np.float32)), None, "F32")
    embeds, mask, pooled = layout.prompt_embeds([a, b])
    assert embeds.shape == (2, 4, 3) and mask.shape == (2, 4, 2) and pooled is None
    assert mask[:, :, 0].sum(1).tolist() == [4, 2] and mask[:, :, 1].sum(1).tolist() == [0, 3]
    (e0, m0), (e1, m1) = layout.streams(torch.from_numpy(embeds), torch.from_numpy(mask))
    assert e0.shape == (2, 6, 2) and e1.shape == (2, 3, 1) and m0.shape == (2, 6) and m1.shape == (2, 3)
    assert e0[0, :4].eq(1).all() and e0[0, 4:].eq(0).all() and m0[1].tolist() == [1, 1, 0, 0, 0, 0]
    assert e1[0].eq(0).all() and e1[1].eq(3).all() and m1.sum(1).tolist() == [0, 3]
    too_long = TextRecord(3, (np.zeros((7, 2), np.float32), np.zeros((0, 1), np.float32)), None, "F32")
    assert layout.check(too_long) == "text part 0 has 7 rows, the layout says at most 6"
    with pytest.raises(AssertionError):
        TextLayout(family=FAMILY, join="streams", masked=False, lengths=(6, 3), widths=(2, 1))
