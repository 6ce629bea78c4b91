"""ERNIE-Image: the cache holds what ``ErnieImagePipeline`` gives its transformer.

A tiny random-weight pipeline of the real classes (:mod:`pipeline.embed.families.tiny_ernie`), saved and loaded back
with ``from_pretrained``. Text: each record equals the pipeline's own ``encode_prompt`` bit for bit in fp32 (the empty
caption's ``[bos]`` included, with a tokenizer that adds ``<s>`` and one that does not), bf16 is that rounded once; the
one deviation, the length cap, is the pipeline run with its tokenizer cut there; the LLM runs only up to the layer
read. Which rows are needed is measured on the transformer: pad rows past ``text_lens`` change nothing, the count
itself moves every image token (RoPE). Latents: the inverse of the pipeline's own decoding (eps 1e-5, not the config's
1e-4), checked through ``__call__`` itself; ``_cache.json`` says so, and ``embed --reuse`` never takes a Flux 2
cache's latents of the same VAE weights for ERNIE, nor ERNIE's for Flux 2, while it takes ERNIE's for ERNIE.
``bucketeer estimate`` bills what embed then writes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.embed.families.base import missing_classes
from manifests.cache import TextLayout, read_cache_meta
from manifests.cache.records import TextRecord
from manifests.errors import UsageError
from pipeline.embed.encoders import encoder_specs
from pipeline.embed.families import ernie_image
from pipeline.embed.families.tiny import build_tiny
from pipeline.embed.families.tiny_ernie import TEXT_LAYERS, TEXT_WIDTH
from pipeline.embed.loading import EncoderSource, quiet_loading, to_storage
from tests.embed_data import embed_cache, make_dataset

MISSING = missing_classes("ernie-image")  # why this diffusers cannot run the family (None: it can)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

# empty, long (past the 1024 cap), unicode with Pixtral's image token (kept: the caption is raw), short ones
CAPTIONS = ["a photo of the cat", "", "red dog " * 300, "  The RED Dog, naïve café 漢字 🙂 [IMG] ", "thing 0",
            "thing 1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    quiet_loading()
    return str(build_tiny("ernie-image", tmp_path_factory.mktemp("tiny-ernie") / "ernie-image"))


def _text(model: str, **options):
    _, spec = encoder_specs(family="ernie-image", model=model, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None, **options)  # fmt: skip
    return spec


def _pipeline(model: str):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(model)


def _records(encoded, dtype: str) -> list[TextRecord]:
    return [TextRecord(i, tuple(to_storage(t, dtype) for t in tokens), None, dtype)
            for i, (tokens, _) in enumerate(encoded)]  # fmt: skip


def _bos_tokenizer(tokenizer) -> None:
    """``tokenizer`` (in place) adding ``<s>`` before every text, as a Mistral tokenizer with a template does."""
    from tokenizers import processors

    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_token_id)])  # fmt: skip


@pytest.mark.parametrize("bos", [False, True])
def test_cached_text_equals_the_pipelines_encode_prompt(tiny, bos):
    encoders = _text(tiny).load()
    pipe = _pipeline(tiny)
    if bos:  # the same tokenizer change on both sides: the empty caption then tokenizes to [<s>] by itself
        _bos_tokenizer(encoders.models[0].tokenizer)
        _bos_tokenizer(pipe.tokenizer)
    (m,) = encoders.models
    assert ernie_image.token_ids(m.tokenizer, [""], 1024) == [[m.tokenizer.bos_token_id]]
    info = encoders.describe()
    layout = TextLayout.from_json(info["layout"])
    assert (layout.lengths, layout.widths, layout.masked, layout.pooled_dim) == ((1024,), (TEXT_WIDTH,), True, None)
    assert (info["pipeline"], info["encoders"][0]["class"]) == ("ErnieImagePipeline", "Mistral3Model")
    encoded = encoders.encode(CAPTIONS)
    pipe.tokenizer.model_max_length = 1024  # the pipeline cuts at model_max_length: the cap, as a user would set it
    want = pipe.encode_prompt(CAPTIONS, device="cpu")  # one (n_i, D) per caption
    for dtype, cast in (("F32", lambda t: t), ("BF16", lambda t: t.to(torch.bfloat16).float())):
        joined, mask, _ = layout.prompt_embeds(_records(encoded, dtype))
        assert mask.sum(1).tolist() == [w.shape[0] for w in want]  # the real rows, nothing else
        for row, (embeds, keep, w) in enumerate(zip(joined, mask, want)):
            assert np.array_equal(embeds[keep == 1], cast(w).numpy()), (dtype, row)  # bit for bit
            assert not embeds[keep == 0].any()  # zero past them, as _pad_text pads
    assert [w.shape[0] for w in want][1:3] == [1, 1024]  # [bos] for ""; "red dog " * 300 cut at the cap
    pipe.tokenizer.model_max_length = 131072  # uncut, the pipeline's rows start with the cut caption's (causal LM)
    whole = pipe.encode_prompt([CAPTIONS[2]], device="cpu")[0]
    assert whole.shape[0] > 2000
    torch.testing.assert_close(whole[:1024], encoded[2][0][0], rtol=1e-5, atol=1e-6)


def test_max_text_tokens_cuts_where_the_pipelines_tokenizer_would(tiny):
    encoders = _text(tiny, max_tokens=24).load()
    assert TextLayout.from_json(encoders.describe()["layout"]).lengths == (24,)
    pipe = _pipeline(tiny)
    pipe.tokenizer.model_max_length = 24
    for (tokens, _), want in zip(encoders.encode(CAPTIONS), pipe.encode_prompt(CAPTIONS, device="cpu")):
        assert torch.equal(tokens[0], want)
    assert encoders.rows(CAPTIONS) == [(len(w),) for w in ernie_image.token_ids(pipe.tokenizer, CAPTIONS, 24)]
    assert _text(tiny, max_tokens=ernie_image.TOKENS_LIMIT).load().options.max_tokens == 16384
    with pytest.raises(UsageError, match="--max-text-tokens 16385 is above ernie-image's 16384"):
        _text(tiny, max_tokens=16385).load()


def test_rows_do_not_depend_on_the_captions_beside_them_and_are_counted_without_the_model(tiny):
    encoders = _text(tiny).load()
    together = encoders.encode(CAPTIONS)
    for caption, (tokens, _) in zip(CAPTIONS, together):
        assert torch.equal(encoders.encode([caption])[0][0][0], tokens[0])
    counted = _text(tiny).load(weights=False).rows(CAPTIONS)  # tokenizer only (bucketeer estimate)
    assert counted == [(t[0].shape[0],) for t, _ in together]


def test_the_llm_runs_only_up_to_the_layer_read(tiny):
    from transformers import Mistral3Model

    encoders = _text(tiny).load()
    (m,) = encoders.models
    full = Mistral3Model.from_pretrained(tiny, subfolder="text_encoder")
    assert len(full.language_model.layers) == TEXT_LAYERS and len(m.model.layers) == TEXT_LAYERS - 1
    assert type(m.model).__name__ == "Ministral3Model"  # the language model: no Pixtral tower, no projector
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    assert count(m.model) == count(full.language_model) - count(full.language_model.layers[-1])


def test_the_real_text_encoder_is_sized_from_its_config_before_any_weight_loads():
    """Ministral 3 3B (benchmarks/real_configs.py) as the family runs it: its language model up to the layer read,
    6.63e9 bytes in bf16 (not the tower, not the last layer): refused in one line where less is free."""
    from transformers import Ministral3Config, Mistral3Config

    from benchmarks.real_configs import MINISTRAL3_3B_TEXT
    from pipeline.embed.memory import check_text_encoders, text_encoder_bytes

    text = Ministral3Config(**{k: v for k, v in MINISTRAL3_3B_TEXT.items() if k != "model_type"})
    config = Mistral3Config(text_config=text)
    need = text_encoder_bytes("Mistral3Model", config, ernie_image.prune, torch.bfloat16)
    assert need == pytest.approx(6.625e9, rel=1e-3)
    family = ernie_image.FAMILY
    check_text_encoders(family, [("baidu/ERNIE-Image", "Mistral3Model", config)], torch.bfloat16, 7 * 10**9)
    with pytest.raises(UsageError, match="ernie-image: the text encoder Mistral3Model .* needs 6.2 GB"):
        check_text_encoders(family, [("baidu/ERNIE-Image", "Mistral3Model", config)], torch.bfloat16, 6 * 10**9)


def test_pad_rows_past_text_lens_change_nothing_and_text_lens_moves_every_image_token(tiny):
    """So the real rows are all a caption needs: the transformer masks what lies past ``text_lens``; and the count
    is part of the input (the image tokens' first RoPE axis), which the trainer takes from the mask."""
    transformer = _pipeline(tiny).transformer
    text = torch.randn(1, 5, TEXT_WIDTH)
    latents = torch.randn(1, 128, 2, 3)

    def predict(text_bth, lens):
        with torch.no_grad():
            return transformer(hidden_states=latents, timestep=torch.tensor([500.0]), text_bth=text_bth,
                               text_lens=torch.tensor([lens]), return_dict=False)[0]  # fmt: skip

    alone = predict(text, 5)
    padded = torch.cat([text, torch.randn(1, 3, TEXT_WIDTH)], dim=1)  # even non-zero pad rows
    torch.testing.assert_close(predict(padded, 5), alone, rtol=1e-5, atol=1e-6)
    assert (predict(padded, 6) - alone).abs().max() > 1e-4  # one more row read
    shifted = torch.cat([text, torch.zeros(1, 1, TEXT_WIDTH)], dim=1)
    assert (predict(shifted, 6) - alone).abs().max() > 1e-4  # a zero row counted: positions move


def _latents(tiny: str, latents: str = "mean"):
    spec, _ = encoder_specs(family="ernie-image", model=tiny, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None, latents=latents)  # fmt: skip
    return spec.load(dtype="F32")


def test_latents_are_the_inverse_of_the_pipelines_decoding(tiny):
    """``__call__`` decodes ``latents * sqrt(running_var + 1e-5) + running_mean``, unpatchified (``:377-388``): a
    transformer that predicts zero leaves the cached latents as they are, and the pipeline's image is then the VAE's
    decoding of the posterior mean. With Flux 2's normalisation (the config's eps, 1e-4) it is not."""
    from diffusers import ErnieImagePipeline

    from pipeline.embed.families.flux2 import denoiser_latents

    encoder = _latents(tiny, "posterior")
    pixels = np.random.default_rng(0).integers(0, 255, (2, 32, 48, 3), dtype=np.uint8)
    out = encoder.encode(pixels)
    vae = encoder.vae
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    with torch.no_grad():
        posterior = vae.encode(x).latent_dist
    bn_mean = vae.bn.running_mean.view(1, -1, 1, 1)
    bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + 1e-5)  # the pipeline's constant
    assert vae.config.batch_norm_eps == 1e-4 and out["latent"].shape == (2, 128, 2, 3)
    torch.testing.assert_close(ErnieImagePipeline._unpatchify_latents(out["latent"] * bn_std + bn_mean),
                               posterior.mean, rtol=1e-5, atol=1e-6)  # fmt: skip
    torch.testing.assert_close(out["latent_std"], ErnieImagePipeline._patchify_latents(posterior.std) / bn_std)

    pipe = ErnieImagePipeline.from_pretrained(tiny)
    with torch.no_grad():
        pipe.transformer.final_linear.weight.zero_(), pipe.transformer.final_linear.bias.zero_()
        want = pipe.image_processor.postprocess(vae.decode(posterior.mean).sample, output_type="pt")

    def generated(latents):
        return pipe(prompt_embeds=[torch.zeros(1, TEXT_WIDTH)] * 2, latents=latents, height=32, width=48,
                    num_inference_steps=1, guidance_scale=1.0, output_type="pt").images  # fmt: skip

    ours = (generated(out["latent"]) - want).abs().max()
    flux2 = (generated(denoiser_latents(vae, posterior.mean)[0]) - want).abs().max()
    assert ours < 1e-5 and flux2 > 10 * ours, (ours, flux2)
    described = encoder.describe()
    assert (described["factor"], described["channels"], described["scaling_factor"], described["shift_factor"]) == \
        (16, 128, 1.0, None)  # fmt: skip
    assert described["normalised"]["batch_norm_eps"] == 1e-5 and "eps is 1e-05" in described["usage"]
    with pytest.raises(UsageError, match="multiples of 16 pixels"):
        encoder.encode(pixels[:, :24])
    flux2_kind = encoder_specs(family="flux2", model=None, vae=tiny, vae_subfolder="vae", text_encoders=["x"],
                               text_subfolders=None)[0].load(dtype="F32")  # fmt: skip
    assert "normalised" not in flux2_kind.describe()  # the same VAE for Flux 2: its own path, as before


@pytest.fixture(scope="module")
def caches(tiny, tmp_path_factory) -> dict[str, str]:
    """The same 6 images embedded (in this process) as ERNIE-Image and as Flux 2 with ERNIE's VAE weights."""
    base = tmp_path_factory.mktemp("ernie-embed")
    manifest = str(base / "manifest")
    make_dataset(str(base / "data"), manifest, 6)
    ernie, flux2, flux2_model = str(base / "ernie"), str(base / "flux2"), str(build_tiny("flux2", base / "tiny-flux2"))
    embed_cache(manifest, ernie, family="ernie-image", model=tiny, executor="local", dtype="fp32")
    embed_cache(manifest, flux2, family="flux2", model=flux2_model, vae=tiny, vae_subfolder="vae", executor="local",
                dtype="fp32")  # fmt: skip
    return {"manifest": manifest, "ernie": ernie, "flux2": flux2, "flux2_model": flux2_model, "base": str(base)}


@pytest.mark.slow
def test_reuse_never_mixes_flux2_and_ernie_latents_of_the_same_vae(tiny, caches, capsys):
    from pipeline.embed.reuse import latent_identity

    ernie, flux2 = read_cache_meta(caches["ernie"]), read_cache_meta(caches["flux2"])
    assert ernie.settings.vae.weights_sha256 == flux2.settings.vae.weights_sha256  # the same VAE weights
    a, b = latent_identity(ernie.settings.hashed), latent_identity(flux2.settings.hashed)
    assert {**a["vae"], "normalised": None} == {**b["vae"], "normalised": None}  # the eps is the whole difference
    assert a["vae"]["normalised"]["batch_norm_eps"] == 1e-5 and "normalised" not in b["vae"]
    assert "eps is 1e-05" in ernie.latent.usage and ernie.text_layout.lengths == (1024,)
    base, manifest = caches["base"], caches["manifest"]
    capsys.readouterr()
    taken = embed_cache(manifest, f"{base}/e2", family="ernie-image", model=tiny, reuse=(caches["flux2"],),
                        executor="local", dtype="fp32")  # fmt: skip
    assert (taken.reused_samples, taken.reused_texts) == (0, 0)
    assert "takes nothing (latents: vae.normalised" in capsys.readouterr().out
    back = embed_cache(manifest, f"{base}/f2", family="flux2", model=caches["flux2_model"], vae=tiny,
                       vae_subfolder="vae", reuse=(caches["ernie"],), executor="local", dtype="fp32")  # fmt: skip
    assert back.reused_samples == 0
    same = embed_cache(manifest, f"{base}/e3", family="ernie-image", model=tiny, reuse=(caches["ernie"],),
                       executor="local", dtype="fp32")  # fmt: skip
    assert same.reused_samples == 6 and same.reused_texts > 0


@pytest.mark.slow
def test_the_estimate_bills_what_embed_writes(tiny, caches):
    from pipeline import EmbedJob
    from pipeline.embed.latents import LatentSpec, latent_shape
    from pipeline.estimate import EstimateJob, estimate
    from tests.test_estimate import _written

    job = EmbedJob(manifest=caches["manifest"], out=f"{caches['base']}/billed", family="ernie-image", model=tiny,
                   executor="local", batch_size=4, shard_records=4, dtype="fp32")  # fmt: skip
    bill = estimate(EstimateJob(embed=job, gpu="cpu"))
    assert (bill.latent_bytes, bill.text_bytes) == _written(caches["ernie"])
    shape = latent_shape(LatentSpec(EncoderSource(tiny, "vae", family="ernie-image")))
    assert shape["normalised"]["batch_norm_eps"] == 1e-5  # the family's path, from the config alone
