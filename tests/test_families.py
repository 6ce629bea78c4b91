"""Model families: the cached text equals what each family's diffusers pipeline computes in ``encode_prompt``.

Tiny random-weight models of each family's real classes (:mod:`pipeline.embed.families.tiny`,
saved as diffusers folders and loaded through ``from_pretrained``) are encoded in process, where
the point is exactness: the cache's parts, joined by the cache's ``text.layout``, equal the
pipeline's prompt embeddings (and pooled, and mask) bit for bit in fp32, and the bf16 records equal
them rounded to bf16. A real embed job (Ray) checks the options, ``_cache.json`` and the records
end to end, and the existing trainer trains on that PixArt-family cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from manifests.cache import CacheError, CacheReader, TextLayout, read_cache_meta, read_index
from manifests.cache.records import SampleRecord, TextRecord, caption_key, decode_sample, encode_sample, to_float32
from manifests.cache.verify import verify_cache
from manifests.errors import UsageError
from pipeline.embed.loading import quiet_loading, to_storage
from pipeline.embed.latents import LatentSpec
from pipeline.embed.encoders import encoder_specs
from pipeline.embed.families.tiny import CLIP_G, CLIP_G_PROJECTION, CLIP_L, CLIP_L_PROJECTION, T5_WIDTH, build_tiny
from tests.embed_data import embed_cache, make_dataset, records_by_id

FAMILIES = ("sdxl", "sd3", "flux", "pixart")
# empty, long (past CLIP's 77 and T5's 512 tokens: truncated), unicode, upper case and spaces (PixArt lowers)
CAPTIONS = ["a photo of the cat", "", "red dog " * 300, "  The RED Dog, naïve café 漢字 🙂  ", "thing 0"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    """The tiny diffusers folder of every family, plus ``pixart-sigma`` (a PixArtSigmaPipeline)."""
    quiet_loading()
    base = tmp_path_factory.mktemp("tiny-families")
    folders = {f: str(build_tiny(f, base / f)) for f in FAMILIES}
    folders["pixart-sigma"] = str(build_tiny("pixart", base / "pixart-sigma", variant="sigma"))
    return folders


def _text(family: str, model: str, **options):
    """The family's text encoders as the embed job loads them: from the specs of ``--family --model``."""
    _, spec = encoder_specs(family=family, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None, **options)  # fmt: skip
    return spec.load()


def _reference(family: str, model: str, captions: list[str], max_tokens: int | None = None):
    """``(prompt_embeds, mask or None, pooled or None)`` from the family's own diffusers pipeline."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model)
    length = {} if max_tokens is None else {"max_sequence_length": max_tokens}
    with torch.no_grad():
        if family == "sdxl":
            embeds, _, pooled, _ = pipe.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False)
            return embeds, None, pooled
        if family == "sd3":
            embeds, _, pooled, _ = pipe.encode_prompt(captions, None, None, device="cpu",
                                                      do_classifier_free_guidance=False, **length)  # fmt: skip
            return embeds, None, pooled
        if family == "flux":
            embeds, pooled, _ = pipe.encode_prompt(captions, device="cpu", **length)
            return embeds, None, pooled
        embeds, mask, _, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, device="cpu", **length)
        return embeds, mask, None


def _records(encoded, dtype: str) -> list[TextRecord]:
    """The encoder's output as the text worker stores it (``dtype`` a storage tag)."""
    return [TextRecord(i, tuple(to_storage(t, dtype) for t in tokens), None if p is None else to_storage(p, dtype),
                       dtype) for i, (tokens, p) in enumerate(encoded)]  # fmt: skip


def _assert_joined_equal(layout: TextLayout, records, reference, cast=lambda t: t) -> None:
    """The records joined by ``layout`` equal ``reference`` (after ``cast``) exactly; masked rows only."""
    ref_embeds, ref_mask, ref_pooled = reference
    embeds, mask, pooled = layout.prompt_embeds(records, pad_to=layout.length if layout.masked else None)
    want = cast(ref_embeds).numpy()
    assert embeds.shape == want.shape
    if ref_mask is None:
        assert mask.all() and np.array_equal(embeds, want)
    else:  # masked (PixArt): the pad rows never reach the model; the mask and the real rows must match
        assert np.array_equal(mask, ref_mask.numpy().astype(np.float32))
        keep = ref_mask.numpy().astype(bool)
        assert np.array_equal(embeds[keep], want[keep]) and not embeds[~keep].any()
    if ref_pooled is None:
        assert pooled is None
    else:
        assert np.array_equal(pooled, cast(ref_pooled).numpy())


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_text_equals_the_pipelines_encode_prompt(tiny, family):
    encoders = _text(family, tiny[family])
    info = encoders.describe()
    layout = TextLayout.from_json(info["layout"])
    encoded = encoders.encode(CAPTIONS)
    reference = _reference(family, tiny[family], CAPTIONS)
    _assert_joined_equal(layout, _records(encoded, "F32"), reference)  # fp32: bit for bit
    _assert_joined_equal(layout, _records(encoded, "BF16"), reference, cast=_bf16)  # bf16: one rounding, no more
    expected = {  # (lengths, widths, pooled) of each family's parts, from the tiny models' sizes
        "sdxl": ((77, 77), (CLIP_L, CLIP_G), CLIP_G_PROJECTION),
        "sd3": ((77, 77, 256), (CLIP_L, CLIP_G, T5_WIDTH), CLIP_L_PROJECTION + CLIP_G_PROJECTION),
        "flux": ((512,), (T5_WIDTH,), CLIP_L),
        "pixart": ((120,), (T5_WIDTH,), None),
    }[family]
    assert (layout.lengths, layout.widths, layout.pooled_dim) == expected
    assert info["family"] == family and info["pipeline"] == json.loads(
        (Path(tiny[family]) / "model_index.json").read_text())["_class_name"]
    if family == "pixart":  # only the real tokens are stored: the empty caption is T5's "</s>" alone
        assert [t[0].shape[0] for t, _ in encoded][1] == 1 and encoded[2][0][0].shape[0] == 120
    else:  # every position is stored, the pads included: they are computed states the model attends to
        assert all(t.shape[0] == n for tokens, _ in encoded for t, n in zip(tokens, layout.lengths))


@pytest.mark.parametrize("family", ["sd3", "flux", "pixart"])
def test_max_text_tokens_lowers_the_t5_length_as_max_sequence_length_does(tiny, family):
    encoders = _text(family, tiny[family], max_tokens=8)
    layout = TextLayout.from_json(encoders.describe()["layout"])
    assert layout.lengths[-1] == 8 and encoders.describe()["max_tokens"] == 8
    encoded = encoders.encode(CAPTIONS)
    _assert_joined_equal(layout, _records(encoded, "F32"), _reference(family, tiny[family], CAPTIONS, max_tokens=8))
    with pytest.raises(UsageError, match="--max-text-tokens 1000 is above .* it can only be lowered"):
        _text(family, tiny[family], max_tokens=1000)


def test_family_defaults_and_refusals(tiny):
    assert _text("pixart", tiny["pixart-sigma"]).describe()["max_tokens"] == 300  # sigma's default, from model_index
    # the family's encoders named one by one (no --model) encode as the model folder's do
    _, named = encoder_specs(family="sdxl", model=None, vae="v", vae_subfolder=None, text_encoders=[tiny["sdxl"]] * 2,
                             text_subfolders=["text_encoder", "text_encoder_2"])  # fmt: skip
    for (tokens, pooled), (want, want_pooled) in zip(named.load().encode(CAPTIONS), _text("sdxl", tiny["sdxl"]).encode(
            CAPTIONS)):  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(tokens, want)) and torch.equal(pooled, want_pooled)
    with pytest.raises(UsageError, match="--max-text-tokens does not apply to --family sdxl"):
        _text("sdxl", tiny["sdxl"], max_tokens=20)
    with pytest.raises(UsageError, match="says StableDiffusion3Pipeline, not a sdxl pipeline; pass --family sd3"):
        _text("sdxl", tiny["sd3"])
    # SD3 pools CLIP-L's projection: SDXL's CLIP-L has none, and would load with random projection weights
    with pytest.raises(UsageError, match="lacks weights of a CLIPTextModelWithProjection .*text_projection"):
        encoder_specs(family="sd3", model=tiny["sd3"], vae=None, vae_subfolder=None,
                      text_encoders=[tiny["sdxl"], tiny["sd3"], tiny["sd3"]],
                      text_subfolders=["text_encoder", "text_encoder_2", "text_encoder_3"])[1].load()  # fmt: skip


@pytest.mark.parametrize(
    "options, message",
    [
        ({"model": "x"}, "--model needs --family"),
        ({"family": "sd3", "model": "x", "layer": "last"}, "--text-layer is for encoders without a --family"),
        ({"family": "sd3"}, "--family sd3 needs --model .* or --vae and 3 --text-encoder options"),
        ({"family": "flux", "model": "x", "text_encoders": ["t5"]}, "--family flux has 2 text encoders"),
        ({"family": "pixart", "model": "x", "max_tokens": 0}, "--max-text-tokens must be >= 1"),
        ({"text_encoders": ["a"], "text_subfolders": ["x", "y"]}, "2 --text-encoder-subfolder options for 1"),
    ],
)
def test_encoder_options_that_do_not_go_together_are_refused(options, message):
    args = {"family": None, "model": None, "vae": None, "vae_subfolder": None, "text_encoders": None,
            "text_subfolders": None, **options}  # fmt: skip
    with pytest.raises(UsageError, match=message):
        encoder_specs(**args)


def test_model_subfolders_and_explicit_replacements():
    latent, text = encoder_specs(family="sdxl", model="org/sdxl", vae="org/vae-fix", vae_subfolder=None,
                                 text_encoders=None, text_subfolders=None)  # fmt: skip
    assert (latent.source.source, latent.source.subfolder) == ("org/vae-fix", None)  # --vae replaces the model's
    assert [(s.source, s.subfolder) for s in text.sources] == [("org/sdxl", "text_encoder"),
                                                               ("org/sdxl", "text_encoder_2")]  # fmt: skip
    latent, text = encoder_specs(family="flux", model=None, vae="v", vae_subfolder="vae", text_encoders=["c", "t"],
                                 text_subfolders=None, latents="posterior")  # fmt: skip
    assert (latent.latents, [s.source for s in text.sources], text.model) == ("posterior", ["c", "t"], None)


def test_posterior_std_is_the_vaes_and_round_trips_in_the_record(tiny):
    from diffusers import AutoencoderKL

    encoder = LatentSpec(encoder_specs(family="flux", model=tiny["flux"], vae=None, vae_subfolder=None,
                                       text_encoders=None, text_subfolders=None)[0].source, "posterior").load()
    pixels = np.random.default_rng(0).integers(0, 255, (2, 32, 48, 3), dtype=np.uint8)
    out = encoder.encode(pixels)
    vae = AutoencoderKL.from_pretrained(tiny["flux"], subfolder="vae")
    with torch.no_grad():
        dist = vae.encode(torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1.0).latent_dist
    assert torch.equal(out["latent"], dist.mean) and torch.equal(out["latent_std"], dist.std)
    assert out["latent"].shape == (2, 16, 4, 6) and encoder.describe()["latents"] == "posterior"
    mean, std = to_storage(out["latent"][0], "BF16"), to_storage(out["latent_std"][0], "BF16")
    record = SampleRecord(7, "48x32", mean, "BF16", (32, 48), (32, 48), (0, 0), (32, 48), 1, latent_std=std)
    back = decode_sample(encode_sample(record))
    assert np.array_equal(back.latent_std, std) and np.array_equal(back.latent, mean)
    assert decode_sample(encode_sample(SampleRecord(7, "48x32", mean, "BF16", (32, 48), (32, 48), (0, 0), (32, 48),
                                                    1))).latent_std is None  # fmt: skip


def test_text_layout_checks_what_records_hold():
    sd3 = TextLayout("sd3", "sequence", False, (4, 4, 6), (2, 3, 8), pooled_dim=5)
    part = lambda n, d: np.ones((n, d), np.float32)  # noqa: E731
    good = TextRecord(1, (part(4, 2), part(4, 3), part(6, 8)), np.ones(5, np.float32), "F32")
    assert sd3.check(good) is None and (sd3.length, sd3.width) == (10, 8)
    embeds, mask, pooled = sd3.prompt_embeds([good])
    assert embeds.shape == (1, 10, 8) and mask.all() and pooled.shape == (1, 5)
    assert embeds[0, :4, :5].all() and not embeds[0, :4, 5:].any() and embeds[0, 4:].all()  # CLIPs zero-padded
    wide = TextRecord(1, (part(4, 3), part(4, 3), part(6, 8)), np.ones(5), "F32")
    assert "part 0 is 3 wide, the layout says 2" in sd3.check(wide)
    assert "has 5 rows, the layout says 6" in sd3.check(TextRecord(1, (part(4, 2), part(4, 3), part(5, 8)),
                                                                   np.ones(5), "F32"))  # fmt: skip
    assert "pooled shape None" in sd3.check(TextRecord(1, good.tokens, None, "F32"))
    pixart = TextLayout("pixart", "features", True, (6,), (8,))
    assert pixart.check(TextRecord(1, (part(3, 8),), None, "F32")) is None  # masked: fewer rows are fine
    assert "at most 6" in pixart.check(TextRecord(1, (part(7, 8),), None, "F32"))
    assert TextLayout.from_json(sd3.to_json()) == sd3
    with pytest.raises(UsageError, match="text.layout is malformed"):
        TextLayout.from_json({"family": "x", "join": "diagonal", "masked": False, "lengths": [1], "widths": [1]})


def test_validation_prompts_file(tmp_path):
    from pipeline.embed.prompts import read_validation_prompts

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("  a red cat \n\nnaïve café\na red cat\n")
    assert read_validation_prompts(str(prompts)) == [{"prompt": "a red cat", "caption_key": caption_key("a red cat")},
                                                     {"prompt": "naïve café", "caption_key": caption_key("naïve café")}]
    prompts.write_text("\n  \n")
    with pytest.raises(UsageError, match="has no prompt"):
        read_validation_prompts(str(prompts))
    with pytest.raises(UsageError, match="no such file"):
        read_validation_prompts(str(tmp_path / "nope.txt"))


def test_a_cache_of_the_previous_format_is_refused(tmp_path):
    (tmp_path / "_cache.json").write_text(json.dumps({"kind": "bucketeer.cache", "format_version": 1}))
    with pytest.raises(CacheError, match="format version 1; this bucketeer reads version 2. .*--family"):
        read_cache_meta(str(tmp_path))


# ---- the embed job on real Ray ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pixart_cache(tiny, tmp_path_factory, ray_local):
    """6 images embedded as PixArt from the tiny PixArt folder (its VAE named explicitly), 16 T5
    tokens, posterior latents, two validation prompts."""
    base = tmp_path_factory.mktemp("pixart-embed")
    manifest, out, prompts = str(base / "manifest"), str(base / "cache"), base / "prompts.txt"
    make_dataset(str(base / "data"), manifest, 6)
    prompts.write_text("a red cat\n\n  a blue dog  \na red cat\n")
    options = {"family": "pixart", "model": tiny["pixart"], "vae": str(Path(tiny["pixart"]) / "vae"),
               "max_text_tokens": 16, "latents": "posterior"}  # fmt: skip
    embed_cache(manifest, out, **options, validation_prompts=str(prompts))
    return manifest, out, options


@pytest.mark.ray
@pytest.mark.slow
def test_embed_a_family_from_one_model_folder(tiny, pixart_cache, capsys):
    manifest, out, options = pixart_cache
    meta = read_cache_meta(out)
    assert meta.family == meta.settings.family == meta.text.family == "pixart"
    assert meta.settings.vae.id == str(Path(tiny["pixart"]) / "vae")
    assert meta.settings.text.encoders[0].subfolder == "text_encoder"
    layout = meta.text_layout
    assert layout.lengths == (16,) and layout.masked and meta.latent.kind == "posterior_mean_std"
    prompts = meta.text.validation_prompts
    assert [(p.prompt, p.caption_key) for p in prompts] == [(p, caption_key(p)) for p in ("a red cat", "a blue dog")]
    # every caption, the empty one (caption dropout) and the validation prompts have a text record
    texts = read_index(out)["texts"].column("caption_key").to_numpy().tolist()
    captions = {caption_key(c): c for c in ("", "a red cat", "a blue dog", *(f"a photo of thing {i}" for i in "012"))}
    assert set(texts) == set(captions) and meta.text.empty_caption_key == caption_key("")
    index = read_index(out)["texts"]  # a caption only one sample has lives in that sample's record
    separate = [s.startswith("shards/texts-") for s in index.column("shard").to_pylist()]
    assert 0 < sum(separate) < len(texts) and meta.bytes.per_caption == round(meta.bytes.texts / sum(separate)) > 0
    assert meta.summary.bytes_per_sample == meta.bytes.per_sample > 0

    stored = dict(zip(captions, CacheReader(out).read_texts(list(captions))))
    encoded = dict(zip(captions, _text("pixart", tiny["pixart"], max_tokens=16).encode(list(captions.values()))))
    for key, record in stored.items():
        assert layout.check(record) is None and record.dtype == "BF16" and record.caption_key == key
        (part,), _ = encoded[key]
        np.testing.assert_allclose(to_float32(record.tokens[0], "BF16"), part.numpy(), rtol=2**-7, atol=1e-6)
    records = records_by_id(out)
    assert all(r.latent_std is not None and r.latent_std.shape == r.latent.shape for r in records.values())
    assert verify_cache(out).ok

    # a rerun with new validation prompts embeds those only; another family is refused
    capsys.readouterr()
    more = Path(out).parent / "more.txt"
    more.write_text("a red cat\nthe picture\n")
    embed_cache(manifest, out, **options, validation_prompts=str(more))
    again = read_cache_meta(out)
    assert [p.prompt for p in again.text.validation_prompts] == ["a red cat", "the picture"]
    assert again.counts.texts == len(texts) + 1 and again.counts.samples == 6
    assert "1 new captions" in capsys.readouterr().out
    before = (Path(out) / "_cache.json").read_bytes()
    with pytest.raises(CacheError, match="family: 'pixart' -> 'flux'"):
        embed_cache(manifest, out, family="flux", model=tiny["flux"])
    assert (Path(out) / "_cache.json").read_bytes() == before


@pytest.mark.ray
@pytest.mark.slow
def test_train_on_a_pixart_family_cache(pixart_cache, tmp_path):
    """The PixArt family (real tokens, masked) trains through the existing trainer's collate."""
    from diffusers import PixArtTransformer2DModel

    from pipeline import PlanJob, run

    manifest, cache, _ = pixart_cache
    plan_url = str(tmp_path / "plan")
    run(PlanJob(manifests=(manifest,), out=plan_url, world_size=1, batch_size=2, epochs=2, cache=(cache,)))
    out, config = tmp_path / "out", tmp_path / "c.yaml"
    config.write_text("log_every: 1\nwarmup_steps: 1\n")
    proc = subprocess.run([sys.executable, "-m", "train", "--plan", plan_url, "--cache", cache, "--config", str(config),
                           "--output-dir", str(out), "--max-steps", "3"], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    if len(os.sched_getaffinity(0)) >= 2:  # python -m train, a local cache: the default reads in processes
        assert "loader: read_processes: auto -> 2 processes (a local cache;" in proc.stdout, proc.stdout[-2000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(np.isfinite(losses)), losses
    model = PixArtTransformer2DModel.from_pretrained(out / "model")
    assert model.config.caption_channels == T5_WIDTH and model.config.in_channels == 4
