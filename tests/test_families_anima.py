"""Anima: the cached text is what ``AnimaModularPipeline`` feeds its transformer, the latents are Qwen-Image's.

A tiny random-weight ``AnimaModularPipeline`` of the real classes (:mod:`pipeline.embed.families.tiny_anima`),
saved as the modular folder (``modular_model_index.json``), moved elsewhere (as a hub download lands) and loaded with
``ModularPipeline.from_pretrained`` + ``load_components``. Every caption's stored rows, zero-padded to 512, equal the
``encoder_hidden_states`` the pipeline's own ``__call__`` hands its transformer (recorded by a hook, the negative
prompt's too), bit for bit in fp32, whatever captions share the embed batch; bf16 records are one rounding of them.
The same with Qwen3's and T5's real tokenizer files (tests/fixtures/checkpoints: z-image's Qwen3-4B tokenizer, the
Qwen3 vocabulary Anima's Qwen3-0.6B-Base shares, and pixart's T5 v1.1 tokenizer, standing in for Anima's
``t5_tokenizer``, which no fixture holds) on captions chosen to break tokenizers. The latents are the pipeline's
img2img VAE path (``encode_vae_image``: posterior mode, ``(z - mean) / std``), so a qwen-image cache of the same
VAE holds the very same latent records and ``embed --reuse`` takes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from pipeline.embed.families.base import missing_classes
from manifests.cache import TextLayout, read_cache_meta
from manifests.errors import UsageError
from pipeline.embed.encoders import encoder_specs
from pipeline.embed.families import anima, family_of_pipeline
from pipeline.embed.families.tiny import build_tiny, save_pipeline, tiny_pipeline
from pipeline.embed.families.tiny_anima import TEXT_WIDTH
from pipeline.embed.latents import LatentSpec
from pipeline.embed.loading import quiet_loading, to_storage
from tests import checkpoints
from tests.checkpoint_text import HARD_CAPTIONS, recorded_inputs, sequences
from tests.embed_data import embed_cache, make_dataset, records_by_id

MISSING = missing_classes("anima")  # why this diffusers cannot run the family (None: it can)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

# empty (no Qwen3 token at all: the pipeline's masked zero id), long (past 512: truncated), unicode and spaces,
# short ones of equal token counts
CAPTIONS = ["a photo of the cat", "", "red dog " * 700, "  The RED Dog, naïve café 漢字 🙂  ", "thing 0",
            "a photo of the dog", "a blue picture"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """The tiny folder, moved after saving: its index's recorded path no longer exists, as after a download."""
    quiet_loading()
    base = tmp_path_factory.mktemp("tiny-anima")
    built = build_tiny("anima", base / "built")
    return str(shutil.move(str(built), str(base / "anima")))


def _text(model: str, family: str = "anima", **options):
    _, spec = encoder_specs(family=family, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None, **options)  # fmt: skip
    return spec.load(dtype="F32")


def _pipeline(folder: str):
    from diffusers import ModularPipeline

    from train.recipes.anima import resize_without_torchvision

    resize_without_torchvision()  # CosmosTransformer3DModel resizes its padding mask with torchvision's resize
    pipe = ModularPipeline.from_pretrained(folder)
    pipe.load_components(dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _transformer_text(pipe, caption: str, **call) -> list[torch.Tensor]:
    """The ``encoder_hidden_states`` of each transformer call of a 1-step ``pipe(prompt=caption)``: the prompt's,
    then the negative (empty) prompt's (classifier-free guidance), each ``(512, D)``."""
    seen: list[torch.Tensor] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["encoder_hidden_states"][0].clone()), with_kwargs=True)
    try:
        with torch.no_grad():
            pipe(prompt=caption, height=32, width=32, num_inference_steps=1, output="latents", **call)
    finally:
        hook.remove()
    return seen


def _padded(rows: torch.Tensor, length: int = 512) -> torch.Tensor:
    from train.recipes.anima import pad_text

    return pad_text(rows[None], length)[0]


def test_cached_text_is_what_the_pipeline_feeds_its_transformer(tiny):
    assert json.loads((Path(tiny) / "modular_model_index.json").read_text())["_class_name"] == "AnimaModularPipeline"
    assert not (Path(tiny) / "model_index.json").exists()
    encoders = _text(tiny)
    layout = TextLayout.from_json(encoders.describe()["layout"])
    assert (layout.masked, layout.lengths, layout.widths, layout.pooled_dim) == (True, (512,), (TEXT_WIDTH,), None)
    assert encoders.describe()["pipeline"] == "AnimaModularPipeline"
    assert [m["class"] for m in encoders.describe()["encoders"]] == ["Qwen3Model", "AnimaTextConditioner"]
    assert all(m["weights_sha256"] for m in encoders.describe()["encoders"])  # the adapter is in the fingerprint
    pipe = _pipeline(tiny)
    assert type(pipe).__name__ == "AnimaModularPipeline" and pipe.text_conditioner.config.min_sequence_length == 512
    encoded = encoders.encode(list(CAPTIONS))
    (empty,), _ = encoded[1]
    for caption, ((tokens,), pooled) in zip(CAPTIONS, encoded):
        assert pooled is None
        want, negative = _transformer_text(pipe, caption)
        n = tokens.shape[0]
        assert torch.equal(_padded(tokens), want), caption[:30]  # fp32: bit for bit, the pad rows zeros
        assert torch.equal(_padded(empty), negative)  # the negative prompt "" too
        assert np.array_equal(to_storage(tokens, "BF16"), to_storage(want[:n], "BF16"))  # bf16: one rounding
    rows = [t[0].shape[0] for t, _ in encoded]
    t5 = pipe.t5_tokenizer
    assert rows == [min(512, len(t5(c).input_ids)) for c in CAPTIONS]  # one row per T5 token, </s> included
    assert rows[1] == 1 and rows[2] == 512
    assert encoders.rows(CAPTIONS) == [(n,) for n in rows]
    assert spec_rows(tiny) == [(n,) for n in rows]  # estimate's count: tokenizers and configs, no weights read
    alone = encoders.encode([CAPTIONS[5]])[0][0][0]  # a caption's rows do not depend on the captions beside it
    assert torch.equal(alone, encoded[5][0][0])


def spec_rows(model: str) -> list[tuple[int, ...]]:
    _, spec = encoder_specs(family="anima", model=model, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None)  # fmt: skip
    return spec.load(weights=False).rows(CAPTIONS)


def _reference(pipe, caption: str, **length) -> torch.Tensor:
    """The pipeline's own encode and conditioning steps for one caption: the adapter's rows, ``(512, D)``."""
    from diffusers.modular_pipelines.anima.before_denoise import AnimaTextConditioningStep
    from diffusers.modular_pipelines.anima.encoders import AnimaTextEncoderStep

    with torch.no_grad():
        text = AnimaTextEncoderStep.encode_prompt(pipe, [caption], prepare_unconditional_embeds=False, device="cpu",
                                                  **length)  # fmt: skip
        return AnimaTextConditioningStep._condition_prompt_embeds(
            pipe, text["qwen_prompt_embeds"], text["qwen_attention_mask"], text["t5_input_ids"],
            text["t5_attention_mask"], "cpu", torch.float32, torch.float32)[0]


@contextlib.contextmanager
def _t5_ids(conditioner) -> Iterator[list[list[int]]]:
    """The T5 ids (masked) of every forward call of the ``AnimaTextConditioner`` ``conditioner``, one list per row."""
    calls: list[list[int]] = []

    def pre(module, args, kwargs):
        ids, mask = kwargs["target_input_ids"], kwargs["target_attention_mask"]
        calls.extend(row[keep.bool()].tolist() for row, keep in zip(ids, mask))

    handle = conditioner.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def test_with_the_real_tokenizers_the_token_ids_and_rows_are_the_pipelines(tmp_path):
    from diffusers import AnimaTextConditioner
    from transformers import AutoTokenizer, T5TokenizerFast

    qwen_files, t5_files = (checkpoints.materialize(f, tmp_path / f) for f in ("z-image", "pixart"))
    pipe = tiny_pipeline("anima")
    tokenizer = AutoTokenizer.from_pretrained(qwen_files / "tokenizer")
    t5 = T5TokenizerFast.from_pretrained(t5_files / "tokenizer")
    torch.manual_seed(0)
    pipe.text_encoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    conditioner = AnimaTextConditioner(**{**pipe.text_conditioner.config, "target_vocab_size": 32128})  # Anima's
    pipe.update_components(tokenizer=tokenizer, t5_tokenizer=t5, text_conditioner=conditioner)
    folder = save_pipeline(pipe, tmp_path / "anima")
    for name, files in (("tokenizer", qwen_files / "tokenizer"), ("t5_tokenizer", t5_files / "tokenizer")):
        shutil.rmtree(folder / name)
        shutil.copytree(files, folder / name)  # the real files verbatim
    encoders = _text(str(folder))
    pipe = _pipeline(str(folder))
    qwen3, adapter = encoders.models
    with recorded_inputs([qwen3.model]) as ours, _t5_ids(adapter.model) as ours_t5:
        encoded = encoders.encode(HARD_CAPTIONS)
    with recorded_inputs([pipe.text_encoder]) as theirs, _t5_ids(pipe.text_conditioner) as theirs_t5:
        want = [_reference(pipe, c) for c in HARD_CAPTIONS]
    assert sequences(ours[0]) == sequences(theirs[0])  # the same Qwen3 ids at the same real positions
    assert ours_t5 == theirs_t5 and len(ours_t5) == len(HARD_CAPTIONS)  # and the same T5 ids
    assert max(max(ids, default=0) for ids in sequences(ours[0])) > 100_000  # the real vocabularies
    assert max(max(ids) for ids in ours_t5) > 10_000
    for caption, ((tokens,), _), ref in zip(HARD_CAPTIONS, encoded, want):
        assert torch.equal(_padded(tokens), ref), caption[:40]
        assert tokens.shape[0] == min(512, len(pipe.t5_tokenizer(caption).input_ids))
    assert encoders.rows(HARD_CAPTIONS) == [(t[0].shape[0],) for t, _ in encoded]


@pytest.mark.parametrize("tokens", [6, 100])
def test_max_text_tokens_is_the_pipelines_max_sequence_length(tiny, tokens):
    encoders = _text(tiny, max_tokens=tokens)
    assert encoders.layout.lengths == (tokens,)
    pipe = _pipeline(tiny)
    for caption, ((part,), _) in zip(CAPTIONS, encoders.encode(list(CAPTIONS))):
        assert torch.equal(_padded(part), _reference(pipe, caption, max_sequence_length=tokens)), caption[:30]
    with pytest.raises(UsageError, match="--max-text-tokens 1024 is above anima's 512 .*it can only be lowered"):
        _text(tiny, max_tokens=1024)


def test_latents_are_the_pipelines_vae_path(tiny):
    from diffusers import AutoencoderKLQwenImage
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.modular_pipelines.anima.encoders import encode_vae_image
    from PIL import Image

    source = encoder_specs(family="anima", model=tiny, vae=None, vae_subfolder=None, text_encoders=None,
                           text_subfolders=None)[0].source  # fmt: skip
    encoder = LatentSpec(source, "mean").load()
    pixels = np.random.default_rng(0).integers(0, 255, (2, 32, 48, 3), dtype=np.uint8)  # (B, H, W, 3)
    latent = encoder.encode(pixels)["latent"]
    info = encoder.describe()
    assert (info["class"], info["scaling_factor"], info["shift_factor"], info["factor"]) == \
        ("AutoencoderKLQwenImage", 1.0, None, 8)  # fmt: skip
    vae = AutoencoderKLQwenImage.from_pretrained(tiny, subfolder="vae")
    images = VaeImageProcessor(vae_scale_factor=8).preprocess([Image.fromarray(p) for p in pixels], 32, 48)
    with torch.no_grad():  # AnimaImg2ImgVaeEncoderStep's: retrieve_latents(argmax), (z - mean) / std per channel
        want = encode_vae_image(images, vae, None, torch.device("cpu"), torch.float32)  # (B, 16, 1, h, w)
    assert latent.shape == (2, 16, 4, 6) and torch.equal(latent, want[:, :, 0])
    assert info["normalised"]["latents_std"] == [float(x) for x in vae.config.latents_std]


def test_the_modular_folder_names_its_family_and_its_parts_are_required(tiny, tmp_path):
    assert family_of_pipeline("AnimaModularPipeline") == "anima"
    with pytest.raises(UsageError, match="says AnimaModularPipeline, not a qwen-image pipeline; pass --family anima"):
        _text(tiny, family="qwen-image")
    broken = tmp_path / "no-adapter"
    shutil.copytree(tiny, broken)
    shutil.rmtree(broken / "text_conditioner")
    with pytest.raises(UsageError, match="text_conditioner.*Anima's T5 tokenizer and text conditioner are read"):
        _text(str(broken))
    assert anima.TOKENS == 512


@pytest.mark.ray
@pytest.mark.slow
def test_the_embed_job_writes_the_cache_and_reuse_takes_qwen_image_latents(tiny, tmp_path, ray_local):
    """The tiny Anima VAE is the tiny Qwen-Image one (seeded so), as the real ones are the same weights: a qwen-image
    cache holds Anima's latent records, ``embed --reuse`` takes every one and encodes Anima's own text."""
    from manifests.manifest import read_manifest
    from pipeline.embed.reuse import latent_identity

    manifest = str(tmp_path / "manifest")
    make_dataset(str(tmp_path / "data"), manifest, 6)
    qwen_model = str(build_tiny("qwen-image", tmp_path / "qwen-image"))
    ours, qwen, reused = (str(tmp_path / n) for n in ("anima", "qwen", "reused"))
    embed_cache(manifest, ours, family="anima", model=tiny, dtype="fp32")
    embed_cache(manifest, qwen, family="qwen-image", model=qwen_model, dtype="fp32")
    meta = read_cache_meta(ours)
    assert meta.family == "anima" and meta.text_layout.lengths == (512,) and meta.text_layout.masked
    assert "normalised" in meta.latent._extra
    assert latent_identity(meta.settings.hashed) == latent_identity(read_cache_meta(qwen).settings.hashed)
    captions = {r["sample_id"]: r["caption"] for r in read_manifest(manifest).samples.to_pylist()}
    records, theirs = records_by_id(ours), records_by_id(qwen)
    encoders = _text(tiny)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # the embed worker's: another count sums otherwise
    try:
        want = {i: encoders.encode([captions[i] or ""])[0][0][0] for i in records}
    finally:
        torch.set_num_threads(threads)
    for sample_id, record in records.items():
        assert np.array_equal(record.text.tokens[0], want[sample_id].numpy())
        assert np.array_equal(record.latent, theirs[sample_id].latent)
    result = embed_cache(manifest, reused, family="anima", model=tiny, dtype="fp32", reuse=(qwen,))
    assert (result.reused_samples, result.reused_texts) == (len(records), 0)
    for sample_id, record in records_by_id(reused).items():
        assert np.array_equal(record.latent, records[sample_id].latent)
        assert np.array_equal(record.text.tokens[0], records[sample_id].text.tokens[0])
