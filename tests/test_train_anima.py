"""The anima recipe on a tiny random-weight ``AnimaModularPipeline`` of the real classes.

A module fixture embeds 6 images (the real embed job on Ray, from the tiny modular folder, with a validation prompt)
and plans them. One batch's loss recomputed by hand as the pipeline's denoise loop calls its transformer (1-frame
clips, ``timestep`` = sigma, the adapter's rows zero-padded to 512, a zero padding mask at pixel size, the output
the velocity; the scheduler's fixed shift 3.0); a LoRA run whose export ``AnimaModularPipeline.load_lora_weights``
loads (the code the trainer printed) and then gives the trained model's outputs; a full fine-tune with validation
images from the pipeline's own blocks, whose ``model/`` the printed code loads into the pipeline, generating. The
memory check sizes the real 2B transformer from its config alone. The demo runs the family end to end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.embed.families.base import missing_classes
from manifests.errors import UsageError
from tests.embed_data import family_plan, plan_batches
from tests.test_train_families import write
from tests.train_dataset import printed_code, recipe_outputs, train_quiet
from train.config import TrainConfig

MISSING = missing_classes("anima")  # why this diffusers cannot run the family (None: it can)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

RANK = 4


@pytest.fixture(scope="module")
def anima(tmp_path_factory, ray_local) -> dict[str, str]:
    return family_plan(tmp_path_factory.mktemp("train-anima"), "anima")


def _batches(f: dict[str, str]):
    return plan_batches(f)


def _by_hand(model: torch.nn.Module, batch: Any, shift: float, seed: tuple) -> torch.Tensor:
    """The loss of ``batch``, with the transformer called as ``AnimaLoopDenoiser`` calls it (module docstring)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from train.model import step_generator

    generator = step_generator(*seed)
    x0 = batch.latents
    b, c, h, w = x0.shape
    u = compute_density_for_timestep_sampling("logit_normal", b, logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                              generator=generator)  # fmt: skip
    noise = torch.randn(x0.shape, generator=generator)
    sigma = (shift * u / (1 + (shift - 1) * u)).view(b, 1, 1, 1)  # FlowMatchEulerDiscreteScheduler(shift=3.0)
    noisy = (1 - sigma) * x0 + sigma * noise
    text = torch.zeros(b, 512, batch.text.shape[-1])  # AnimaTextConditioner pads its output to 512 rows
    text[:, : batch.text.shape[1]] = batch.text
    pred = model(hidden_states=noisy.unsqueeze(2), timestep=sigma.flatten(), encoder_hidden_states=text,
                 padding_mask=torch.zeros(1, 1, 8 * h, 8 * w), return_dict=False)[0]  # fmt: skip
    return ((pred.float().squeeze(2) - (noise - x0)) ** 2).mean()


@pytest.mark.slow
@pytest.mark.full
def test_the_loss_is_the_pipelines_forward_by_hand(anima):
    from train.model import step_generator
    from train.recipes import recipe_for

    reader, batches = _batches(anima)
    cfg = TrainConfig(family="anima")
    denoiser = recipe_for(cfg, reader.meta).setup(cfg, reader.meta)
    model = denoiser.model
    scheduler = json.loads((Path(anima["model"]) / "scheduler" / "scheduler_config.json").read_text())
    assert (scheduler["shift"], scheduler["use_dynamic_shifting"]) == (3.0, False)
    padded = [b for b in batches if not b.text_mask.all()]
    assert padded, "a batch of captions of different lengths, so that the zero rows matter"
    for batch in (batches[0], padded[0]):
        seed = (0, batch.epoch, batch.step, 0)
        loss = denoiser.loss(model, batch, step_generator(*seed))
        with torch.no_grad():
            assert torch.equal(loss.detach(), _by_hand(model, batch, scheduler["shift"], seed))
    loss.backward()
    text_in = model.transformer_blocks[0].attn2.to_k.weight
    assert torch.isfinite(loss) and text_in.grad is not None and text_in.grad.abs().sum() > 0
    assert denoiser.pipeline_class == "AnimaModularPipeline"


def test_a_cache_of_other_latents_is_refused():
    from types import SimpleNamespace

    from train.recipes.anima import setup

    meta = SimpleNamespace(latent=SimpleNamespace(_extra={}), settings=SimpleNamespace(model=None))
    with pytest.raises(UsageError, match="not Qwen-Image's normalised ones.*--family anima"):
        setup(TrainConfig(family="anima"), meta)


@pytest.fixture(scope="module")
def lora_run(anima, tmp_path_factory) -> dict[str, Any]:
    """A 3-step LoRA run (alpha 3x the rank)."""
    base = tmp_path_factory.mktemp("anima-lora")
    cfg = write(base / "anima.json", lora_rank=RANK, lora_alpha=3 * RANK, lr=1e-2, log_every=10)
    out = base / "out"
    result, printed = train_quiet("--plan", anima["plan"], "--cache", anima["cache"], "--config", cfg,
                                  "--output-dir", out, "--max-steps", 3)  # fmt: skip
    assert result.steps == 3, printed
    return {"out": out, "printed": printed, "cfg": cfg}


def _output(anima, model: torch.nn.Module) -> torch.Tensor:
    """``model``'s output on the first batch of the plan, through the recipe's loss (fixed noise)."""
    from train.recipes import recipe_for

    reader, batches = _batches(anima)
    cfg = TrainConfig(family="anima")
    return recipe_outputs(recipe_for(cfg, reader.meta).setup(cfg, reader.meta), model, batches[0])


def _base(anima) -> torch.nn.Module:
    from diffusers import CosmosTransformer3DModel

    return CosmosTransformer3DModel.from_pretrained(anima["model"], subfolder="transformer")


def _trained(anima, run: dict[str, Any]) -> torch.nn.Module:
    """The base model with the adapters of the run's last checkpoint, by parameter name: what training held."""
    from safetensors.torch import load_file

    from train.config import load_config
    from train.lora import add_lora

    model = _base(anima)
    add_lora(model, load_config(run["cfg"]), targets=("to_q", "to_k", "to_v", "to_out.0"))
    saved = load_file(run["out"] / "checkpoints" / "step-00000003" / "adapters.safetensors")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor)
    return model


@pytest.mark.slow
@pytest.mark.full
def test_the_lora_export_loads_into_the_modular_pipeline_and_gives_the_trained_outputs(lora_run, anima):
    run = lora_run
    code = printed_code(run["printed"], "LoRA adapters in")
    assert "pipe.load_components()" in code and f"pipe.load_lora_weights('{run['out'] / 'lora'}')" in code
    scope: dict[str, Any] = {}
    exec(code, scope)  # as printed: AnimaModularPipeline.from_pretrained(base), load_components, load_lora_weights
    pipe = scope["pipe"]
    assert type(pipe).__name__ == "AnimaModularPipeline"
    assert pipe.get_list_adapters() == {"transformer": ["default_0"]}  # the transformer only: the adapter is frozen
    loaded = _output(anima, pipe.transformer)
    trained = _output(anima, _trained(anima, run))
    base = _output(anima, _base(anima))
    torch.testing.assert_close(loaded, trained, rtol=1e-4, atol=1e-5)
    assert (loaded - base).abs().max() > 100 * (loaded - trained).abs().max()  # the adapters do act


@pytest.mark.slow
@pytest.mark.full
def test_a_full_fine_tune_validates_and_loads_into_the_modular_pipeline(anima, tmp_path):
    out = tmp_path / "out"
    cfg = write(tmp_path / "c.json", validation_every=2, validation_steps=2, validation_size=32)
    result, printed = train_quiet("--plan", anima["plan"], "--cache", anima["cache"], "--config", cfg,
                                  "--output-dir", out, "--max-steps", 2)  # fmt: skip
    assert result.steps == 2
    assert [p.name for p in (out / "validation" / "step-00000002").glob("*.png")] == ["00.png"]
    scope: dict[str, Any] = {}
    exec(printed_code(printed, "load it into the base pipeline"), scope)
    pipe = scope["pipe"]
    trained = pipe.transformer.state_dict()
    assert any(not torch.equal(trained[k], v) for k, v in _base(anima).state_dict().items())
    pipe.update_components(guider=pipe.guider.__class__(guidance_scale=1.0))
    image = pipe(prompt="a red cat", height=64, width=64, num_inference_steps=2, output_type="np", output="images",
                 generator=torch.Generator().manual_seed(0))[0]  # fmt: skip
    assert image.shape == (64, 64, 3) and np.isfinite(image).all()


# ---- what one GPU holds ---------------------------------------------------------------------------


def test_what_one_80_gb_gpu_holds_is_checked_before_loading(tmp_path, monkeypatch):
    import diffusers

    from benchmarks.real_configs import ANIMA_TRANSFORMER
    from train.recipes.memory import MEMORY_ENV, check_fits, parameters

    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": "CosmosTransformer3DModel",
                                                                      **ANIMA_TRANSFORMER}))  # fmt: skip
    cls = diffusers.CosmosTransformer3DModel
    assert parameters(cls, str(tmp_path)) == pytest.approx(1.956e9, rel=0.005)  # Cosmos-Predict2-2B
    monkeypatch.setenv(MEMORY_ENV, "24")  # a 24 GB card: LoRA (7.8 GB of frozen weights) fits, a full run does not
    check_fits("anima", cls, str(tmp_path), TrainConfig(lora_rank=16))
    with pytest.raises(UsageError, match="anima: a full fine-tune .* needs 31.3 GB per GPU .* or train LoRA"):
        check_fits("anima", cls, str(tmp_path), TrainConfig())
    monkeypatch.setenv(MEMORY_ENV, "80")
    check_fits("anima", cls, str(tmp_path), TrainConfig(ema_decay=0.999))


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
@pytest.mark.full
def test_demo_anima_embeds_and_fine_tunes(tmp_path, bucketeer_home):
    from tests.test_demo import run_demo

    out = tmp_path / "out"
    output, _ = run_demo(tmp_path, "--family", "anima", "--images", "40", "--out-dir", str(out))
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["embed"]["samples"] == figures["scan"]["samples"] == 40, output[-3000:]
    assert figures["train"]["steps"] >= 2 and figures["train"]["loss_last"] is not None
    cache = json.loads((out / "cache" / "_cache.json").read_text())
    assert cache["family"] == "anima" and cache["text"]["layout"]["masked"] and "normalised" in cache["latent"]
    assert (out / "train" / "model" / "config.json").exists() and (out / "train" / "model_ema").is_dir()
    assert sorted(p.name for p in (out / "train" / "validation").glob("step-*/*.png")) == ["00.png", "01.png"]
