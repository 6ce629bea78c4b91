"""Krea 2: the cached text equals ``Krea2Pipeline.encode_prompt``'s rows, the latents are Qwen-Image's.

A tiny random-weight ``Krea2Pipeline`` of the real classes (:mod:`pipeline.embed.families.tiny_krea2`: a 36-layer
``Qwen3VLModel``, saved and loaded with ``from_pretrained``): every caption's stored rows equal the rows of the
pipeline's own ``encode_prompt`` that its mask keeps (caption + the 5 suffix tokens after the padding, 12 hidden
states side by side), bit for bit in fp32, in any batch; the template, the 34 dropped tokens, the suffix and the 12
layers are the pipeline's. The same with Qwen3's real tokenizer files (tests/fixtures/checkpoints/z-image: Qwen3-4B's
tokenizer, standing in for Qwen3-VL-4B's, which no fixture holds) on captions chosen to break tokenizers, the token
ids fed to the encoder being the pipeline's. On a GPU captions are grouped by length (a pad takes no position and no
key): the same rows to an ulp, counted by the tokenizer alone. The latents are the Qwen-Image VAE path's, and
``Krea2Pipeline.__call__``'s own decode turns them back into the image the VAE decodes from the posterior mean; a
qwen-image cache of the same VAE holds the same latent records, and ``embed --reuse`` takes them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.embed.families.base import missing_classes
from manifests.cache import TextLayout, read_cache_meta
from manifests.errors import UsageError
from pipeline.embed.encoders import encoder_specs
from pipeline.embed.families import krea2
from pipeline.embed.families.tiny import build_tiny, save_pipeline, tiny_pipeline
from pipeline.embed.families.tiny_krea2 import KREA2_TEXT_WIDTH
from pipeline.embed.latents import LatentSpec
from pipeline.embed.loading import quiet_loading, to_storage
from tests import checkpoints
from tests.checkpoint_text import HARD_CAPTIONS, recorded_inputs, sequences
from tests.embed_data import embed_cache, make_dataset, records_by_id

MISSING = missing_classes("krea-2")  # why this diffusers cannot run the family (None: it can)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

# empty, long (past 512 - 5 caption tokens: truncated), unicode and spaces, the template's own tokens, short ones
CAPTIONS = ["a photo of the cat", "", "red dog " * 700, "  The RED Dog, naïve café 漢字 🙂  ",
            "<|im_end|>\n<|im_start|>assistant\n", "thing 0", "a photo of the dog"]  # fmt: skip
WIDTH = len(krea2.LAYERS) * KREA2_TEXT_WIDTH


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    quiet_loading()
    return str(build_tiny("krea-2", tmp_path_factory.mktemp("tiny-krea2") / "krea-2"))


def _text(model: str, **options):
    _, spec = encoder_specs(family="krea-2", model=model, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None, **options)  # fmt: skip
    return spec.load(dtype="F32")


def _reference(pipe, captions: list[str], **length) -> list[torch.Tensor]:
    """Per caption, the rows of the pipeline's ``encode_prompt(captions)`` its mask keeps, 12 layers side by side."""
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(captions, device="cpu", **length)  # (B, L, 12, D), (B, L) bool
    assert mask.dtype == torch.bool and embeds.shape[2] == len(krea2.LAYERS)
    return [e[m].flatten(1) for e, m in zip(embeds, mask)]


def test_cached_text_equals_the_pipelines_encode_prompt(tiny):
    from diffusers import DiffusionPipeline

    encoders = _text(tiny)
    layout = TextLayout.from_json(encoders.describe()["layout"])
    assert (layout.masked, layout.lengths, layout.widths, layout.pooled_dim) == (True, (512,), (WIDTH,), None)
    pipe = DiffusionPipeline.from_pretrained(tiny)
    assert type(pipe).__name__ == "Krea2Pipeline"
    # the template, the rows dropped, the suffix and the layers read are the pipeline's own
    assert (pipe.prompt_template_encode_prefix, pipe.prompt_template_encode_suffix) == (krea2.PREFIX, krea2.SUFFIX)
    assert (pipe.prompt_template_encode_start_idx, pipe.prompt_template_encode_num_suffix_tokens) == (krea2.DROP, 5)
    assert pipe.text_encoder_select_layers == krea2.LAYERS
    encoded = encoders.encode(list(CAPTIONS))
    for caption, (tokens, pooled), want in zip(CAPTIONS, encoded, _reference(pipe, CAPTIONS)):
        assert pooled is None and len(tokens) == 1
        assert tokens[0].shape == want.shape and torch.equal(tokens[0], want), caption[:30]  # fp32: bit for bit
        assert np.array_equal(to_storage(tokens[0], "BF16"), to_storage(want, "BF16"))  # bf16: one rounding
    rows = [t[0].shape[0] for t, _ in encoded]
    assert rows[1] == 5 and rows[2] == 512  # the empty caption keeps the suffix; a long one is cut at 512
    assert encoders.rows(CAPTIONS) == [(n,) for n in rows]  # what estimate counts: the tokenizer's
    # a caption's rows do not depend on the captions encoded beside it, and equal encode_prompt([caption])
    alone = encoders.encode([CAPTIONS[3]])[0][0][0]
    assert torch.equal(alone, encoded[3][0][0]) and torch.equal(alone, _reference(pipe, [CAPTIONS[3]])[0])


@pytest.mark.slow
def test_bf16_text_equals_the_pipelines_bf16_encode_prompt(tiny):
    """The GPU's path (weights and compute in bf16, run here on the CPU) against the pipeline loaded in bf16."""
    from diffusers import DiffusionPipeline

    _, spec = encoder_specs(family="krea-2", model=tiny, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None)  # fmt: skip
    encoders = spec.load(dtype="BF16", compute="BF16")
    pipe = DiffusionPipeline.from_pretrained(tiny, torch_dtype=torch.bfloat16)
    for caption, ((tokens,), _), want in zip(CAPTIONS, encoders.encode(list(CAPTIONS)), _reference(pipe, CAPTIONS)):
        assert want.dtype == torch.bfloat16 and torch.equal(tokens, want.float()), caption[:30]


def test_the_text_encoder_runs_as_its_decoder_up_to_layer_35(tiny):
    """What runs is Qwen3-VL's text decoder cut after layer 35, the last one read (the rows above equal the full
    model's ``hidden_states[2, 5, ..., 35]``); a text encoder without 35 layers is refused before loading."""
    encoders = _text(tiny)
    (m,) = encoders.models
    assert type(m.model).__name__ == "Qwen3VLTextModel" and len(m.model.layers) == max(krea2.LAYERS)
    with pytest.raises(UsageError, match="has 12 layers"):
        from transformers import Qwen3VLConfig, Qwen3VLModel

        config = Qwen3VLConfig.from_pretrained(tiny, subfolder="text_encoder")
        config.text_config.num_hidden_layers = 12
        with torch.device("meta"):
            krea2.prune(Qwen3VLModel(config))


def test_with_qwen3s_real_tokenizer_the_token_ids_and_rows_are_the_pipelines(tmp_path):
    from diffusers import DiffusionPipeline
    from transformers import AutoTokenizer

    files = checkpoints.materialize("z-image", tmp_path / "files")
    pipe = tiny_pipeline("krea-2")
    tokenizer = AutoTokenizer.from_pretrained(files / "tokenizer")
    pipe.tokenizer = tokenizer
    torch.manual_seed(0)
    pipe.text_encoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    folder = save_pipeline(pipe, tmp_path / "krea-2")
    shutil.rmtree(folder / "tokenizer")
    shutil.copytree(files / "tokenizer", folder / "tokenizer")  # the real files verbatim
    index = json.loads((folder / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "Qwen2Tokenizer"]
    (folder / "model_index.json").write_text(json.dumps(index))
    encoders = _text(str(folder))
    pipe = DiffusionPipeline.from_pretrained(str(folder))
    # the real vocabulary: Qwen-Image's prefix is 34 tokens and the suffix 5, as the pipeline counts them
    assert len(pipe.tokenizer(krea2.PREFIX).input_ids) == krea2.DROP
    assert len(pipe.tokenizer(krea2.SUFFIX).input_ids) == krea2.SUFFIX_TOKENS
    with recorded_inputs([encoders.models[0].model]) as ours:
        encoded = encoders.encode(HARD_CAPTIONS)
    with recorded_inputs([pipe.text_encoder]) as theirs:
        want = _reference(pipe, HARD_CAPTIONS)
    assert sequences(ours[0]) == sequences(theirs[0])  # the same token ids at the same real positions
    assert all(torch.equal(m, t) for (_, m), (_, t) in zip(ours[0], theirs[0]))  # and the same masks
    for caption, ((tokens,), _), ref in zip(HARD_CAPTIONS, encoded, want):
        assert tokens.shape == ref.shape and torch.equal(tokens, ref), caption[:40]
    assert encoders.rows(HARD_CAPTIONS) == [(r.shape[0],) for r in want]


@pytest.mark.parametrize("tokens", [100, 6])
def test_max_text_tokens_is_the_pipelines_max_sequence_length(tiny, tokens):
    from diffusers import DiffusionPipeline

    encoders = _text(tiny, max_tokens=tokens)
    assert encoders.layout.lengths == (tokens,)
    pipe = DiffusionPipeline.from_pretrained(tiny)
    for caption, ((part,), _), want in zip(CAPTIONS, encoders.encode(list(CAPTIONS)),
                                           _reference(pipe, CAPTIONS, max_sequence_length=tokens)):  # fmt: skip
        assert torch.equal(part, want), caption[:30]
    with pytest.raises(UsageError, match="--max-text-tokens 1024 is above krea-2's 512 .*it can only be lowered"):
        _text(tiny, max_tokens=1024)
    with pytest.raises(UsageError, match="--max-text-tokens 5: krea-2 keeps the template's 5 closing tokens"):
        _text(tiny, max_tokens=5)


def test_length_groups_give_the_pipelines_rows_and_compute_less_padding(tiny, monkeypatch):
    """On a GPU (faked here) captions are padded by length group, not to 512 + 34: a pad takes no position and is
    masked, so the real rows are those of full padding up to float32 rounding, and the tokenizer counts them."""
    encoders = _text(tiny)
    full = encoders._plain(list(CAPTIONS), encoders.options)
    seen: list[tuple[int, int]] = []
    model = encoders.models[0]
    forward = type(model).__call__
    monkeypatch.setattr(type(model), "__call__", lambda self, ids, **kw: seen.append(tuple(ids.shape))
                        or forward(self, ids, **kw))  # fmt: skip
    monkeypatch.setattr(encoders, "device", torch.device("cuda"))
    monkeypatch.setattr(encoders, "_plain", lambda captions, options: type(encoders)._plain(encoders, captions,
                                                                                           options))  # fmt: skip
    grouped = encoders.encode(list(CAPTIONS))
    for caption, ((a,), _), ((b,), _) in zip(CAPTIONS, full, grouped):
        assert a.shape == b.shape, caption[:20]
        assert float((a - b).abs().max() / a.abs().max()) <= 4 * torch.finfo(torch.float32).eps, caption[:20]
    assert len(seen) > 1 and sum(b * n for b, n in seen) < len(CAPTIONS) * (512 + krea2.DROP)


def _crops(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (2, 32, 48, 3), dtype=np.uint8)  # (B, H, W, 3)


def test_latents_are_qwen_images_and_the_pipelines_own_decode_inverts_them(tiny):
    from diffusers import AutoencoderKLQwenImage, DiffusionPipeline

    source = encoder_specs(family="krea-2", model=tiny, vae=None, vae_subfolder=None, text_encoders=None,
                           text_subfolders=None)[0].source  # fmt: skip
    encoder = LatentSpec(source, "mean").load()
    pixels = _crops()
    latent = encoder.encode(pixels)["latent"]  # (B, 16, h, w), stored normalised
    info = encoder.describe()
    assert (info["class"], info["scaling_factor"], info["shift_factor"]) == ("AutoencoderKLQwenImage", 1.0, None)
    vae = AutoencoderKLQwenImage.from_pretrained(tiny, subfolder="vae")
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    with torch.no_grad():
        mode = vae.encode(x.unsqueeze(2)).latent_dist.mode()  # (B, 16, 1, h, w)
        want = vae.decode(mode, return_dict=False)[0][:, :, 0]
    pipe = DiffusionPipeline.from_pretrained(tiny)
    b, c, h, w = latent.shape
    packed = pipe._pack_latents(latent, b, c, h, w)

    def ours(pipe, step, t, kwargs):  # the latents the loop ends on: the cache's, so __call__ decodes them
        return {"latents": packed}

    embeds = torch.zeros(b, 7, len(krea2.LAYERS), KREA2_TEXT_WIDTH)
    with torch.no_grad():
        image = pipe(prompt_embeds=embeds, prompt_embeds_mask=torch.ones(b, 7, dtype=torch.bool), height=32, width=48,
                     num_inference_steps=1, guidance_scale=0.0, output_type="pt", callback_on_step_end=ours).images
    # Krea2Pipeline's decode (latents * std + mean) of the stored latents is the VAE's decode of the posterior mode
    torch.testing.assert_close(image, (want / 2 + 0.5).clamp(0, 1), rtol=0, atol=1e-5)


def test_bad_latent_sides_and_an_unknown_pipeline_are_refused(tiny, tmp_path):
    from train.recipes.krea2 import model_inputs

    with pytest.raises(UsageError, match="multiples of 16 pixels"):
        model_inputs(torch.zeros(1, 16, 3, 4), torch.zeros(1, 2, WIDTH), torch.ones(1, 2), patch=2, layers=12)
    index = json.loads((Path(tiny) / "model_index.json").read_text())
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "QwenImagePipeline"}))
    with pytest.raises(UsageError, match="says QwenImagePipeline, not a krea-2 pipeline; pass --family qwen-image"):
        _text(str(other))


@pytest.mark.ray
@pytest.mark.slow
def test_a_qwen_image_cache_of_the_same_vae_holds_krea2s_latents_and_reuse_takes_them(tiny, tmp_path, ray_local):
    """The qwen-image family reading the Krea 2 folder's VAE (``--vae``) writes the very latent records krea-2 does
    (same class, weights and normalisation): ``embed --reuse`` copies them instead of encoding."""
    from pipeline.embed.reuse import latent_identity

    manifest = str(tmp_path / "manifest")
    make_dataset(str(tmp_path / "data"), manifest, 6)
    qwen_model = str(build_tiny("qwen-image", tmp_path / "qwen-image"))
    krea_cache, qwen_cache, reused = (str(tmp_path / n) for n in ("krea", "qwen", "reused"))
    embed_cache(manifest, krea_cache, family="krea-2", model=tiny, dtype="fp32")
    embed_cache(manifest, qwen_cache, family="qwen-image", model=qwen_model, vae=tiny, vae_subfolder="vae",
                dtype="fp32")
    krea, qwen = read_cache_meta(krea_cache), read_cache_meta(qwen_cache)
    assert krea.family == "krea-2" and krea.text_layout.widths == (WIDTH,) and krea.text_layout.masked
    assert latent_identity(krea.settings.hashed) == latent_identity(qwen.settings.hashed)
    assert krea.latent._extra["normalised"] == qwen.latent._extra["normalised"]
    ours, theirs = records_by_id(krea_cache), records_by_id(qwen_cache)
    assert set(ours) == set(theirs)
    for sample_id, record in ours.items():
        assert record.latent.dtype == np.float32 and np.array_equal(record.latent, theirs[sample_id].latent)
    result = embed_cache(manifest, reused, family="krea-2", model=tiny, dtype="fp32", reuse=(qwen_cache,))
    assert result.reused_samples == len(ours)
    for sample_id, record in records_by_id(reused).items():
        assert np.array_equal(record.latent, ours[sample_id].latent)
        assert np.array_equal(record.text.tokens[0], ours[sample_id].text.tokens[0])


def test_the_estimate_bill_is_what_embed_then_writes(tiny, tmp_path):
    """``bucketeer estimate`` counts krea-2's text rows with the tokenizer alone (no model run) and its bytes are
    the ones the records then hold."""
    from manifests.cache import CacheReader, read_index
    from pipeline import EmbedJob, run
    from pipeline.estimate import EstimateJob, estimate

    manifest = str(tmp_path / "manifest")
    make_dataset(str(tmp_path / "ds"), manifest, n=6, unique_from=4)
    out = str(tmp_path / "cache")
    job = EmbedJob(manifest=manifest, out=out, family="krea-2", model=tiny, executor="local", batch_size=4,
                   shard_records=4)  # fmt: skip
    bill = estimate(EstimateJob(embed=job, gpu="cpu"))
    run(job)
    reader = CacheReader(out)
    keys = read_index(out)["texts"].column("caption_key").to_pylist()
    latent = sum(r.latent.nbytes for r in reader.read(reader.sample_ids.tolist()))
    text = sum(sum(t.nbytes for t in r.tokens) for r in reader.read_texts(keys))
    assert (bill.samples, bill.captions, bill.latent_bytes, bill.text_bytes) == (6, len(keys), latent, text)


def test_bytes_per_caption_and_per_sample_at_real_size(tmp_path):
    """From the published configs alone (:mod:`benchmarks.real_configs`, no weight built): a caption's record is its
    tokens + the 5 closing ones, 12 x 2560 = 30,720 wide (60 KB a row in bf16: 9.5x Qwen-Image's 3584-wide rows of
    the same caption and template), up to 512 rows; a 1024x1024 sample's latent is Qwen-Image's 16 x 128 x 128."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import Qwen3VLConfig

    from benchmarks.real_configs import QWEN3_VL_4B, QWEN_VL_7B
    from pipeline.embed.latents import latent_shape

    files = checkpoints.materialize("z-image", tmp_path / "files")  # Qwen3's real tokenizer
    folder = tmp_path / "krea-2"
    shutil.copytree(files / "tokenizer", folder / "tokenizer")
    Qwen3VLConfig(**QWEN3_VL_4B).save_pretrained(folder / "text_encoder")
    with torch.device("meta"):
        AutoencoderKLQwenImage().save_config(folder / "vae")  # Qwen-Image's VAE: diffusers' defaults
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "Krea2Pipeline", "text_encoder": ["transformers", "Qwen3VLModel"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"], "vae": ["diffusers", "AutoencoderKLQwenImage"]}))
    latents, spec = encoder_specs(family="krea-2", model=str(folder), vae=None, vae_subfolder=None,
                                  text_encoders=None, text_subfolders=None)  # fmt: skip
    shapes = spec.load(weights=False)
    assert shapes.layout.widths == (30720,) and shapes.layout.lengths == (512,)
    captions = ["", "a photo of a cat on a red sofa by the window", "red dog " * 700]
    rows = [n for (n,) in shapes.rows(captions)]
    assert rows[0] == 5 and rows[2] == 512
    per_caption = [n * 30720 * 2 for n in rows]  # bf16
    assert per_caption[0] == 307_200 and per_caption[2] == 31_457_280  # 0.3 MB empty, 31.5 MB at the longest
    assert per_caption[1] / (rows[1] * QWEN_VL_7B["text_config"]["hidden_size"] * 2) == pytest.approx(30720 / 3584)
    shape = latent_shape(latents)
    assert (shape["channels"], shape["factor"]) == (16, 8)
    assert shape["channels"] * (1024 // shape["factor"]) ** 2 * 2 == 524_288  # bf16 latent per 1024x1024 sample
