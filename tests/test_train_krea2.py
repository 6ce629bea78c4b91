"""The krea-2 recipe on the tiny random-weight ``Krea2Pipeline`` of the real classes.

A module fixture embeds 6 images (the real embed job on Ray, from the tiny diffusers folder, with a validation
prompt) and plans them. One batch's loss is recomputed by hand as ``Krea2Pipeline.__call__`` calls its transformer
(``_pack_latents``, ``prepare_position_ids``, the 12 stacked layers, the boolean mask, ``timestep = sigma``, the
bucket's ``mu`` from the pipeline's own ``calculate_shift``, 1.15 for a distilled folder); the noise levels the
recipe shifts with are those the pipeline's scheduler samples; the cached rows padded at the end give the
transformer's output on the pipeline's own ``[caption | PAD | suffix]`` layout. A LoRA run's export loads with
``Krea2Pipeline.load_lora_weights`` (the code the trainer printed) and gives the trained model's outputs; a full
fine-tune's ``model/`` loads into the pipeline and generates, validation images included. The memory check refuses
a full fine-tune of the real 12.8B transformer on one 80 GB GPU, from its config alone. ``bucketeer demo --family
krea-2`` runs end to end.
"""

from __future__ import annotations

import json
import math
import shutil
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

MISSING = missing_classes("krea-2")  # why this diffusers cannot run the family (None: it can)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

RANK = 4


@pytest.fixture(scope="module")
def krea(tmp_path_factory, ray_local) -> dict[str, str]:
    base = tmp_path_factory.mktemp("train-krea2")
    data = family_plan(base, "krea-2")
    model = data["model"]
    distilled = base / "krea-2-turbo"  # the same weights, its model_index.json saying is_distilled
    shutil.copytree(model, distilled)
    index = json.loads((distilled / "model_index.json").read_text())
    (distilled / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    return {**data, "distilled": str(distilled)}


def _batches(f: dict[str, str]):
    return plan_batches(f)


def _pipe():
    """A ``Krea2Pipeline`` with no models: its own packing and position ids, as ``__call__`` uses them."""
    from diffusers import Krea2Pipeline

    return Krea2Pipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)


def _by_hand(model: torch.nn.Module, batch: Any, scheduler_config: dict, seed: tuple, distilled: bool) -> torch.Tensor:
    """The loss of ``batch``, computed here with the pipeline's own pieces (see the module docstring)."""
    from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from train.model import step_generator

    generator = step_generator(*seed)
    x0 = batch.latents
    b, c, h, w = x0.shape
    u = compute_density_for_timestep_sampling("logit_normal", b, logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                              generator=generator)  # fmt: skip
    noise = torch.randn(x0.shape, generator=generator)
    c_ = scheduler_config  # as Krea2Pipeline.__call__ sets the bucket's schedule
    mu = 1.15 if distilled else calculate_shift((h // 2) * (w // 2), c_.get("base_image_seq_len", 256),
                                                c_.get("max_image_seq_len", 6400), c_.get("base_shift", 0.5),
                                                c_.get("max_shift", 1.15))  # fmt: skip
    s = math.exp(mu)
    sigma = (s * u / (1 + (s - 1) * u)).view(b, 1, 1, 1)
    noisy = (1 - sigma) * x0 + sigma * noise
    pipe, (_, length, wide) = _pipe(), batch.text.shape
    pred = model(hidden_states=pipe._pack_latents(noisy, b, c, h, w), timestep=sigma.flatten(),
                 encoder_hidden_states=batch.text.view(b, length, 12, wide // 12),
                 encoder_attention_mask=batch.text_mask.bool(),
                 position_ids=pipe.prepare_position_ids(length, h // 2, w // 2, x0.device),
                 return_dict=False)[0]  # fmt: skip
    return ((pred.float() - pipe._pack_latents(noise - x0, b, c, h, w)) ** 2).mean()


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("distilled", [False, True])
def test_the_loss_is_the_pipelines_forward_by_hand(krea, distilled):
    from train.model import step_generator
    from train.recipes import recipe_for

    reader, batches = _batches(krea)
    cfg = TrainConfig(family="krea-2", pretrained=krea["distilled"] if distilled else None)
    denoiser = recipe_for(cfg, reader.meta).setup(cfg, reader.meta)
    assert denoiser.pipeline_class == "Krea2Pipeline" and denoiser.tokens_per_position == 1 / 4
    model = denoiser.model
    scheduler = json.loads((Path(krea["model"]) / "scheduler" / "scheduler_config.json").read_text())
    padded = [b for b in batches if not b.text_mask.all()]
    assert padded, "a batch of captions of different lengths, so that the text mask matters"
    for batch in (batches[0], padded[0]):
        seed = (0, batch.epoch, batch.step, 0)
        loss = denoiser.loss(model, batch, step_generator(*seed))
        with torch.no_grad():
            assert torch.equal(loss.detach(), _by_hand(model, batch, scheduler, seed, distilled))
    loss.backward()
    assert torch.isfinite(loss) and model.txt_in.linear_1.weight.grad.abs().sum() > 0
    assert model.text_fusion.projector.weight.grad.abs().sum() > 0  # the 12 layers are fused, and learn


@pytest.mark.parametrize("distilled", [False, True])
def test_the_shift_is_the_noise_levels_the_pipeline_samples(krea, distilled):
    """The recipe's shift for a bucket moves ``t`` where the pipeline's scheduler moves its sigmas for that size."""
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

    from train.recipes.krea2 import krea2_mu
    from train.shift import timestep_shift

    folder = krea["distilled"] if distilled else krea["model"]
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    shift = timestep_shift("auto", scheduler.config, patch=2, mu_rule=krea2_mu(scheduler.config, distilled))
    pipe = DiffusionPipeline.from_pretrained(folder)
    assert pipe.config.is_distilled == distilled
    steps = 4
    for height, width in ((64, 64), (128, 32)):
        embeds = torch.zeros(1, 3, 12, 32)
        pipe(prompt_embeds=embeds, prompt_embeds_mask=torch.ones(1, 3, dtype=torch.bool), height=height,
             width=width, num_inference_steps=steps, guidance_scale=0.0, output_type="latent")  # fmt: skip
        s = shift.shift(height // 8, width // 8)
        t = torch.from_numpy(np.linspace(1.0, 1 / steps, steps))
        torch.testing.assert_close(pipe.scheduler.sigmas[:-1].double(), s * t / (1 + (s - 1) * t), rtol=1e-6, atol=0)
    assert (shift.shift(8, 8) == math.exp(1.15)) == distilled  # the turbo folder's fixed mu, whatever the size


def test_cached_rows_padded_at_the_end_give_the_pipelines_layout_output(krea):
    """The pipeline feeds ``[caption | PAD | suffix]`` (512 rows, pads masked); the recipe the stored caption and
    suffix rows padded at the end to the batch's length: the transformer gives the same velocity."""
    from diffusers import DiffusionPipeline

    from pipeline.embed.encoders import encoder_specs
    from train.recipes.krea2 import model_inputs

    pipe = DiffusionPipeline.from_pretrained(krea["model"])
    captions = ["a photo of the cat", "red dog " * 20]
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(captions, device="cpu")  # (2, 512, 12, 32)
    _, spec = encoder_specs(family="krea-2", model=krea["model"], vae=None, vae_subfolder=None, text_encoders=None,
                            text_subfolders=None)  # fmt: skip
    rows = [tokens[0] for tokens, _ in spec.load(dtype="F32").encode(captions)]
    text = torch.zeros(2, max(r.shape[0] for r in rows) + 3, rows[0].shape[1])  # the loader's: zeros after
    text_mask = torch.zeros(text.shape[:2])
    for i, r in enumerate(rows):
        text[i, : r.shape[0]], text_mask[i, : r.shape[0]] = r, 1
    latents, sigma = torch.randn(2, 16, 8, 6, generator=torch.Generator().manual_seed(0)), torch.tensor([0.3, 0.8])
    model = pipe.transformer
    with torch.no_grad():
        ours = model(**model_inputs(latents, text, text_mask, patch=2, layers=12), timestep=sigma,
                     return_dict=False)[0]  # fmt: skip
        theirs = model(hidden_states=pipe._pack_latents(latents, 2, 16, 8, 6), encoder_hidden_states=embeds,
                       timestep=sigma, position_ids=pipe.prepare_position_ids(512, 4, 3, "cpu"),
                       encoder_attention_mask=mask, return_dict=False)[0]  # fmt: skip
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def _output(krea, model: torch.nn.Module) -> torch.Tensor:
    """``model``'s output on the first batch of the plan, through the recipe's loss (fixed noise)."""
    from train.recipes import recipe_for

    reader, batches = _batches(krea)
    cfg = TrainConfig(family="krea-2")
    return recipe_outputs(recipe_for(cfg, reader.meta).setup(cfg, reader.meta), model, batches[0])


def _base(krea) -> torch.nn.Module:
    from diffusers import Krea2Transformer2DModel

    return Krea2Transformer2DModel.from_pretrained(krea["model"], subfolder="transformer")


@pytest.mark.slow
@pytest.mark.full
def test_the_lora_export_loads_into_the_pipeline_and_gives_the_trained_outputs(krea, tmp_path):
    from safetensors.torch import load_file

    from train.config import load_config
    from train.lora import add_lora

    cfg = write(tmp_path / "c.json", lora_rank=RANK, lora_alpha=3 * RANK, lr=1e-2, ema_decay=0.9, log_every=10)
    out = tmp_path / "out"
    result, printed = train_quiet("--plan", krea["plan"], "--cache", krea["cache"], "--config", cfg,
                                  "--output-dir", out, "--max-steps", 3)  # fmt: skip
    assert result.steps == 3, printed
    code = printed_code(printed, "LoRA adapters in")
    assert f"pipe.load_lora_weights('{out / 'lora'}')" in code
    scope: dict[str, Any] = {}
    exec(code, scope)  # as printed: from_pretrained(base) + load_lora_weights
    pipe = scope["pipe"]
    assert type(pipe).__name__ == "Krea2Pipeline" and pipe.get_list_adapters(), "load_lora_weights loaded nothing"
    trained = _base(krea)  # the base model with the last checkpoint's adapters, by parameter name
    add_lora(trained, load_config(cfg), targets=("to_q", "to_k", "to_v", "to_out.0"))
    params = dict(trained.named_parameters())
    with torch.no_grad():
        for name, tensor in load_file(out / "checkpoints" / "step-00000003" / "adapters.safetensors").items():
            params[name].copy_(tensor)
    loaded, want, base = (_output(krea, m) for m in (pipe.transformer, trained, _base(krea)))
    torch.testing.assert_close(loaded, want, rtol=1e-4, atol=1e-5)
    assert (loaded - base).abs().max() > 100 * (loaded - want).abs().max()  # the adapters do act


@pytest.mark.slow
@pytest.mark.full
def test_a_full_fine_tune_loads_into_the_pipeline_and_generates(krea, tmp_path):
    out = tmp_path / "out"
    cfg = write(tmp_path / "c.json", validation_every=2, validation_steps=2, validation_size=32)
    result, printed = train_quiet("--plan", krea["plan"], "--cache", krea["cache"], "--config", cfg, "--output-dir",
                                  out, "--max-steps", 2)  # fmt: skip
    assert result.steps == 2
    assert [p.name for p in (out / "validation" / "step-00000002").glob("*.png")] == ["00.png"]
    scope: dict[str, Any] = {}
    exec(printed_code(printed, "load it into the base pipeline"), scope)
    pipe = scope["pipe"]
    trained = pipe.transformer.state_dict()
    assert any(not torch.equal(trained[k], v) for k, v in _base(krea).state_dict().items())
    image = pipe("a red cat", height=64, width=64, num_inference_steps=2, output_type="np", guidance_scale=0.0,
                 generator=torch.Generator().manual_seed(0)).images[0]  # fmt: skip
    assert image.shape == (64, 64, 3) and np.isfinite(image).all()


def test_what_one_80_gb_gpu_holds_is_checked_before_loading(tmp_path, monkeypatch):
    from diffusers import Krea2Transformer2DModel

    from benchmarks.real_configs import KREA2_TRANSFORMER
    from train.recipes.memory import MEMORY_ENV, check_fits, parameters

    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": "Krea2Transformer2DModel",
                                                                      **KREA2_TRANSFORMER}))  # fmt: skip
    assert parameters(Krea2Transformer2DModel, str(tmp_path)) == pytest.approx(12.82e9, rel=0.005)  # meta device
    monkeypatch.setenv(MEMORY_ENV, "80")
    check_fits("krea-2", Krea2Transformer2DModel, str(tmp_path), TrainConfig(lora_rank=16))  # 51 GB frozen: fits
    with pytest.raises(UsageError, match=r"krea-2: .* 12\.82B-parameter .* needs 205\.1 GB per GPU before "
                                         r"activations; this GPU has 80\.0 GB: shard it with FSDP .*or train LoRA"):
        check_fits("krea-2", Krea2Transformer2DModel, str(tmp_path), TrainConfig())


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
@pytest.mark.full
def test_demo_krea2_embeds_and_fine_tunes(tmp_path, bucketeer_home):
    from tests.test_demo import run_demo

    out = tmp_path / "out"
    output, _ = run_demo(tmp_path, "--family", "krea-2", "--images", "40", "--out-dir", str(out))
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["embed"]["samples"] == figures["scan"]["samples"] == 40, output[-3000:]
    assert figures["train"]["steps"] >= 2 and figures["train"]["loss_last"] is not None
    cache = json.loads((out / "cache" / "_cache.json").read_text())
    assert cache["family"] == "krea-2" and cache["text"]["layout"]["masked"] and "normalised" in cache["latent"]
    assert (out / "train" / "model" / "config.json").exists() and (out / "train" / "model_ema").is_dir()
    assert sorted(p.name for p in (out / "train" / "validation").glob("step-*/*.png")) == ["00.png", "01.png"]
