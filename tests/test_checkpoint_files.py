"""Exact for the files real checkpoints ship: their tokenizers, chat templates and configs (tests/fixtures/checkpoints).

Per family, the tiny random-weight pipeline is rebuilt around the real checkpoint's tokenizer files
(:func:`tests.checkpoints.real_files_pipeline`: the files verbatim, the classes its ``model_index.json`` names, each
text encoder's vocabulary resized to the real one) and saved; bucketeer loads it as ``embed --model`` does and
diffusers as ``DiffusionPipeline.from_pretrained`` does. On captions chosen to break tokenizers
(:data:`tests.checkpoint_text.HARD_CAPTIONS`: empty, one word, 2,000 words, emoji and combining marks, right-to-left
scripts, the templates' own special tokens, trailing whitespace), the token ids and masks each text encoder is
called with are the pipeline's, and the cached text is ``encode_prompt``'s, bit for bit in fp32.

FLUX.2-dev (a ``PixtralProcessor``) and Qwen-Image-Edit (a ``Qwen2VLProcessor``) load processors that need
torchvision: ``tests/test_qwen2vl_vision.py`` runs theirs in a venv that has it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.embed.encoders import encoder_specs
from pipeline.embed.families import get_family
from pipeline.embed.families.tiny import build_tiny
from pipeline.embed.loading import quiet_loading
from tests import checkpoints
from tests.checkpoint_text import HARD_CAPTIONS, pipeline_text, recorded_inputs, sequences

VISION = ("flux2", "qwen-image-edit")  # their pipelines load a processor that needs torchvision
FAMILIES = [f for f in checkpoints.families() if f not in VISION and (checkpoints.ROOT / f / "tokenizer").is_dir()]
NO_FIXTURES = ["wan", "wan2.2-a14b", "wan2.2-ti2v-5b"]  # UMT5's tokenizer: in no reachable copy (the README)
BUDGET = 20 * 1024 * 1024  # bytes committed under tests/fixtures/checkpoints


def test_every_fixture_file_is_recorded_with_its_source_and_unpacks_to_its_hash():
    total = sum(p.stat().st_size for p in checkpoints.ROOT.rglob("*") if p.is_file())
    assert 0 < total <= BUDGET, f"{total} bytes of checkpoint fixtures; the budget is {BUDGET}"
    used = set()
    for family in checkpoints.families():
        sources = (checkpoints.ROOT / family / "SOURCES.md").read_text()
        assert sources.startswith(f"# {family}: "), family
        for rel, pointer in checkpoints.files(family).items():
            assert re.search(rf"\|\s*`?{re.escape(rel)}[`\s(|]", sources), f"{family}/{rel} is not in SOURCES.md"
            data = checkpoints.read(pointer)  # a blob is checked against its recorded sha256 here
            if pointer.suffix == ".blob":
                used.add(json.loads(pointer.read_text())["blob"])
            assert hashlib.sha256(data).hexdigest()[:16] in sources, f"{family}/{rel}: its sha256 is not recorded"
    assert used == {p.name for p in checkpoints.BLOBS.iterdir()}, "a blob no family points to"


@pytest.fixture(scope="module")
def real_folders(tmp_path_factory):
    quiet_loading()
    base = tmp_path_factory.mktemp("real-files")
    built: dict[str, str] = {}

    def folder(family: str) -> str:
        if family not in built:
            built[family] = str(checkpoints.real_files_pipeline(family, base / family) if family in FAMILIES else
                                build_tiny(family, base / family))  # no fixtures (the Wan families): the stand-in
        return built[family]

    return folder


def _load(family: str, model: str):
    from diffusers import DiffusionPipeline

    _, spec = encoder_specs(family=family, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None)  # fmt: skip
    return spec.load(dtype="F32"), DiffusionPipeline.from_pretrained(model)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_token_ids_and_cached_text_equal_the_pipelines_with_the_real_tokenizers(real_folders, family):
    encoders, pipe = _load(family, real_folders(family))
    ours = [m.model for m in encoders.models]
    theirs = [getattr(pipe, sub) for sub in get_family(family).text_encoders]
    with recorded_inputs(ours) as our_calls:
        encoded = encoders.encode(HARD_CAPTIONS)
    with recorded_inputs(theirs) as their_calls:
        want = pipeline_text(family, pipe, HARD_CAPTIONS, tuple(encoders.layout.widths))
    for k, (a, b) in enumerate(zip(our_calls, their_calls)):
        # in any order: bucketeer groups captions by token count (Qwen), a pipeline may call per caption
        ids, ref = sorted(sequences(a)), sorted(sequences(b))
        assert ref, f"{family}: the pipeline's text encoder {k} was called on nothing"
        assert ids == ref, f"{family}: text encoder {k} is fed other token ids than the pipeline's"
    for caption, (tokens, pooled), (parts, ref_pooled) in zip(HARD_CAPTIONS, encoded, want):
        assert len(tokens) == len(parts)
        for t, p in zip(tokens, parts):
            assert t.shape == p.shape and torch.equal(t, p.float()), (family, caption[:40])  # fp32, bit for bit
        assert (pooled is None) == (ref_pooled is None)
        assert pooled is None or torch.equal(pooled, ref_pooled.float()), (family, caption[:40])
    # what `bucketeer estimate` counts, with no weight read: the same rows per caption and part
    _, spec = encoder_specs(family=family, model=real_folders(family), vae=None, vae_subfolder=None,
                            text_encoders=None, text_subfolders=None)  # fmt: skip
    shapes = spec.load(weights=False)
    assert shapes.layout == encoders.layout
    assert shapes.rows(HARD_CAPTIONS) == [tuple(t.shape[0] for t in tokens) for tokens, _ in encoded]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES + NO_FIXTURES)
def test_bf16_text_equals_the_pipelines_bf16_encode_prompt(real_folders, family):
    """The GPU's path (weights and compute in bf16; ``compute="BF16"`` runs it on this CPU) against the pipeline
    loaded with ``dtype=torch.bfloat16``: equal bit for bit, the tolerance stated in docs/embed.md being zero. (A
    text encoder cast with ``.to(bfloat16)`` instead of loaded in it casts RoPE's ``inv_freq`` too: every LLM
    family's bf16 text differed from the pipeline's until the encoders were loaded as the pipeline loads them.)"""
    from diffusers import DiffusionPipeline

    model = real_folders(family)
    _, spec = encoder_specs(family=family, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None)  # fmt: skip
    encoders = spec.load(dtype="BF16", compute="BF16")
    assert all(next(m.model.parameters()).dtype == torch.bfloat16 for m in encoders.models)
    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch.bfloat16)
    encoded = encoders.encode(HARD_CAPTIONS)
    want = pipeline_text(family, pipe, HARD_CAPTIONS, tuple(encoders.layout.widths))
    for caption, (tokens, pooled), (parts, ref_pooled) in zip(HARD_CAPTIONS, encoded, want):
        for t, p in zip(tokens, parts):
            assert t.shape == p.shape and torch.equal(t, p.float()), (family, caption[:40])
        assert pooled is None or torch.equal(pooled, ref_pooled.float()), (family, caption[:40])


def _vae_reference(family: str, model: str, pixels, dtype):
    """The pipeline's VAE path for ``pixels`` ``(B, H, W, 3)`` uint8 in ``dtype``: the posterior mean (SDXL, SD3,
    Flux, PixArt, Chroma, Z-Image: stored unscaled), Qwen-Image's normalised mode, Flux 2's patchified and batch-norm
    normalised mean, each from the VAE loaded with ``torch_dtype=dtype``."""
    from types import SimpleNamespace

    import diffusers
    from diffusers import Flux2Pipeline, QwenImageEditPipeline

    index = json.loads((Path(model) / "model_index.json").read_text())
    vae = getattr(diffusers, index["vae"][1]).from_pretrained(model, subfolder="vae", torch_dtype=dtype).eval()
    x = (torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1.0).to(dtype)
    with torch.no_grad():
        if family in ("qwen-image", "qwen-image-edit"):
            return QwenImageEditPipeline._encode_vae_image(SimpleNamespace(vae=vae, latent_channels=16),
                                                           x.unsqueeze(2), None)[:, :, 0]  # fmt: skip
        if family in ("flux2", "flux2-klein"):
            pipe = Flux2Pipeline(scheduler=None, vae=vae, text_encoder=None, tokenizer=None, transformer=None)
            return pipe._encode_vae_image(x, generator=None)
        return vae.encode(x).latent_dist.mean


IMAGE_VAE_FAMILIES = ["sdxl", "sd3", "flux", "pixart", "chroma", "z-image", "qwen-image", "flux2-klein"]


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in IMAGE_VAE_FAMILIES if f in FAMILIES])
def test_bf16_latents_equal_the_pipelines_bf16_vae_path(real_folders, family):
    from pipeline.embed.latents import LatentSpec

    model = real_folders(family)
    latent, _ = encoder_specs(family=family, model=model, vae=None, vae_subfolder=None, text_encoders=None,
                              text_subfolders=None)  # fmt: skip
    pixels = np.random.default_rng(0).integers(0, 256, (2, 64, 96, 3), dtype=np.uint8)
    for compute, dtype in (("F32", torch.float32), ("BF16", torch.bfloat16)):
        encoder = LatentSpec(latent.source).load(dtype=compute, compute=compute)
        got = encoder.encode(pixels)["latent"]
        want = _vae_reference(family, model, pixels, dtype).float()
        assert got.shape == want.shape, (family, compute)
        if family == "flux2-klein" and compute == "BF16":
            # Flux2Pipeline normalises by the batch-norm statistics in bf16; bucketeer in fp32, rounding once: the
            # stated tolerance is one bf16 ulp of the value (2^-7 relative)
            assert bool(((got.float() - want).abs() <= 2**-7 * want.abs()).all()) and not torch.equal(got, want)
        else:
            assert torch.equal(got.float(), want), (family, compute)


# what the recipes and the latent normalisation read from the scheduler's and the VAE's configs
SCHEDULER_KEYS = ("shift", "flow_shift", "use_dynamic_shifting", "base_shift", "max_shift", "base_image_seq_len",
                  "max_image_seq_len", "time_shift_type", "shift_terminal", "prediction_type", "num_train_timesteps",
                  "beta_schedule", "beta_start", "beta_end", "timestep_spacing", "steps_offset", "use_flow_sigmas",
                  "use_karras_sigmas", "use_beta_sigmas", "use_exponential_sigmas", "invert_sigmas")  # fmt: skip
# (latent_channels / z_dim are sizes a tiny model may shrink: per-channel statistics are compared where they agree)
VAE_KEYS = ("scaling_factor", "shift_factor", "latents_mean", "latents_std", "batch_norm_eps", "patch_size",
            "spatial_compression_ratio", "temporal_compression_ratio")  # fmt: skip


def _config(family: str, rel: str) -> dict | None:
    found = checkpoints.files(family).get(rel)
    return None if found is None else json.loads(checkpoints.read(found))


@pytest.mark.parametrize("family", [f for f in checkpoints.families()
                                    if _config(f, "model_index.json") or _config(f, "scheduler/scheduler_config.json")])
def test_the_real_configs_are_what_the_recipes_and_the_tiny_models_read(family):
    """The real ``model_index.json`` is taken as this family's folder; the scheduler settings the recipes shift by
    and the VAE's latent normalisation equal the real checkpoint's in the tiny stand-ins every recipe test runs
    on, so those tests hold for the real checkpoint."""
    from pipeline.embed.families import family_of_pipeline, tiny_ltx2
    from pipeline.embed.families.tiny import tiny_pipeline

    if family == "ltx-2" and not tiny_ltx2.connectors_supported():
        pytest.skip("LTX-2's tiny pipeline needs the text connectors of a newer diffusers")

    index = _config(family, "model_index.json")
    kind = get_family(family).kind_of
    if index is not None:
        assert (kind(index) if kind else family_of_pipeline(index["_class_name"])) == family
    pipe = tiny_pipeline(family)
    for rel, component, keys in (("scheduler/scheduler_config.json", "scheduler", SCHEDULER_KEYS),
                                 ("vae/config.json", "vae", VAE_KEYS)):  # fmt: skip
        real = _config(family, rel)
        if real is None:
            continue
        tiny = pipe.components[component]
        assert type(tiny).__name__ == real["_class_name"], (family, component)
        tiny_config = json.loads(json.dumps(dict(tiny.config)))  # tuples as the lists JSON has
        channels = [c.get("latent_channels", c.get("z_dim")) for c in (real, tiny_config)]
        skip = {"latents_mean", "latents_std"} if channels[0] != channels[1] else set()
        differ = {k: (real[k], tiny_config.get(k)) for k in keys
                  if k in real and k not in skip and real[k] != tiny_config.get(k)}  # fmt: skip
        assert not differ, f"{family} {component}: real vs tiny {differ}"


def _agree(published: dict, real: dict, where: str) -> list[str]:
    """The keys of ``published`` whose value differs from ``real``'s (nested dicts compared key by key)."""
    out = []
    for key, value in published.items():
        if key not in real:
            continue
        if isinstance(value, dict) and isinstance(real[key], dict):
            out += _agree(value, real[key], f"{where}.{key}")
        elif json.loads(json.dumps(value)) != real[key]:
            out.append(f"{where}.{key}: {value!r} here, {real[key]!r} in the checkpoint")
    return out


@pytest.mark.parametrize("name, family, rel", [
    ("SDXL_VAE", "sdxl", "vae/config.json"), ("FLUX1_VAE", "flux", "vae/config.json"),
    ("T5_XXL", "flux", "text_encoder_2/config.json"), ("QWEN_VL_7B", "qwen-image", "text_encoder/config.json"),
    ("QWEN3_4B", "z-image", "text_encoder/config.json"), ("QWEN_IMAGE", "qwen-image", "transformer/config.json"),
    ("Z_IMAGE", "z-image", "transformer/config.json"),
])  # fmt: skip
def test_the_benchmarks_published_sizes_are_the_real_configs(name, family, rel):
    """``benchmarks/real_configs.py`` (bytes per caption, memory at real size, the GPU check's models) wrote the
    published configs by hand: every value it names is the real checkpoint's."""
    from benchmarks import real_configs

    real = _config(family, rel)
    assert real is not None, f"{family}/{rel} is not among the fixtures"
    assert _agree(getattr(real_configs, name), real, name) == []
