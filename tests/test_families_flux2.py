"""Flux 2, Flux 2 Klein and Chroma: the cache holds what each diffusers pipeline gives its transformer.

Tiny random-weight pipelines of the real classes (:mod:`pipeline.embed.families.tiny_flux2`), saved and loaded
back with ``from_pretrained``: the cached text equals ``encode_prompt`` bit for bit in fp32 (Chroma: its
mask too), bf16 records are that rounded once; Flux 2's latents equal ``Flux2Pipeline._encode_vae_image``
(posterior mean, 2x2 patches, batch-norm normalisation). Which rows are needed is measured on the models: the
Flux 2 transformers take every row with no mask (a pad row changes their output), and Chroma's float mask
is added to the attention scores, so its masked rows change the output too. The text encoder's memory is
checked before any weight is read. An embed job (in this process) writes a cache that says all this.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from manifests.cache import TextLayout, read_cache_meta
from manifests.cache.records import TextRecord
from manifests.cache.verify import verify_cache
from manifests.errors import UsageError
from pipeline.embed.loading import quiet_loading, to_storage
from pipeline.embed.encoders import encoder_specs
from pipeline.embed.families.tiny import T5_WIDTH, build_tiny
from pipeline.embed.families.tiny_flux2 import MISTRAL_WIDTH, QWEN3_WIDTH
from tests.embed_data import embed_cache, make_dataset, records_by_id

FAMILIES = ("flux2", "flux2-klein", "chroma")
# empty, long (truncated at 512 tokens), unicode and Pixtral's image token (Flux 2 removes it), a short one
CAPTIONS = ["a photo of the cat", "", "red dog " * 300, "  The RED Dog, naïve café 漢字 🙂 [IMG] ", "thing 0"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    quiet_loading()
    base = tmp_path_factory.mktemp("tiny-flux2")
    return {f: str(build_tiny(f, base / f)) for f in FAMILIES}


def _text(family: str, model: str, **options):
    _, spec = encoder_specs(family=family, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None, **options)  # fmt: skip
    return spec


def _pipeline(model: str):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(model)


def _reference(family: str, pipe, captions: list[str], max_tokens: int | None = None):
    """``(prompt_embeds, mask or None)`` from the pipeline's own ``encode_prompt``."""
    length = {} if max_tokens is None else {"max_sequence_length": max_tokens}
    with torch.no_grad():
        if family == "chroma":
            embeds, _, mask, *_ = pipe.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False,
                                                     **length)  # fmt: skip
            return embeds, mask
        embeds, _ = pipe.encode_prompt(captions, device="cpu", **length)
        return embeds, None


def _records(encoded, dtype: str) -> list[TextRecord]:
    return [TextRecord(i, tuple(to_storage(t, dtype) for t in tokens), None if p is None else to_storage(p, dtype),
                       dtype) for i, (tokens, p) in enumerate(encoded)]  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_text_equals_the_pipelines_encode_prompt(tiny, family):
    encoders = _text(family, tiny[family]).load()
    info = encoders.describe()
    layout = TextLayout.from_json(info["layout"])
    encoded = encoders.encode(CAPTIONS)
    embeds, mask = _reference(family, _pipeline(tiny[family]), CAPTIONS)
    for dtype, cast in (("F32", lambda t: t), ("BF16", lambda t: t.to(torch.bfloat16).float())):
        joined, ones, pooled = layout.prompt_embeds(_records(encoded, dtype))
        assert ones.all() and np.array_equal(joined, cast(embeds).numpy()), dtype  # every row, bit for bit
        if family == "chroma":  # the transformer's mask, 0 and 1: exact in bf16 too
            assert np.array_equal(pooled, mask.numpy())
            assert mask.sum(1).tolist()[:2] == [7, 2]  # 5 words + </s> + the first pad; "": </s> + pad
        else:
            assert pooled is None
    width = {"flux2": 3 * MISTRAL_WIDTH, "flux2-klein": 3 * QWEN3_WIDTH, "chroma": T5_WIDTH}[family]
    assert (layout.lengths, layout.widths, layout.masked) == ((512,), (width,), False)
    assert info["pipeline"] == json.loads((Path(tiny[family]) / "model_index.json").read_text())["_class_name"]


@pytest.mark.parametrize("family", FAMILIES)
def test_max_text_tokens_lowers_the_length_as_max_sequence_length_does(tiny, family):
    encoders = _text(family, tiny[family], max_tokens=24).load()
    layout = TextLayout.from_json(encoders.describe()["layout"])
    assert layout.lengths == (24,)
    embeds, mask = _reference(family, _pipeline(tiny[family]), CAPTIONS, max_tokens=24)
    joined, _, pooled = layout.prompt_embeds(_records(encoders.encode(CAPTIONS), "F32"))
    assert np.array_equal(joined, embeds.numpy())
    assert mask is None or np.array_equal(pooled, mask.numpy())
    with pytest.raises(UsageError, match="--max-text-tokens 600 is above .* it can only be lowered"):
        _text(family, tiny[family], max_tokens=600).load()


def test_the_llm_runs_only_up_to_the_last_layer_read(tiny):
    from transformers import Mistral3ForConditionalGeneration

    encoders = _text("flux2", tiny["flux2"]).load()
    (m,) = encoders.models
    full = Mistral3ForConditionalGeneration.from_pretrained(tiny["flux2"], subfolder="text_encoder")
    assert len(full.model.language_model.layers) == 32 and len(m.model.layers) == 30  # hidden states 10, 20, 30
    assert type(m.model).__name__ == "MistralModel"  # no vision tower, no language-model head
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    language = full.model.language_model
    assert count(m.model) == count(language) - count(language.layers[30]) - count(language.layers[31])
    assert encoders.describe()["encoders"][0]["class"] == "Mistral3ForConditionalGeneration"


def _tokens(pipe, family: str, captions: list[str]) -> torch.Tensor:
    """The attention mask the pipeline's tokenizer gives ``captions`` (1 on real tokens)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    tok = pipe.tokenizer
    if family == "flux2":
        texts = [tok.apply_chat_template(c, tokenize=False) for c in format_input(captions)]
    else:
        texts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False) for c in captions]  # fmt: skip
    return tok(texts, padding="max_length", max_length=512, add_special_tokens=False,
               return_tensors="pt").attention_mask.bool()  # fmt: skip


@pytest.mark.parametrize("family", ["flux2", "flux2-klein"])
def test_every_row_is_the_transformers_input_and_pad_rows_depend_on_the_padding_side(tiny, family):
    """Flux 2's transformer takes all 512 rows and no mask: a pad row changes its output. Padded on the right
    (Qwen's side), a pad row attends to the caption and differs per caption; padded on the left (Mistral's
    LlamaTokenizerFast side), it attends to nothing and is one row whatever the caption and position."""
    pipe = _pipeline(tiny[family])
    captions = ["a photo of the cat", "red dog"]
    rows = {}
    for side in ("left", "right"):
        pipe.tokenizer.padding_side = side
        with torch.no_grad():
            embeds, _ = pipe.encode_prompt(captions, device="cpu")
        pads = ~_tokens(pipe, family, captions)  # (2, 512)
        both = pads[0] & pads[1]
        rows[side] = (embeds[0][both], embeds[1][both], embeds[0][pads[0]])
    a, b, own = rows["left"]
    assert torch.equal(a, b) and torch.equal(own, own[:1].expand_as(own))  # one row, whatever the caption
    a, b, _ = rows["right"]
    assert (a - b).abs().max() > 1e-4  # a function of the caption

    # the transformer: one pad row changed changes the image tokens' prediction
    transformer = pipe.transformer
    text = torch.randn(1, 512, transformer.config.joint_attention_dim)
    latents = torch.randn(1, 128, 2, 2)
    args = dict(hidden_states=pipe._pack_latents(latents), timestep=torch.tensor([0.5]), img_ids=
                pipe._prepare_latent_ids(latents), txt_ids=pipe._prepare_text_ids(text), return_dict=False,
                guidance=torch.tensor([4.0]) if transformer.config.guidance_embeds else None)  # fmt: skip
    with torch.no_grad():
        before = transformer(encoder_hidden_states=text, **args)[0]
        text[0, 500] += 1.0
        after = transformer(encoder_hidden_states=text, **args)[0]
    assert (before - after).abs().max() > 1e-5


def test_chromas_masked_rows_change_its_transformers_output(tiny):
    """ChromaPipeline's mask is a float 0/1 tensor that the attention adds to its scores: the rows it 'masks'
    still weigh e^-1 of an unmasked one, so they are stored (zeroing them changes the prediction)."""
    from diffusers import ChromaPipeline

    pipe = _pipeline(tiny["chroma"])
    with torch.no_grad():
        embeds, text_ids, mask, *_ = pipe.encode_prompt(["a photo of the cat"], device="cpu",
                                                        do_classifier_free_guidance=False)  # fmt: skip
    latents = torch.randn(1, 16, 4, 4)
    packed = ChromaPipeline._pack_latents(latents, 1, 16, 4, 4)
    attention = pipe._prepare_attention_mask(1, packed.shape[1], latents.dtype, mask)
    assert attention.dtype == torch.float32  # not bool: added to the scores, not a mask

    def predict(text):
        with torch.no_grad():
            return pipe.transformer(hidden_states=packed, timestep=torch.tensor([0.5]), encoder_hidden_states=text,
                                    txt_ids=text_ids, img_ids=ChromaPipeline._prepare_latent_image_ids(1, 2, 2, "cpu",
                                    torch.float32), attention_mask=attention, return_dict=False)[0]  # fmt: skip

    zeroed = embeds.clone()
    zeroed[mask == 0] = 0.0
    assert (predict(embeds) - predict(zeroed)).abs().max() > 1e-4


def _flux2_vae_reference(model: str, pixels: np.ndarray) -> torch.Tensor:
    from diffusers import AutoencoderKLFlux2, Flux2Pipeline

    vae = AutoencoderKLFlux2.from_pretrained(model, subfolder="vae")
    pipe = Flux2Pipeline(scheduler=None, vae=vae, text_encoder=None, tokenizer=None, transformer=None)
    x = torch.from_numpy(pixels.copy()).permute(0, 3, 1, 2).float() / 127.5 - 1.0  # the image processor's [-1, 1]
    with torch.no_grad():
        return pipe._encode_vae_image(x, generator=None), vae.encode(x).latent_dist.std


@pytest.mark.parametrize("family", ["flux2", "flux2-klein"])
def test_flux2_latents_are_the_pipelines_vae_path(tiny, family):
    from diffusers import Flux2Pipeline

    latent, _ = encoder_specs(family=family, model=tiny[family], vae=None, vae_subfolder=None, text_encoders=None,
                              text_subfolders=None, latents="posterior")  # fmt: skip
    encoder = latent.load()
    pixels = np.random.default_rng(0).integers(0, 255, (2, 32, 48, 3), dtype=np.uint8)
    out = encoder.encode(pixels)
    want, std = _flux2_vae_reference(tiny[family], pixels)
    assert out["latent"].shape == (2, 128, 2, 3) and torch.equal(out["latent"], want)  # bit for bit
    bn = encoder.vae.bn
    assert not torch.equal(bn.running_var, torch.ones_like(bn.running_var))  # the tiny VAE's statistics are set
    scale = torch.sqrt(bn.running_var + encoder.vae.config.batch_norm_eps).view(1, -1, 1, 1)
    torch.testing.assert_close(out["latent_std"], Flux2Pipeline._patchify_latents(std) / scale)  # a draw normalises
    described = encoder.describe()
    assert (described["factor"], described["channels"], described["scaling_factor"], described["shift_factor"]) == \
        (16, 128, 1.0, None)  # fmt: skip
    with pytest.raises(UsageError, match="multiples of 16 pixels"):
        encoder.encode(pixels[:, :24])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_text_encoder_is_refused_in_one_line_before_its_weights_are_read(tiny, tmp_path, family):
    """The memory check reads config.json only: without the weights file the refusal still comes (and is
    about memory), and with enough memory the missing file is what fails."""
    folder = tmp_path / family
    shutil.copytree(tiny[family], folder)
    spec = _text(family, str(folder))
    with pytest.raises(UsageError) as refused:
        spec.load(device_memory=1000)
    message = str(refused.value)
    assert "\n" not in message and "for its weights alone, and the GPU has 0.00 MB free" in message
    need = float(message.split(" needs ")[1].split(" MB")[0])
    encoders = spec.load(device_memory=10**9)  # the tiny weights fit: loaded, in fp32 on the CPU
    params = sum(p.numel() for m in encoders.models for p in m.model.parameters())
    assert need == pytest.approx(params * 4 / 1e6, abs=0.01)  # the pruned model's fp32 bytes
    for weights in (folder / "text_encoder").glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(UsageError, match="for its weights alone"):
        spec.load(device_memory=1000)


@pytest.fixture(scope="module")
def flux2_cache(tiny, tmp_path_factory):
    """6 images embedded as Flux 2 in this process (no Ray), posterior latents, 2 validation prompts."""
    base = tmp_path_factory.mktemp("flux2-embed")
    manifest, out, prompts = str(base / "manifest"), str(base / "cache"), base / "prompts.txt"
    make_dataset(str(base / "data"), manifest, 6)
    prompts.write_text("a red cat\na blue dog\n")
    embed_cache(manifest, out, family="flux2", model=tiny["flux2"], latents="posterior", executor="local",
                validation_prompts=str(prompts), dtype="fp32")  # fmt: skip
    return manifest, out


def test_an_embed_job_writes_what_the_flux2_denoiser_sees_and_says_so(tiny, flux2_cache):
    from manifests.buckets import parse_bucket
    from manifests.schema import sample_ids
    from pipeline.embed.imaging import prepare_views

    _, out = flux2_cache
    meta = read_cache_meta(out)
    assert meta.family == "flux2" and meta.settings.vae.class_ == "AutoencoderKLFlux2"
    latent = meta.latent
    assert (latent.channels, latent.factor, latent.scaling_factor, latent.shift_factor) == (128, 16, 1.0, None)
    assert "batch-norm running statistics" in latent.usage and latent.usage.startswith("latent = latent + latent_std")
    assert meta.text_layout.lengths == (512,) and meta.text_layout.widths == (3 * MISTRAL_WIDTH,)
    assert meta.settings.text.encoders[0].class_ == "Mistral3ForConditionalGeneration"
    assert verify_cache(out).ok
    # each record: the pipeline's VAE path on the crop the embed job cut (batched with others: to fp32 rounding)
    records = records_by_id(out)
    data = Path(out).parent / "data"
    for path in sorted(data.iterdir()):
        record = records[int(sample_ids([path.name])[0])]
        w, h = parse_bucket(record.bucket)
        view = prepare_views(path.read_bytes(), (h, w))[0]
        want, _ = _flux2_vae_reference(tiny["flux2"], view.pixels[None])
        assert record.latent.shape == (128, h // 16, w // 16) == record.latent_std.shape
        np.testing.assert_allclose(record.latent, want[0].numpy(), rtol=1e-5, atol=1e-5)
