"""Kandinsky 5 (``kandinsky-5``, ``kandinsky-5-video``): the cached text equals the pipelines' ``encode_prompt``, the
latents their VAE paths, and ``--reuse`` tells Kandinsky's unshifted latents from Flux's.

Tiny random-weight pipelines of the real classes (:mod:`pipeline.embed.families.tiny_kandinsky`, saved and loaded
with ``from_pretrained``), encoded in process: every caption's stored rows equal ``encode_prompt([caption])``'s
Qwen2.5-VL rows bit for bit in fp32 (prefix dropped, ``prompt_clean``, the decode-based cut of a long caption), the
pooled vector its CLIP-L ``pooler_output``, bf16 records one rounding of them; a caption's real rows in a padded
pipeline batch are its rows alone (right padding, causal). With Qwen2.5-VL's real tokenizer (the ``qwen-image``
fixture) the templates' prefixes are exactly the tokens the pipelines drop, and the token ids fed to the model
(long captions cut by text) are the pipeline's. The image latents are FLUX.1's VAE posterior, which the loader
scales without shift as the pipeline does; ``_cache.json`` records ``shift_factor`` null, so ``embed --reuse``
does not take a Flux cache's latents of the same VAE (it takes a Kandinsky cache's).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.embed.families.base import missing_classes
from manifests.cache import TextLayout, read_cache_meta, settings_diff
from manifests.errors import UsageError
from pipeline.embed.encoders import encoder_specs
from pipeline.embed.families import kandinsky5
from pipeline.embed.families.tiny import CLIP_L, build_tiny
from pipeline.embed.families.tiny_qwen import QWEN_WIDTH
from pipeline.embed.latents import LatentSpec
from pipeline.embed.loading import EncoderSource, quiet_loading, to_storage
from pipeline.embed.reuse import latent_identity
from tests.embed_data import embed_cache, make_dataset, records_by_id

MISSING = missing_classes("kandinsky-5")  # why this diffusers cannot run the families (None: it can)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

FAMILIES = ("kandinsky-5", "kandinsky-5-video")
TEMPLATES = {"kandinsky-5": kandinsky5.T2I, "kandinsky-5-video": kandinsky5.T2V}
# empty, long (past 40 + 512 tokens: cut by text, then truncated), unicode, spaces and HTML entities (prompt_clean),
# short ones of equal token counts (encoded in one group) and of other counts
CAPTIONS = ["a photo of the cat", "", "red dog " * 400, "  The RED Dog,\n naïve café 漢字 🙂  ", "thing 0",
            "a photo of the dog", "fish &amp; chips &lt;b&gt;", "a blue picture"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    quiet_loading()
    base = tmp_path_factory.mktemp("tiny-kandinsky")
    return {f: str(build_tiny(f, base / f)) for f in FAMILIES}


def _text(family: str, model: str, **options):
    _, spec = encoder_specs(family=family, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None, **options)  # fmt: skip
    return spec.load()


def _reference(pipe, captions: list[str], **length):
    """The pipeline's ``encode_prompt(captions)``: Qwen rows ``(B, L, D)``, CLIP pooled ``(B, P)``, row counts."""
    with torch.no_grad():
        embeds, pooled, cu = pipe.encode_prompt(captions, device="cpu", **length)
    return embeds, pooled, cu.diff()


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_text_equals_the_pipelines_encode_prompt(tiny, family):
    from diffusers import DiffusionPipeline

    encoders = _text(family, tiny[family])
    layout = TextLayout.from_json(encoders.describe()["layout"])
    assert (layout.masked, layout.lengths, layout.widths, layout.pooled_dim) == (True, (512,), (QWEN_WIDTH,), CLIP_L)
    pipe = DiffusionPipeline.from_pretrained(tiny[family])
    template = TEMPLATES[family]
    assert (pipe.prompt_template, pipe.prompt_template_encode_start_idx) == (template.text, template.drop)
    encoded = encoders.encode(list(CAPTIONS))
    for caption, (tokens, pooled) in zip(CAPTIONS, encoded):
        embeds, clip, (rows,) = _reference(pipe, [caption])
        assert len(tokens) == 1 and tokens[0].shape == (rows, QWEN_WIDTH) == embeds[0].shape, caption[:30]
        assert torch.equal(tokens[0], embeds[0]) and torch.equal(pooled, clip[0]), caption[:30]  # fp32: bit for bit
        assert np.array_equal(to_storage(tokens[0], "BF16"), to_storage(embeds[0], "BF16"))  # bf16: one rounding
    rows = [t[0].shape[0] for t, _ in encoded]
    # the caption's tokens and <|im_end|>: an empty caption keeps 1 row, a long one is cut to the pipeline's 512
    assert rows[1] == 1 and rows[2] == 512
    alone = encoders.encode([CAPTIONS[3]])[0]  # a caption's record does not depend on the captions beside it
    assert torch.equal(alone[0][0], encoded[3][0][0]) and torch.equal(alone[1], encoded[3][1])
    # in a pipeline batch padded to its longest caption (no long one: its text cut is batch-dependent), each
    # caption's real rows are its rows alone up to float rounding: right padding, causal attention
    short = [c for c in CAPTIONS if c is not CAPTIONS[2]]
    embeds, clip, counts = _reference(pipe, short)
    assert len(set(counts.tolist())) > 1
    for i, caption in enumerate(short):
        (tokens,), pooled = encoded[CAPTIONS.index(caption)]
        torch.testing.assert_close(embeds[i, : counts[i]], tokens, rtol=1e-5, atol=1e-6)
        assert torch.equal(clip[i], pooled)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tokens", [1024, 100])
def test_max_text_tokens_is_the_pipelines_max_sequence_length(tiny, family, tokens):
    from diffusers import DiffusionPipeline

    encoders = _text(family, tiny[family], max_tokens=tokens)
    assert TextLayout.from_json(encoders.describe()["layout"]).lengths == (tokens,)
    pipe = DiffusionPipeline.from_pretrained(tiny[family])
    for caption, ((part,), _) in zip(CAPTIONS, encoders.encode(list(CAPTIONS))):
        embeds, _, _ = _reference(pipe, [caption], max_sequence_length=tokens)
        assert torch.equal(part, embeds[0]), caption[:30]
    with pytest.raises(UsageError, match=f"--max-text-tokens 2048 is above {family}'s 1024"):
        _text(family, tiny[family], max_tokens=2048)


class _Ids(torch.nn.Module):
    """A stand-in text encoder whose "hidden states" are the token ids it is given: what the pipeline feeds it."""

    dtype = torch.float64

    def forward(self, input_ids, **kwargs):
        return {"hidden_states": [input_ids.double().unsqueeze(-1)]}


@pytest.mark.parametrize("family", ["kandinsky-5", "kandinsky-5-video"])
def test_with_the_real_tokenizer_the_ids_are_the_pipelines(tmp_path, family):
    """Qwen2.5-VL's tokenizer (the qwen-image fixture: Kandinsky 5 ships Qwen2.5-VL-7B's): the system prefix is
    exactly the ``drop`` tokens ``_encode_prompt_qwen`` drops, and the ids it feeds the model (a long caption cut by
    its decoded text, then truncated) are ours, for the default and a lowered ``max_sequence_length``."""
    import diffusers
    from transformers import Qwen2Tokenizer

    from pipeline.embed.families.base import TextModel
    from tests.checkpoints import materialize

    tokenizer = Qwen2Tokenizer.from_pretrained(materialize("qwen-image", tmp_path) / "tokenizer")
    template = TEMPLATES[family]
    prefix = tokenizer(template.text.format("")).input_ids
    assert len(prefix) == template.drop + 1 and tokenizer.convert_ids_to_tokens(prefix[-3:]) == [
        "user", "Ċ", "<|im_end|>"]  # fmt: skip
    cls = getattr(diffusers, "Kandinsky5T2VPipeline" if family.endswith("video") else "Kandinsky5T2IPipeline")
    fake = SimpleNamespace(tokenizer=tokenizer, text_encoder=_Ids(), prompt_template=template.text,
                           prompt_template_encode_start_idx=template.drop)  # fmt: skip
    ours = TextModel(tokenizer, _Ids(), torch.device("cpu"), {})
    long = ["word " * 600, "zebra " * 300 + "naïve café", "a red cat"]
    for limit in (512, 100):
        for caption in long:
            want, _ = cls._encode_prompt_qwen(fake, [caption], device="cpu", max_sequence_length=limit,
                                              dtype=torch.float64)  # fmt: skip
            (got,) = kandinsky5.qwen_rows(ours, [caption], template, limit)
            assert torch.equal(got, want[0]) and got.shape[0] <= limit, (limit, caption[:20])


def _crops(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (2, 32, 48, 3), dtype=np.uint8)  # (B, H, W, 3)


def _latent_encoder(model: str, family: str, latents: str = "mean"):
    return LatentSpec(encoder_specs(family=family, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                                    text_subfolders=None)[0].source, latents).load()  # fmt: skip


def test_image_latents_are_the_posterior_scaled_without_shift_as_the_pipeline_scales(tiny):
    from diffusers import AutoencoderKL

    from manifests.cache.meta import LatentInfo
    from train.data.batch import latent_normaliser

    encoder = _latent_encoder(tiny["kandinsky-5"], "kandinsky-5", "posterior")
    pixels = _crops()
    out = encoder.encode(pixels)
    vae = AutoencoderKL.from_pretrained(tiny["kandinsky-5"], subfolder="vae")
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    with torch.no_grad():
        posterior = vae.encode(x).latent_dist
    assert torch.equal(out["latent"], posterior.mean) and torch.equal(out["latent_std"], posterior.std)
    info = encoder.describe()
    assert vae.config.shift_factor == 0.1159  # FLUX.1's VAE config has a shift, which the pipeline does not apply
    assert (info["scaling_factor"], info["shift_factor"]) == (vae.config.scaling_factor, None)
    assert "applies no shift_factor" in info["usage"]
    shift, scale = latent_normaliser(LatentInfo(scaling_factor=info["scaling_factor"],
                                                shift_factor=info["shift_factor"]))  # fmt: skip
    # Kandinsky5T2IPipeline decodes latents / scaling_factor (its i2i sibling encodes z * scaling_factor): the
    # denoiser's latents are the posterior times scaling_factor, no shift
    assert (shift, scale) == (0.0, vae.config.scaling_factor)
    # the same VAE folder read as flux's keeps its shift (the change is the family's, not the VAE class's)
    flux = LatentSpec(EncoderSource(tiny["kandinsky-5"], "vae", family="flux")).load().describe()
    assert (flux["scaling_factor"], flux["shift_factor"]) == (0.3611, 0.1159)


def test_clip_latents_are_hunyuan_videos_posterior_scaled_by_the_loader(tiny):
    """Kandinsky5T2VPipeline decodes latents / scaling_factor with HunyuanVideo 1.0's VAE (its i2v sibling encodes
    z * scaling_factor): the cache holds each clip's posterior mean, encoded alone, and the loader scales it."""
    from diffusers import AutoencoderKLHunyuanVideo

    from manifests.cache.meta import LatentInfo
    from train.data.batch import latent_normaliser

    encoder = _latent_encoder(tiny["kandinsky-5-video"], "kandinsky-5-video", "posterior")
    assert encoder.video
    clips = np.random.default_rng(2).integers(0, 255, (2, 9, 32, 48, 3), dtype=np.uint8)  # (B, F, H, W, 3)
    out = encoder.encode(clips)
    vae = AutoencoderKLHunyuanVideo.from_pretrained(tiny["kandinsky-5-video"], subfolder="vae")
    x = torch.from_numpy(clips).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0  # (B, 3, F, H, W)
    with torch.no_grad():
        alone = [vae.encode(x[i : i + 1]).latent_dist for i in range(2)]
    assert out["latent"].shape == (2, 16, 3, 4, 6)  # F' = (9 - 1) / 4 + 1, 8x spatial
    assert torch.equal(out["latent"], torch.cat([p.mean for p in alone]))
    assert torch.equal(out["latent_std"], torch.cat([p.std for p in alone]))
    info = encoder.describe()
    assert (info["class"], info["scaling_factor"], info["shift_factor"], info["temporal_factor"], info["factor"]) == (
        "AutoencoderKLHunyuanVideo", 0.476986, None, 4, 8)
    shift, scale = latent_normaliser(LatentInfo(scaling_factor=info["scaling_factor"], shift_factor=None))
    assert (shift, scale) == (0.0, vae.config.scaling_factor)


@pytest.mark.ray
@pytest.mark.slow
def test_embed_writes_the_cache_and_reuse_takes_no_flux_latents(tiny, tmp_path, ray_local):
    """The real embed job: the records are the encoders', ``_cache.json`` says how to read them. A Flux cache of
    the same images through the same VAE folder stores the same posterior but says ``shift_factor`` 0.1159: its
    latents are not taken (they would be shifted by the loader); a Kandinsky cache's are."""
    from manifests.manifest import read_manifest

    model = tiny["kandinsky-5"]
    manifest, out = str(tmp_path / "manifest"), str(tmp_path / "cache")
    make_dataset(str(tmp_path / "data"), manifest, 4)
    embed_cache(manifest, out, family="kandinsky-5", model=model, dtype="fp32")
    meta = read_cache_meta(out)
    assert meta.family == "kandinsky-5" and meta.text_layout.lengths == (512,) and meta.text_layout.pooled_dim == 32
    assert (meta.latent.scaling_factor, meta.latent.shift_factor) == (0.3611, None)
    assert "no shift_factor" in meta.latent.usage and meta.settings.hashed["vae"]["shift_factor"] is None
    captions = {r["sample_id"]: r["caption"] for r in read_manifest(manifest).samples.to_pylist()}
    encoders = _text("kandinsky-5", model)
    for sample_id, record in records_by_id(out).items():
        (want,), pooled = encoders.encode([captions[sample_id] or ""])[0]
        assert record.latent.shape == (16, *(n // 8 for n in record.target_size))
        assert np.array_equal(record.text.tokens[0], want.numpy()) and np.array_equal(record.text.pooled, pooled)
    # a Flux cache of the same images through this VAE folder: the same stored posterior, another normalisation
    flux = str(tmp_path / "flux")
    embed_cache(manifest, flux, family="flux", model=str(build_tiny("flux", tmp_path / "tiny-flux")), vae=model,
                vae_subfolder="vae", dtype="fp32", executor="local")  # fmt: skip
    flux_meta = read_cache_meta(flux)
    assert flux_meta.latent.shift_factor == 0.1159
    assert [r.latent.tobytes() for r in records_by_id(flux).values()] == [
        r.latent.tobytes() for r in records_by_id(out).values()]  # fmt: skip
    assert settings_diff(latent_identity(flux_meta.settings.hashed), latent_identity(meta.settings.hashed)) == [
        "vae.shift_factor: 0.1159 -> None"]  # fmt: skip
    refused = embed_cache(manifest, str(tmp_path / "from-flux"), family="kandinsky-5", model=model, dtype="fp32",
                          reuse=(flux,), executor="local")  # fmt: skip
    taken = embed_cache(manifest, str(tmp_path / "from-kandinsky"), family="kandinsky-5", model=model, dtype="fp32",
                        reuse=(out,), executor="local")  # fmt: skip
    assert (refused.reused_samples, taken.reused_samples) == (0, 4)


@pytest.mark.slow
def test_the_estimate_bills_what_embed_writes(tiny, tmp_path):
    """``bucketeer estimate`` counts each caption's real rows from the tokenizer and template alone (no weights)
    and the latents from the VAE's config: its bytes are what embed then writes (Qwen rows, pooled, latents)."""
    from pipeline import EmbedJob, run
    from pipeline.estimate import EstimateJob, estimate
    from tests.test_estimate import _written

    manifest = str(tmp_path / "manifest")
    make_dataset(str(tmp_path / "data"), manifest, 6)
    job = EmbedJob(manifest=manifest, out=str(tmp_path / "cache"), family="kandinsky-5", model=tiny["kandinsky-5"],
                   executor="local", batch_size=4, shard_records=4)  # fmt: skip
    bill = estimate(EstimateJob(embed=job, gpu="cpu"))
    run(job)
    assert (bill.latent_bytes, bill.text_bytes) == _written(str(tmp_path / "cache"))


def _real_files(tmp_path, family: str):
    """A folder of Kandinsky 5's real preprocessing files as far as they can be had (no weights): Qwen2.5-VL-7B's
    config and tokenizer (the qwen-image fixture), CLIP ViT-L/14's text config and tokenizer and FLUX.1's VAE config
    (the flux fixture); ``model_index.json`` names the family's pipeline (written here: no Kandinsky file is at
    hand). HunyuanVideo's VAE config for the video family: ``benchmarks.real_configs.HUNYUAN_VIDEO_VAE``."""
    import shutil

    from tests.checkpoints import materialize

    qwen, flux, out = materialize("qwen-image", tmp_path / "q"), materialize("flux", tmp_path / "f"), tmp_path / "k"
    for src, dst in ((qwen / "text_encoder", "text_encoder"), (qwen / "tokenizer", "tokenizer"),
                     (flux / "text_encoder", "text_encoder_2"), (flux / "tokenizer", "tokenizer_2"),
                     (flux / "vae", "vae")):  # fmt: skip
        shutil.copytree(src, out / dst)
    cls = "Kandinsky5T2VPipeline" if family.endswith("video") else "Kandinsky5T2IPipeline"
    (out / "model_index.json").write_text(json.dumps({"_class_name": cls}))
    if family.endswith("video"):
        from benchmarks.real_configs import HUNYUAN_VIDEO_VAE

        (out / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLHunyuanVideo",
                                                             **HUNYUAN_VIDEO_VAE}))  # fmt: skip
    return str(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_bytes_per_caption_and_per_sample_at_real_size(tmp_path, family):
    """From the real files (no weights): a caption's record is its real rows (its tokens + ``<|im_end|>``) x 3584
    in bf16 plus CLIP-L's 768-wide pooled vector; a 1024x1024 image's latent (posterior mean) 16 x 128 x 128 bf16."""
    from pipeline.embed.latents import latent_shape

    model = _real_files(tmp_path, family)
    _, spec = encoder_specs(family=family, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None)  # fmt: skip
    counted = spec.load(weights=False)
    layout = counted.layout
    assert (layout.lengths, layout.widths, layout.pooled_dim) == ((512,), (3584,), 768)
    captions = ["a photo of a cat", "", "word " * 2000]
    rows = [n for (n,) in counted.rows(captions)]
    assert rows == [6, 1, 512]  # "a photo of a cat" is 5 tokens, + <|im_end|>; a long caption is cut to 512
    per_caption = [2 * (3584 * n + 768) for n in rows]
    assert per_caption == [44_544, 8_704, 3_671_552]
    latent = latent_shape(LatentSpec(encoder_specs(family=family, model=model, vae=None, vae_subfolder=None,
                                                   text_encoders=None, text_subfolders=None)[0].source))  # fmt: skip
    assert (latent["factor"], latent["channels"], latent["shift_factor"]) == (8, 16, None)
    assert 2 * latent["channels"] * (1024 // latent["factor"]) ** 2 == 524_288  # bytes per 1024x1024 sample
