"""The generic family: explicit ``--vae`` / ``--text-encoder`` folders (tiny, random weights, hub-style).

SDXL's encoder pair, a bare T5 repo and an SD3/Flux-style VAE, named one by one as a user without a
``--family`` does. Unit tests load them through the specs the embed job uses and compare with a
direct transformers forward; a Ray test runs the embed job on the pair and checks what
``_cache.json`` and the records hold. The model families are tests/test_families.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from manifests.cache import CacheError, read_cache_meta
from manifests.cache.records import SampleRecord, TextRecord, caption_key, to_float32
from manifests.cache.verify import verify_cache
from pipeline.embed.loading import EncoderSource, quiet_loading, weights_sha256
from pipeline.embed.latents import LatentSpec
from pipeline.embed.encoders import TextSpec
from tests.embed_data import embed_cache, make_dataset, records_by_id
from tests.encoder_repos import (
    CLIP1_WIDTH,
    CLIP2_WIDTH,
    PROJECTION_DIM,
    T5_MAX_LENGTH,
    T5_WIDTH,
    VAE_CHANNELS,
    VAE_SCALING,
    VAE_SHIFT,
    sdxl_repo,
    t5_repo,
)

CAPTIONS = ["a photo of the cat", "", "red dog " * 40]  # the last is longer than any max length


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    quiet_loading()
    base = tmp_path_factory.mktemp("encoder-repos")
    return sdxl_repo(base / "sdxl"), t5_repo(base / "t5")


def _sdxl_reference(path: str, sub: str, caption: str):
    """What SDXL's ``encode_prompt`` computes: ids padded to 77, no attention mask, ``output_hidden_states``."""
    from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = AutoTokenizer.from_pretrained(path, subfolder=sub.replace("text_encoder", "tokenizer"))
    model = (CLIPTextModelWithProjection if sub.endswith("_2") else CLIPTextModel).from_pretrained(path, subfolder=sub)
    unpadded = tokenizer(caption, truncation=True, max_length=tokenizer.model_max_length)["input_ids"]
    ids = tokenizer(caption, padding="max_length", truncation=True, max_length=tokenizer.model_max_length,
                    return_tensors="pt").input_ids  # fmt: skip
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    return unpadded, tokenizer, out


def _text(sources: list[EncoderSource], layer: str = "last"):
    """Generic text encoders as the embed job loads them (``--text-encoder ... --text-layer layer``)."""
    return TextSpec("generic", tuple(sources), layer=layer).load()


def test_sdxl_pair_from_a_pipeline_folder_encodes_as_sdxl_does(repos):
    """Generic: the pair's real tokens, each computed as SDXL does (its family stores all 77 positions)."""
    sdxl, _ = repos
    sources = [EncoderSource(sdxl.path, "text_encoder"), EncoderSource(sdxl.path, "text_encoder_2")]
    penultimate = _text(sources, layer="penultimate")
    info = penultimate.describe()
    assert [(e["class"], e["subfolder"], e["hidden_size"], e["max_length"]) for e in info["encoders"]] == [
        ("CLIPTextModel", "text_encoder", CLIP1_WIDTH, 77),
        ("CLIPTextModelWithProjection", "text_encoder_2", CLIP2_WIDTH, 77),
    ]
    assert info["pooled_dim"] == PROJECTION_DIM and info["layer"] == "penultimate"
    assert info["encoders"][0]["weights_sha256"] != info["encoders"][1]["weights_sha256"]
    last = _text(sources, layer="last").encode(CAPTIONS)

    for caption, (tokens, pooled), (last_tokens, _) in zip(CAPTIONS, penultimate.encode(CAPTIONS), last):
        assert [t.shape[1] for t in tokens] == [CLIP1_WIDTH, CLIP2_WIDTH]
        for i, sub in enumerate(("text_encoder", "text_encoder_2")):
            ids, tokenizer, ref = _sdxl_reference(sdxl.path, sub, caption)
            n = len(ids)
            assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
            assert tokens[i].shape[0] == n == (77 if len(caption) > 100 else n)  # unpadded, BOS..EOS, truncated
            torch.testing.assert_close(tokens[i], ref.hidden_states[-2][0, :n], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(last_tokens[i], ref.last_hidden_state[0, :n], rtol=1e-4, atol=1e-5)
            assert (tokens[i] - last_tokens[i]).abs().max() > 0.1  # penultimate is not the last layer
        # SDXL's pooled: text_embeds (projection) of the second encoder, from the 77-padded ids
        assert pooled.shape == (PROJECTION_DIM,)
        torch.testing.assert_close(pooled, ref.text_embeds[0], rtol=1e-4, atol=1e-5)
    assert penultimate.encode(CAPTIONS[1:2])[0][0][0].shape[0] == 2  # the null caption: BOS + EOS


def test_t5_encoder_repo_without_subfolder(repos):
    from transformers import AutoTokenizer, T5EncoderModel

    _, t5 = repos
    encoders = _text([EncoderSource(t5)])  # no subfolder: config, weights and tokenizer at the top
    info = encoders.describe()
    assert info["pooled_dim"] is None
    assert [(e["class"], e["subfolder"], e["hidden_size"], e["max_length"]) for e in info["encoders"]] == [
        ("T5EncoderModel", None, T5_WIDTH, T5_MAX_LENGTH)
    ]
    tokenizer = AutoTokenizer.from_pretrained(t5)
    model = T5EncoderModel.from_pretrained(t5).eval()
    assert info["encoders"][0]["weights_sha256"] == weights_sha256(model)
    for caption, (tokens, pooled) in zip(CAPTIONS, encoders.encode(CAPTIONS)):
        ids = tokenizer(caption, truncation=True, max_length=T5_MAX_LENGTH)["input_ids"]
        assert ids[-1] == tokenizer.eos_token_id and len(ids) <= T5_MAX_LENGTH
        assert pooled is None and len(tokens) == 1 and tokens[0].shape == (len(ids), T5_WIDTH)
        with torch.no_grad():  # alone, unpadded: the batch's padding is masked out of attention
            ref = model(torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(tokens[0], ref, rtol=1e-4, atol=1e-5)
    assert encoders.encode([""])[0][0][0].shape == (1, T5_WIDTH)  # EOS only: T5 has no BOS


def test_vae_from_a_subfolder_reports_scaling_and_shift(repos):
    sdxl, _ = repos
    vae = LatentSpec(EncoderSource(sdxl.path, "vae")).load()
    info = vae.describe()
    assert (info["subfolder"], info["channels"], info["factor"]) == ("vae", VAE_CHANNELS, 8)
    assert (info["scaling_factor"], info["shift_factor"]) == (VAE_SCALING, VAE_SHIFT)
    out = vae.encode(np.full((2, 64, 32, 3), 127, np.uint8))
    latents = out["latent"]
    assert set(out) == {"latent"}  # --latents mean: no std
    assert latents.shape == (2, VAE_CHANNELS, 8, 4) and torch.isfinite(latents).all()


def test_text_model_of_an_unknown_architecture_is_refused(repos, tmp_path):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    CLIPVisionModel(CLIPVisionConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=8, patch_size=4)).save_pretrained(tmp_path / "vision")  # fmt: skip
    sdxl, _ = repos
    for f in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer beside it, so only the model is wrong
        (tmp_path / "vision" / f).write_bytes((Path(sdxl.path) / "tokenizer" / f).read_bytes())
    with pytest.raises(ValueError, match="CLIPVisionModel.*bucketeer knows"):
        _text([EncoderSource(str(tmp_path / "vision"))])


def test_collate_pads_each_encoder_to_the_batch_and_masks_where_any_encoder_has_a_token():
    from manifests.cache import TextLayout
    from train.data import PlanStep, collate

    layout = TextLayout("generic", "features", True, (77, 77), (3, 5), pooled_dim=4)

    def record(sid: int, lengths: tuple[int, int]) -> SampleRecord:
        tokens = tuple(np.full((n, d), sid + i, np.float32) for i, (n, d) in enumerate(zip(lengths, (3, 5))))
        text = TextRecord(caption_key=sid, tokens=tokens, pooled=np.ones(4, np.float32), dtype="F32")
        return SampleRecord(sid, "64x64", np.ones((2, 8, 8), np.float32), "F32", (64, 64), (64, 64), (0, 0),
                            (64, 64), sid, text)  # fmt: skip

    batch = collate([record(10, (4, 2)), record(20, (2, 6))], PlanStep(0, 0, "64x64", (10, 20)), layout=layout,
                    scaling_factor=2.0, shift_factor=0.5)  # fmt: skip
    assert batch.text.shape == (2, 6, 8) and batch.text_mask.tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6]
    assert (batch.text[0, :4, :3] == 10).all() and (batch.text[0, :2, 3:] == 11).all()
    assert not batch.text[0, 4:].any() and not batch.text[0, 2:, 3:].any()  # each encoder zero past its length
    assert (batch.text[1, :2, :3] == 20).all() and not batch.text[1, 2:, :3].any()
    assert (batch.text[1, :, 3:] == 21).all()
    assert torch.allclose(batch.latents, torch.full_like(batch.latents, 1.0))  # (1 - 0.5) * 2


# ---- the embed job on real Ray ------------------------------------------------------------------

# make_dataset's captions: "a photo of thing {i % 3}", none for every 5th image (the empty string)
DATASET_CAPTIONS = {caption_key(c): c for c in ["", *(f"a photo of thing {i}" for i in range(3))]}


def _sdxl_embeddings(path: str, caption: str):
    """SDXL's own way (77-padded ids, no mask): penultimate states of both encoders, text_embeds of the second."""
    tokens, pooled = [], None
    for sub in ("text_encoder", "text_encoder_2"):
        ids, _, out = _sdxl_reference(path, sub, caption)
        tokens.append(out.hidden_states[-2][0, : len(ids)].numpy())
        pooled = getattr(out, "text_embeds", None)
    return tokens, pooled[0].numpy()


def _bf16_close(stored: np.ndarray, tag: str, expected: np.ndarray) -> None:
    assert tag == "BF16" and stored.shape == expected.shape
    np.testing.assert_allclose(to_float32(stored, tag), expected, rtol=1e-2, atol=1e-2)  # bf16: 8 mantissa bits


@pytest.fixture(scope="module")
def sdxl_cache(repos, tmp_path_factory, ray_local):
    """8 images embedded with the SDXL-style folder (its VAE and both text encoders), penultimate layer."""
    sdxl, _ = repos
    base = tmp_path_factory.mktemp("sdxl-embed")
    manifest, out = str(base / "manifest"), str(base / "cache")
    make_dataset(str(base / "data"), manifest, 8)
    embed_cache(manifest, out, **sdxl.embed_options())
    return sdxl, manifest, out


@pytest.mark.ray
@pytest.mark.slow
def test_embed_with_the_sdxl_pair_and_a_vae_subfolder(sdxl_cache):
    from transformers import AutoTokenizer

    sdxl, manifest, out = sdxl_cache
    meta = read_cache_meta(out)
    settings = meta.settings
    assert (settings.vae.id, settings.vae.subfolder) == (sdxl.path, "vae")
    assert (settings.vae.scaling_factor, settings.vae.shift_factor) == (VAE_SCALING, VAE_SHIFT)
    assert (meta.latent.scaling_factor, meta.latent.shift_factor) == (VAE_SCALING, VAE_SHIFT)
    assert meta.latent.channels == VAE_CHANNELS
    vae = LatentSpec(EncoderSource(sdxl.path, "vae")).load().describe()
    assert settings.vae.weights_sha256 == vae["weights_sha256"]
    encoders = settings.text.encoders
    assert [(e.id, e.subfolder, e.class_, e.hidden_size) for e in encoders] == [
        (sdxl.path, "text_encoder", "CLIPTextModel", CLIP1_WIDTH),
        (sdxl.path, "text_encoder_2", "CLIPTextModelWithProjection", CLIP2_WIDTH),
    ]
    direct = _text([EncoderSource(sdxl.path, s) for s in ("text_encoder", "text_encoder_2")]).describe()
    assert [e.weights_sha256 for e in encoders] == [e["weights_sha256"] for e in direct["encoders"]]
    assert settings.text.layer == "penultimate" and settings.text.pooled_dim == PROJECTION_DIM
    assert [e.hidden_size for e in meta.text.encoders] == [CLIP1_WIDTH, CLIP2_WIDTH]

    records = records_by_id(out)
    tokenizers = [AutoTokenizer.from_pretrained(sdxl.path, subfolder=s) for s in ("tokenizer", "tokenizer_2")]
    expected = {key: _sdxl_embeddings(sdxl.path, c) for key, c in DATASET_CAPTIONS.items()}
    assert len(records) == 8 and {r.caption_key for r in records.values()} == set(DATASET_CAPTIONS)
    for r in records.values():
        w, h = map(int, r.bucket.split("x"))
        assert r.latent.shape == (VAE_CHANNELS, h // 8, w // 8)
        caption = DATASET_CAPTIONS[r.caption_key]
        assert r.text.lengths == tuple(len(t(caption)["input_ids"]) for t in tokenizers)  # unpadded, BOS..EOS
        tokens, pooled = expected[r.caption_key]
        for stored, want in zip(r.text.tokens, tokens):
            _bf16_close(stored, r.text.dtype, want)  # (L_i, D_i): 32 and 48 wide
        _bf16_close(r.text.pooled, r.text.dtype, pooled)  # (40,) the projection of encoder 2
    assert verify_cache(out).ok


@pytest.mark.ray
def test_reembedding_with_the_encoders_swapped_or_another_layer_is_refused(sdxl_cache):
    sdxl, manifest, out = sdxl_cache
    before = (Path(out) / "_cache.json").read_bytes()
    with pytest.raises(CacheError, match="other settings") as swapped:
        embed_cache(manifest, out, **sdxl.embed_options(order=("text_encoder_2", "text_encoder")))
    assert "text.encoders[0].subfolder: 'text_encoder' -> 'text_encoder_2'" in str(swapped.value)
    with pytest.raises(CacheError, match="text.layer: 'penultimate' -> 'last'"):
        embed_cache(manifest, out, **sdxl.embed_options(layer="last"))
    assert (Path(out) / "_cache.json").read_bytes() == before
    assert embed_cache(manifest, out, **sdxl.embed_options()).up_to_date  # the same settings: nothing to do


@pytest.mark.ray
def test_train_on_the_two_encoder_cache(sdxl_cache, tmp_path):
    from diffusers import PixArtTransformer2DModel

    from pipeline import PlanJob, run

    _, manifest, cache = sdxl_cache
    plan_url = str(tmp_path / "plan")
    run(PlanJob(manifests=(manifest,), out=plan_url, world_size=1, batch_size=2, epochs=2, cache=(cache,)))
    out = tmp_path / "out"
    config = tmp_path / "c.yaml"
    config.write_text("log_every: 1\nwarmup_steps: 1\n")
    proc = subprocess.run([sys.executable, "-m", "train", "--plan", plan_url, "--cache", cache, "--config", str(config),
                           "--output-dir", str(out), "--max-steps", "4"], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and all(np.isfinite(losses)), losses
    model = PixArtTransformer2DModel.from_pretrained(out / "model")
    # the text of both encoders is concatenated on features (train.data.collate): 32 + 48 wide
    assert model.config.caption_channels == CLIP1_WIDTH + CLIP2_WIDTH
    assert model.config.in_channels == model.config.out_channels == VAE_CHANNELS


def test_a_pipeline_folder_without_subfolders_is_refused_with_the_option_to_pass(repos):
    sdxl, _ = repos
    with pytest.raises(ValueError, match="diffusers pipeline folder: pass --text-encoder-subfolder text_encoder"):
        _text([EncoderSource(sdxl.path)])
    with pytest.raises(ValueError, match="diffusers pipeline folder: pass --vae-subfolder vae"):
        LatentSpec(EncoderSource(sdxl.path)).load()
    with pytest.raises(ValueError, match=r"no tokenizer_config.json or tokenizer.json in .*encoder\. .*tokenizer_2"):
        _text([EncoderSource(str(Path(sdxl.path) / "text_encoder"))])  # the model alone, its tokenizer elsewhere


@pytest.mark.ray
@pytest.mark.usefixtures("bucketeer_home")
def test_embed_cli_reports_an_encoder_that_fails_to_load_in_one_line(repos, tmp_path, capsys, ray_local):
    """The encoder loads inside a Ray actor; its error must reach the user as one line, exit 2."""
    from pipeline.cli import main

    sdxl, _ = repos
    manifest, out = str(tmp_path / "manifest"), str(tmp_path / "cache")
    make_dataset(str(tmp_path / "data"), manifest, 2)
    assert main(["embed", manifest, "--out", out, "--text-encoder", sdxl.path]) == 2
    err = capsys.readouterr().err
    assert "an encoder failed to load" in err and "pass --text-encoder-subfolder text_encoder" in err
    assert "Traceback" not in err and "ActorDiedError" not in err
