"""The ``flux2``, ``flux2-klein`` and ``chroma`` recipes in the one loop, on tiny random pipelines.

A module fixture embeds 6 images per family (in this process, text at 16 tokens, two validation prompts) and
plans them. One batch's loss equals a hand computation from the cached records (packing and position ids
written out, the shift by its formula, the generator's draws in order); the shift of a bucket is the one
the family's pipeline samples it with; a LoRA run's export loads with the pipeline's ``load_lora_weights``
and gives the trained transformer's outputs; two steps resumed after one equal two straight, and the full
fine-tune's ``model/`` loads into the pipeline as printed and generates (validation images on the way).
"""

from __future__ import annotations

import json
import functools
import math
from typing import Any

import numpy as np
import pytest
import torch

from manifests.cache import CacheReader
from manifests.cache.records import to_float32
from tests.train_dataset import logged_losses, printed_code, recipe_outputs, train_quiet, write_settings
from train.config import TrainConfig
from train.data import BatchLoader, rank_steps

FAMILIES = ("flux2", "flux2-klein", "chroma")
TOKENS = 16  # --max-text-tokens: the pipelines take prompt_embeds of any length


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, dict[str, str]]:
    from pipeline import PlanJob, run
    from pipeline.embed.loading import quiet_loading
    from pipeline.embed.families.tiny import build_tiny
    from tests.embed_data import embed_cache, make_dataset

    quiet_loading()
    base = tmp_path_factory.mktemp("train-flux2")
    manifest, prompts = str(base / "manifest"), base / "prompts.txt"
    make_dataset(str(base / "data"), manifest, 6)  # buckets 64x64 (4 images), 128x32, 32x128
    prompts.write_text("a red cat\na blue dog\n")
    out = {}
    for family in FAMILIES:
        model, cache, plan = str(build_tiny(family, base / family)), str(base / f"cache-{family}"), \
            str(base / f"plan-{family}")  # fmt: skip
        embed_cache(manifest, cache, family=family, model=model, validation_prompts=str(prompts), executor="local",
                    max_text_tokens=TOKENS)  # fmt: skip
        run(PlanJob(manifests=(manifest,), out=plan, world_size=1, batch_size=2, epochs=3, cache=(cache,),
                    leftover="pad"))  # fmt: skip
        out[family] = {"model": model, "cache": cache, "plan": plan}
    return out


def _batch(f: dict[str, str]):
    reader = CacheReader(f["cache"])
    return reader, next(iter(BatchLoader(reader, list(rank_steps(f["plan"], 0)), reader.meta.latent)))


def _denoiser(reader: CacheReader, **cfg):
    from train.recipes import recipe_for

    config = TrainConfig(**cfg)
    return recipe_for(config, reader.meta).setup(config, reader.meta)


def _empirical_mu(tokens: int, steps: int = 50) -> float:
    """Flux 2's ``compute_empirical_mu``, written out."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if tokens > 4300:
        return a2 * tokens + b2
    m200, m10 = a2 * tokens + b2, a1 * tokens + b1
    a = (m200 - m10) / 190.0
    return a * steps + m200 - 200.0 * a


def _flux_mu(tokens: int) -> float:
    """FLUX.1's ``calculate_shift`` at the scheduler's defaults (256 -> 0.5, 4096 -> 1.15), written out."""
    return 0.5 + (1.15 - 0.5) * (tokens - 256) / (4096 - 256)


def _ids(*sizes: int) -> torch.Tensor:
    """``(prod(sizes), len(sizes))``: every index tuple of a grid of ``sizes``, the last axis fastest (int64)."""
    grids = torch.meshgrid(*(torch.arange(n) for n in sizes), indexing="ij")
    return torch.stack(grids, dim=-1).reshape(-1, len(sizes))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_loss_of_one_batch_equals_a_hand_computation(families, family):
    """x0 from the records; u = sigmoid(N(0, 1)) then eps, drawn in that order from the step's generator; sigma
    = s u / (1 + (s - 1) u), s = exp(mu) of the bucket's tokens; the transformer fed the packed (1 - sigma) x0 +
    sigma eps with the pipeline's position ids (Flux 2: (t, y, x, l) and (0, 0, 0, l); Chroma: (0, y, x) and
    zeros), the cached text (Chroma: its float mask then ones), guidance 3.5 for FLUX.2-dev; the loss the mean
    squared error to the packed eps - x0."""
    from train.model import step_generator

    reader, batch = _batch(families[family])
    denoiser = _denoiser(reader)
    with torch.no_grad():
        loss = denoiser.loss(denoiser.model, batch, step_generator(0, batch.epoch, batch.step, 0))

    latent = reader.meta.latent
    records = [r.variant(v) for r, v in zip(reader.read(batch.sample_ids), batch.variants)]
    z = torch.from_numpy(np.stack([to_float32(r.latent, r.dtype) for r in records]))
    x0 = (z - (latent.shift_factor or 0.0)) * latent.scaling_factor  # Flux 2: stored as the denoiser sees it
    b, c, h, w = x0.shape
    text = torch.from_numpy(np.stack([to_float32(r.text.tokens[0], r.text.dtype) for r in records]))  # (B, 16, D)
    generator = step_generator(0, batch.epoch, batch.step, 0)
    u = torch.sigmoid(torch.normal(0.0, 1.0, size=(b,), generator=generator))
    eps = torch.randn(x0.shape, generator=generator)
    if family == "chroma":
        tokens = (h // 2) * (w // 2)
        s = math.exp(_flux_mu(tokens))

        def pack(x):  # 2x2 patches: (B, C, h, w) -> (B, h/2 w/2, 4C)
            return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, tokens, 4 * c)

        mask = torch.from_numpy(np.stack([to_float32(r.text.pooled, r.text.dtype) for r in records]))  # (B, 16)
        extra = dict(img_ids=_ids(1, h // 2, w // 2).float(),
                     txt_ids=torch.zeros(TOKENS, 3), attention_mask=torch.cat([mask, torch.ones(b, tokens)], 1))
        assert ((mask == 0) | (mask == 1)).all() and mask.sum(1).min() >= 2
    else:
        tokens = h * w
        s = math.exp(_empirical_mu(tokens))

        def pack(x):  # (B, 4C, h, w) -> (B, h w, 4C)
            return x.reshape(b, c, tokens).transpose(1, 2)

        img_ids, txt_ids = _ids(1, h, w, 1), _ids(1, 1, 1, TOKENS)
        extra = dict(img_ids=img_ids.expand(b, -1, -1), txt_ids=txt_ids.expand(b, -1, -1),
                     guidance=torch.full((b,), 3.5) if family == "flux2" else None)  # fmt: skip
    sigma = (s * u / (1 + (s - 1) * u)).view(b, 1, 1, 1)
    with torch.no_grad():
        pred = denoiser.model(hidden_states=pack((1 - sigma) * x0 + sigma * eps), timestep=sigma.flatten(),
                              encoder_hidden_states=text, return_dict=False, **extra)[0]  # fmt: skip
    want = ((pred - pack(eps - x0)) ** 2).mean()
    assert torch.isfinite(want) and batch.bucket == "64x64"
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert denoiser.pipeline_class == {"flux2": "Flux2Pipeline", "flux2-klein": "Flux2KleinPipeline",
                                       "chroma": "ChromaPipeline"}[family]  # fmt: skip


@pytest.mark.parametrize("family, side, steps", [("flux2", 256, 50), ("flux2", 1088, 4), ("flux2-klein", 512, 50),
                                                 ("chroma", 512, 4)])  # fmt: skip
def test_the_shift_of_a_bucket_is_the_one_the_pipeline_samples_it_with(families, family, side, steps):
    """The sigmas the family's pipeline steps through at ``side``² are the recipe's shift of that bucket applied
    to the unshifted schedule (Flux 2: mu of the tokens at 50 steps, the pipelines' default; above 4300 tokens
    mu does not depend on the steps)."""
    from diffusers import DiffusionPipeline

    reader, _ = _batch(families[family])
    denoiser = _denoiser(reader)
    pipe = DiffusionPipeline.from_pretrained(families[family]["model"], transformer=denoiser.model)
    pipe.set_progress_bar_config(disable=True)
    captured = []
    set_timesteps = pipe.scheduler.set_timesteps

    @functools.wraps(set_timesteps)  # its signature: retrieve_timesteps reads it
    def capture(*args, **kwargs):  # the schedule the pipeline sets, before any step
        set_timesteps(*args, **kwargs)
        captured.append(pipe.scheduler.sigmas.clone())

    pipe.scheduler.set_timesteps = capture
    width = reader.meta.text_layout.width
    prompt = {"prompt_embeds": torch.zeros(1, 4, width)}
    if family == "chroma":
        prompt.update(prompt_attention_mask=torch.ones(1, 4), negative_prompt_embeds=torch.zeros(1, 4, width),
                      negative_prompt_attention_mask=torch.ones(1, 4))  # fmt: skip
    with torch.no_grad():
        pipe(**prompt, height=side, width=side, num_inference_steps=steps, output_type="latent",
             guidance_scale=1.0, generator=torch.Generator().manual_seed(0))  # fmt: skip
    sampled = captured[0][:-1]
    latent = side // (16 if family != "chroma" else 8)  # Flux 2's latents are patchified already
    from train.recipes import flux2 as recipe

    from train.shift import timestep_shift

    rule = None if family == "chroma" else recipe.empirical_mu
    shift = timestep_shift("auto", pipe.scheduler.config, patch=2 if family == "chroma" else 1, mu_rule=rule)
    t = torch.from_numpy(np.linspace(1.0, 1 / steps, steps).astype(np.float32))
    s = shift.shift(latent, latent)
    tokens = (side // 16) ** 2
    want_mu = _flux_mu(tokens) if family == "chroma" else _empirical_mu(tokens)
    if family != "chroma" and tokens <= 4300:
        assert steps == 50  # the recipe's rule is the pipelines' at their default 50 steps
    assert s == pytest.approx(math.exp(want_mu), rel=1e-9)
    torch.testing.assert_close((s * t / (1 + (s - 1) * t)).double(), sampled.double(), rtol=1e-5, atol=1e-6)


def _generate(pipe, family: str) -> np.ndarray:
    # FLUX.2-dev: the guidance embedding; Klein and Chroma: classifier-free guidance against the empty prompt
    kwargs = {"guidance_scale": 2.0, **({"negative_prompt": ""} if family == "chroma" else {})}
    return pipe(prompt="a red cat", height=32, width=32, num_inference_steps=2, output_type="np",
                generator=torch.Generator().manual_seed(0), **kwargs).images[0]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_two_steps_resume_exactly_and_a_full_fine_tune_loads_into_the_pipeline(families, family, tmp_path):
    from safetensors.torch import load_file

    f = families[family]
    cfg = write_settings(tmp_path / "c.json", validation_every=2, validation_steps=2, validation_size=32, ema_decay=0.9)
    common = ["--plan", f["plan"], "--cache", f["cache"], "--config", cfg]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result, printed = train_quiet(*common, "--output-dir", straight, "--max-steps", 2)
    assert result.steps == 2
    assert train_quiet(*common, "--output-dir", resumed, "--max-steps", 1)[0].steps == 1
    assert train_quiet(*common, "--output-dir", resumed, "--max-steps", 2, "--resume")[0].steps == 1
    assert logged_losses(straight) == logged_losses(resumed) and len(logged_losses(straight)) == 2
    for name in ("model/diffusion_pytorch_model.safetensors", "model_ema/diffusion_pytorch_model.safetensors"):
        a, b = load_file(straight / name), load_file(resumed / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    images = sorted((straight / "validation" / "step-00000002").glob("*.png"))
    assert [p.name for p in images] == ["00.png", "01.png"]

    # the trained transformer, as the run printed: loaded into the family's pipeline, which generates
    code = printed_code(printed, "load it into the base pipeline")
    cls = "ChromaTransformer2DModel" if family == "chroma" else "Flux2Transformer2DModel"
    assert f"{cls}.from_pretrained" in code
    scope: dict[str, Any] = {}
    exec(code, scope)
    image = _generate(scope["pipe"], family)
    assert image.shape == (32, 32, 3) and np.isfinite(image).all()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_lora_export_loads_with_load_lora_weights_and_gives_the_trained_outputs(families, family, tmp_path):
    from safetensors.torch import load_file

    from train.config import load_config
    from train.lora import add_lora

    f = families[family]
    cfg = write_settings(tmp_path / "lora.json", lora_rank=4, lora_alpha=8, lr=1e-2)
    out = tmp_path / "out"
    result, printed = train_quiet("--plan", f["plan"], "--cache", f["cache"], "--config", cfg, "--output-dir", out,
                             "--max-steps", 3)  # fmt: skip
    assert result.steps == 3
    record = json.loads((out / "lora" / "lora.json").read_text())
    assert (record["family"], record["rank"], record["alpha"]) == (family, 4, 8)
    if family != "chroma":  # the single-stream blocks' fused projection is adapted too
        assert "to_qkv_mlp_proj" in record["targets"]

    reader, batch = _batch(f)
    denoiser = _denoiser(reader)
    base = recipe_outputs(denoiser, denoiser.model, batch)
    trained = denoiser.model  # the base with the adapters of the last checkpoint, by parameter name
    add_lora(trained, load_config(cfg), targets=denoiser.lora_targets)
    saved = load_file(out / "checkpoints" / "step-00000003" / "adapters.safetensors")
    params = dict(trained.named_parameters())
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor)
    want = recipe_outputs(denoiser, trained, batch)

    scope: dict[str, Any] = {}
    exec(printed_code(printed, "LoRA adapters in"), scope)  # from_pretrained + load_lora_weights, as printed
    pipe = scope["pipe"]
    assert pipe.get_list_adapters(), "load_lora_weights loaded nothing"
    loaded = recipe_outputs(denoiser, pipe.transformer, batch)
    torch.testing.assert_close(loaded, want, rtol=1e-4, atol=1e-5)
    assert (loaded - base).abs().max() > 100 * (loaded - want).abs().max()  # the adapters do act
    assert np.isfinite(_generate(pipe, family)).all()


def test_flux2_dev_training_is_refused_on_one_gpu_before_any_weight_loads(tmp_path, monkeypatch):
    """FLUX.2-dev's published transformer config (32B parameters) against an 80 GB GPU (the memory faked by
    BUCKETEER_GPU_MEMORY_GB): a full fine-tune and LoRA both refused in one line, from config.json alone."""
    import json

    from diffusers import Flux2Transformer2DModel

    from train.config import TrainConfig
    from train.recipes.memory import MEMORY_ENV, check_fits, parameters

    from benchmarks.sizes_flux2 import FLUX2_TRANSFORMER
    from manifests.errors import UsageError

    folder = tmp_path / "transformer"
    folder.mkdir()
    config = {"_class_name": "Flux2Transformer2DModel", **FLUX2_TRANSFORMER["dev"]}
    (folder / "config.json").write_text(json.dumps(config))
    assert parameters(Flux2Transformer2DModel, str(tmp_path)) > 30e9
    monkeypatch.setenv(MEMORY_ENV, "80")
    for cfg, what in ((TrainConfig(), "a full fine-tune"), (TrainConfig(lora_rank=16), "LoRA")):
        with pytest.raises(UsageError, match=f"flux2: {what}.*per GPU before activations; this GPU has 80.0 GB"):
            check_fits("flux2", Flux2Transformer2DModel, str(tmp_path), cfg)
