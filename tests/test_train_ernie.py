"""The ``ernie-image`` recipe in the one loop, on the tiny random-weight pipeline of the real classes.

A module fixture embeds 6 images (in this process, two validation prompts) and plans them. One batch's loss, for a
batch whose captions differ in length, equals a hand computation with the pipeline's own transformer call
(``text_bth`` zero-padded, ``text_lens``, NCHW latents, ``timestep`` = ``sigma * 1000``, the draws in the order
of the step's generator, the scheduler's fixed shift); the sigmas the pipeline samples are the recipe's shift of
the unshifted schedule. A LoRA run's export loads with ``ErnieImagePipeline.load_lora_weights`` (the code the
trainer printed) and gives the trained transformer's outputs; two steps resumed after one equal two straight; a full
fine-tune's ``model/`` loads into the pipeline as printed and generates (validation images on the way). The memory
check refuses the real 8B transformer's full fine-tune on an 80 GB GPU from its config alone and lets LoRA through.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.embed.families.base import missing_classes
from manifests.cache import CacheReader
from tests.train_dataset import logged_losses, printed_code, recipe_outputs, train_quiet, write_settings
from train.config import TrainConfig

MISSING = missing_classes("ernie-image")  # why this diffusers cannot run the family (None: it can)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))


@pytest.fixture(scope="module")
def ernie(tmp_path_factory) -> dict[str, str]:
    from tests.embed_data import family_plan

    return family_plan(tmp_path_factory.mktemp("train-ernie"), "ernie-image",
                       "a red cat\na blue dog on a long red carpet\n", executor="local")  # fmt: skip


def _batches(f: dict[str, str]):
    from tests.embed_data import plan_batches

    return plan_batches(f)


def _denoiser(reader: CacheReader, **cfg):
    from train.recipes import recipe_for

    config = TrainConfig(**cfg)
    return recipe_for(config, reader.meta).setup(config, reader.meta)


def _by_hand(model: torch.nn.Module, batch: Any, shift: float, seed: tuple) -> torch.Tensor:
    """The loss of ``batch`` with ``ErnieImagePipeline.__call__``'s transformer call (``:346-352``) written out."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from train.model import step_generator

    generator = step_generator(*seed)
    x0 = batch.latents  # (B, 128, h, w): stored as the transformer sees them
    b = x0.shape[0]
    u = compute_density_for_timestep_sampling("logit_normal", b, logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                              generator=generator)  # fmt: skip
    noise = torch.randn(x0.shape, generator=generator)
    sigma = (shift * u / (1 + (shift - 1) * u)).view(b, 1, 1, 1)
    lens = torch.tensor([int(m.sum()) for m in batch.text_mask])  # _pad_text's lens: each caption's rows
    text = torch.zeros(b, int(lens.max()), batch.text.shape[-1])  # _pad_text: zeros past each caption
    for i, n in enumerate(lens.tolist()):
        text[i, :n] = batch.text[i, :n]
    pred = model(hidden_states=(1 - sigma) * x0 + sigma * noise, timestep=sigma.flatten() * 1000, text_bth=text,
                 text_lens=lens, return_dict=False)[0]  # fmt: skip
    return ((pred.float() - (noise - x0)) ** 2).mean()


def test_the_loss_is_the_pipelines_transformer_call_by_hand(ernie):
    from train.model import step_generator

    reader, batches = _batches(ernie)
    denoiser = _denoiser(reader, family="ernie-image")
    model = denoiser.model
    shift = json.loads((Path(ernie["model"]) / "scheduler" / "scheduler_config.json").read_text())["shift"]
    assert shift == 4.0 and denoiser.pipeline_class == "ErnieImagePipeline"
    padded = [b for b in batches if not b.text_mask.all()]
    assert padded, "a batch of captions of different lengths, so that text_lens and the padding matter"
    for batch in (batches[0], padded[0]):
        seed = (0, batch.epoch, batch.step, 0)
        loss = denoiser.loss(model, batch, step_generator(*seed))
        with torch.no_grad():
            assert torch.equal(loss.detach(), _by_hand(model, batch, shift, seed))
    loss.backward()
    assert torch.isfinite(loss) and model.text_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("side, steps", [(256, 50), (64, 4)])
def test_the_shift_is_the_one_the_pipeline_samples_with(ernie, side, steps):
    """``__call__`` sets ``sigmas = linspace(1, 0, steps + 1)[:-1]``; the scheduler shifts them by its fixed shift
    whatever the size, and steps at ``t = sigma * 1000``: the recipe's sigma and timestep."""
    from diffusers import DiffusionPipeline

    from train.shift import timestep_shift

    reader, _ = _batches(ernie)
    pipe = DiffusionPipeline.from_pretrained(ernie["model"])
    pipe.set_progress_bar_config(disable=True)
    captured = []
    set_timesteps = pipe.scheduler.set_timesteps

    @functools.wraps(set_timesteps)
    def capture(*args, **kwargs):
        set_timesteps(*args, **kwargs)
        captured.append((pipe.scheduler.sigmas.clone(), pipe.scheduler.timesteps.clone()))

    pipe.scheduler.set_timesteps = capture
    rows = [torch.zeros(3, reader.meta.text_layout.width)]
    with torch.no_grad():
        pipe(prompt_embeds=rows, negative_prompt_embeds=rows, height=side, width=side, num_inference_steps=steps,
             output_type="latent", generator=torch.Generator().manual_seed(0))  # fmt: skip
    sigmas, timesteps = captured[0]
    shift = timestep_shift("auto", pipe.scheduler.config, patch=1)
    s = shift.shift(side // 16, side // 16)
    t = torch.linspace(1.0, 0.0, steps + 1)[:-1]
    assert s == 4.0
    torch.testing.assert_close((s * t / (1 + (s - 1) * t)), sigmas[:-1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sigmas[:-1] * 1000, timesteps, rtol=1e-6, atol=1e-4)


def _generate(pipe) -> np.ndarray:
    return pipe(prompt="a red cat", height=32, width=32, num_inference_steps=2, guidance_scale=2.0, output_type="np",
                generator=torch.Generator().manual_seed(0)).images[0]  # fmt: skip


@pytest.mark.slow
def test_two_steps_resume_exactly_and_a_full_fine_tune_loads_into_the_pipeline(ernie, tmp_path):
    from safetensors.torch import load_file

    cfg = write_settings(tmp_path / "c.json", validation_every=2, validation_steps=2, validation_size=32, ema_decay=0.9)
    common = ["--plan", ernie["plan"], "--cache", ernie["cache"], "--config", cfg]
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

    code = printed_code(printed, "load it into the base pipeline")
    assert "ErnieImageTransformer2DModel.from_pretrained" in code
    scope: dict[str, Any] = {}
    exec(code, scope)
    image = _generate(scope["pipe"])
    assert image.shape == (32, 32, 3) and np.isfinite(image).all()


@pytest.mark.slow
def test_the_lora_export_loads_with_load_lora_weights_and_gives_the_trained_outputs(ernie, tmp_path):
    from safetensors.torch import load_file

    from train.config import load_config
    from train.lora import add_lora

    cfg = write_settings(tmp_path / "lora.json", lora_rank=4, lora_alpha=8, lr=1e-2)
    out = tmp_path / "out"
    result, printed = train_quiet("--plan", ernie["plan"], "--cache", ernie["cache"], "--config", cfg,
                                  "--output-dir", out, "--max-steps", 3)  # fmt: skip
    assert result.steps == 3
    record = json.loads((out / "lora" / "lora.json").read_text())
    assert (record["family"], record["rank"], record["alpha"]) == ("ernie-image", 4, 8)

    reader, batches = _batches(ernie)
    denoiser = _denoiser(reader)
    batch = batches[0]
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
    code = printed_code(printed, "LoRA adapters in")
    assert "pipe.load_lora_weights(" in code and "ErnieImagePipeline" in code
    exec(code, scope)  # from_pretrained + load_lora_weights, as printed
    pipe = scope["pipe"]
    assert type(pipe).__name__ == "ErnieImagePipeline" and pipe.get_list_adapters(), "load_lora_weights loaded nothing"
    loaded = recipe_outputs(denoiser, pipe.transformer, batch)
    torch.testing.assert_close(loaded, want, rtol=1e-4, atol=1e-5)
    assert (loaded - base).abs().max() > 100 * (loaded - want).abs().max()  # the adapters do act
    assert np.isfinite(_generate(pipe)).all()


def test_the_real_transformer_is_checked_against_one_80_gb_gpu_before_loading(tmp_path, monkeypatch):
    """The published 8B transformer config (benchmarks/real_configs.py ERNIE_IMAGE): a full fine-tune (16 bytes a
    parameter) is refused in one line from config.json alone, LoRA (its frozen weights) fits."""
    from diffusers import ErnieImageTransformer2DModel

    from benchmarks.real_configs import ERNIE_IMAGE
    from manifests.errors import UsageError
    from train.recipes.memory import MEMORY_ENV, check_fits, parameters

    (tmp_path / "transformer").mkdir()
    config = {"_class_name": "ErnieImageTransformer2DModel", **ERNIE_IMAGE}
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(config))
    assert parameters(ErnieImageTransformer2DModel, str(tmp_path)) == pytest.approx(8.03e9, rel=0.005)
    monkeypatch.setenv(MEMORY_ENV, "80")
    check_fits("ernie-image", ErnieImageTransformer2DModel, str(tmp_path), TrainConfig(lora_rank=16))
    with pytest.raises(UsageError, match="ernie-image: a full fine-tune.* needs .* GB per GPU before activations; "
                                         "this GPU has 80.0 GB.*or train LoRA"):  # fmt: skip
        check_fits("ernie-image", ErnieImageTransformer2DModel, str(tmp_path), TrainConfig())


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
@pytest.mark.full
def test_demo_embeds_and_fine_tunes_ernie_image(tmp_path, bucketeer_home):
    """``bucketeer demo --family ernie-image``: generated images -> scan -> embed (Ray) -> plan -> train (2 CPU
    processes, caption dropout, an EMA, validation images) -> verify -> report, on the tiny pipeline."""
    from tests.test_demo import run_demo

    out = tmp_path / "out"
    output, _ = run_demo(tmp_path, "--family", "ernie-image", "--images", "40", "--out-dir", str(out))
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["embed"]["samples"] == figures["scan"]["samples"] == 40, output[-3000:]
    assert figures["train"]["steps"] >= 2 and figures["train"]["loss_last"] is not None
    cache = json.loads((out / "cache" / "_cache.json").read_text())
    assert cache["family"] == "ernie-image" and cache["text"]["layout"]["masked"]
    assert cache["latent"]["channels"] == 128 and cache["latent"]["normalised"]["batch_norm_eps"] == 1e-5
    assert (out / "train" / "model" / "config.json").exists() and (out / "train" / "model_ema").is_dir()
    assert sorted(p.name for p in (out / "train" / "validation").glob("step-*/*.png")) == ["00.png", "01.png"]
