"""The qwen-image-edit recipe on a tiny random-weight ``QwenImageEditPipeline`` of the real classes.

A module fixture scans 8 (target, reference) pairs (``scan --conditioning``), embeds them with the real embed job
on Ray (references at 96² so that the CPU run stays short: 96x96 and 192x64, grids of their own) and plans them.
One batch's loss recomputed by hand as
``QwenImageEditPipeline.__call__`` calls its transformer (the packed noisy latents, then the packed reference
latents, ``img_shapes`` of both, the text mask, the output's first ``h/2 * w/2`` tokens, the shift of the target's
tokens from the pipeline's own ``calculate_shift``); a LoRA run whose export the pipeline loads with
``load_lora_weights`` (the code the trainer printed) and then gives the trained model's outputs; a LoRA run
stopped and resumed equal to a straight one; a full fine-tune's ``model/`` loaded into the pipeline, editing an
image from cached prompt embeddings; caption dropout and validation images refused in one line.

The printed code loads ``QwenImageEditPipeline.from_pretrained(base)``; this environment has no torchvision, so
the test passes it the processor bucketeer loads (:func:`pipeline.embed.processors.load_qwen2vl_processor`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from manifests.cache import CacheReader
from manifests.errors import UsageError
from tests.train_dataset import assert_same_files, printed_code, train_quiet
from tests.test_families_qwen_edit import make_edit_pairs
from tests.embed_data import embed_cache
from tests.test_train_families import write
from train.config import TrainConfig
from train.data import BatchLoader, rank_steps

FAMILY = "qwen-image-edit"
RANK = 4


@pytest.fixture(scope="module")
def edit(tmp_path_factory, ray_local) -> dict[str, str]:
    from pipeline import PlanJob, run
    from pipeline.embed.loading import quiet_loading
    from pipeline.embed.families.tiny import build_tiny

    quiet_loading()
    base = tmp_path_factory.mktemp("train-edit")
    manifest = make_edit_pairs(base, 8)  # buckets 64x64 (5 pairs) and 128x32 (3)
    model, cache, plan = str(build_tiny(FAMILY, base / FAMILY)), str(base / "cache"), str(base / "plan")
    embed_cache(manifest, cache, family=FAMILY, model=model, reference_resolution=96)
    run(PlanJob(manifests=(manifest,), out=plan, world_size=1, batch_size=2, epochs=3, cache=(cache,),
                leftover="pad"))  # fmt: skip
    return {"model": model, "cache": cache, "plan": plan}


def _batches(f: dict[str, str]):
    reader = CacheReader(f["cache"])
    return reader, list(BatchLoader(reader, list(rank_steps(f["plan"], 0)), reader.meta.latent))


def _by_hand(model: torch.nn.Module, batch: Any, scheduler: dict, seed: tuple, reference=None) -> torch.Tensor:
    """The loss of ``batch`` computed here with the edit pipeline's own pieces (see the module docstring)."""
    from diffusers import QwenImageEditPipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_shift
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from train.model import step_generator

    generator = step_generator(*seed)
    x0, ref = batch.latents, batch.cond_latents if reference is None else reference
    b, c, h, w = x0.shape
    rh, rw = ref.shape[-2:]
    u = compute_density_for_timestep_sampling("logit_normal", b, logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                              generator=generator)  # fmt: skip
    noise = torch.randn(x0.shape, generator=generator)
    # the pipeline's mu is of its noisy latents' tokens (latents.shape[1]), not the reference's
    s = math.exp(calculate_shift((h // 2) * (w // 2), scheduler["base_image_seq_len"], scheduler["max_image_seq_len"],
                                 scheduler["base_shift"], scheduler["max_shift"]))  # fmt: skip
    sigma = (s * u / (1 + (s - 1) * u)).view(b, 1, 1, 1)
    noisy = (1 - sigma) * x0 + sigma * noise
    pack = QwenImageEditPipeline._pack_latents
    latent_model_input = torch.cat([pack(noisy, b, c, h, w), pack(ref, b, c, rh, rw)], dim=1)
    pred = model(hidden_states=latent_model_input, timestep=sigma.flatten(), encoder_hidden_states=batch.text,
                 encoder_hidden_states_mask=None if batch.text_mask.all() else batch.text_mask,
                 img_shapes=[[(1, h // 2, w // 2), (1, rh // 2, rw // 2)]] * b, return_dict=False)[0]  # fmt: skip
    pred = pred[:, : (h // 2) * (w // 2)]  # noise_pred[:, : latents.size(1)]
    return ((pred.float() - pack(noise - x0, b, c, h, w)) ** 2).mean()


@pytest.mark.slow
@pytest.mark.full
def test_the_loss_is_the_edit_pipelines_forward_by_hand(edit):
    from train.model import step_generator
    from train.recipes import recipe_for

    reader, batches = _batches(edit)
    cfg = TrainConfig(family=FAMILY)
    denoiser = recipe_for(cfg, reader.meta).setup(cfg, reader.meta)
    model = denoiser.model
    scheduler = json.loads((Path(edit["model"]) / "scheduler" / "scheduler_config.json").read_text())
    padded = [b for b in batches if not b.text_mask.all()]
    wide = [b for b in batches if b.latents.shape[-2:] != b.cond_latents.shape[-2:]]
    assert padded and wide, "a batch with instructions of different lengths, one whose reference has its own grid"
    for batch in (batches[0], padded[0], wide[0]):
        seed = (0, batch.epoch, batch.step, 0)
        loss = denoiser.loss(model, batch, step_generator(*seed))
        with torch.no_grad():
            assert torch.equal(loss.detach(), _by_hand(model, batch, scheduler, seed))
            # the reference takes part: another reference, another loss
            other = _by_hand(model, batch, scheduler, seed, reference=torch.zeros_like(batch.cond_latents))
            assert not torch.equal(loss.detach(), other)
    loss.backward()
    assert torch.isfinite(loss) and model.txt_in.weight.grad.abs().sum() > 0
    assert denoiser.pipeline_class == "QwenImageEditPipeline"


@pytest.mark.slow
@pytest.mark.full
def test_caption_dropout_and_validation_are_refused_in_one_line(edit, tmp_path):
    common = ["--plan", edit["plan"], "--cache", edit["cache"], "--output-dir", tmp_path / "o", "--max-steps", 1]
    for setting, says in (({"caption_dropout": 0.1}, "empty instruction's embedding depends on each reference"),
                          ({"validation_every": 1}, "validation images would need a reference image per prompt")):
        with pytest.raises(UsageError, match=says):
            train_quiet(*common, "--config", write(tmp_path / "c.json", **setting))


@pytest.fixture(scope="module")
def lora_runs(edit, tmp_path_factory) -> dict[str, Any]:
    """A 3-step LoRA run (alpha 3x the rank, EMA on), and the same stopped after 2 steps and resumed."""
    base = tmp_path_factory.mktemp("edit-lora")
    cfg = write(base / "c.json", lora_rank=RANK, lora_alpha=3 * RANK, lr=1e-2, ema_decay=0.9, log_every=10)
    common = ["--plan", edit["plan"], "--cache", edit["cache"], "--config", cfg]
    out, resumed = base / "straight", base / "resumed"
    result, printed = train_quiet(*common, "--output-dir", out, "--max-steps", 3)
    assert result.steps == 3, printed
    train_quiet(*common, "--output-dir", resumed, "--max-steps", 2)
    assert train_quiet(*common, "--output-dir", resumed, "--max-steps", 3, "--resume")[0].steps == 1
    return {"out": out, "resumed": resumed, "printed": printed, "cfg": cfg}


def _output(edit: dict[str, str], model: torch.nn.Module) -> torch.Tensor:
    """``model``'s output on the first batch of the plan, through the recipe's loss (fixed noise)."""
    from train.model import step_generator
    from train.recipes import recipe_for

    reader, batches = _batches(edit)
    cfg = TrainConfig(family=FAMILY)
    recipe = recipe_for(cfg, reader.meta).setup(cfg, reader.meta)
    outputs = []
    hook = model.register_forward_hook(lambda module, args, out: outputs.append(out[0]))
    try:
        with torch.no_grad():
            recipe.loss(model, batches[0], step_generator(0, batches[0].epoch, batches[0].step, 0))
    finally:
        hook.remove()
    return outputs[0]


def _base(edit: dict[str, str]) -> torch.nn.Module:
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel.from_pretrained(edit["model"], subfolder="transformer")


def _run_printed(printed: str, after: str, base: str) -> Any:
    """The pipeline the trainer's printed code loads, the processor passed in (no torchvision here)."""
    from pipeline.embed.processors import load_qwen2vl_processor

    code = printed_code(printed, after).replace(f".from_pretrained({base!r}", f".from_pretrained({base!r}, "
                                                                              "processor=processor")  # fmt: skip
    assert "processor=processor" in code
    scope: dict[str, Any] = {"processor": load_qwen2vl_processor(base)}
    exec(code, scope)
    return scope["pipe"]


@pytest.mark.slow
@pytest.mark.full
def test_the_lora_export_loads_into_the_edit_pipeline_and_gives_the_trained_outputs(lora_runs, edit):
    from safetensors.torch import load_file

    from train.config import load_config
    from train.lora import add_lora

    run = lora_runs
    pipe = _run_printed(run["printed"], "LoRA adapters in", edit["model"])
    assert type(pipe).__name__ == "QwenImageEditPipeline" and pipe.get_list_adapters()
    trained = _base(edit)  # the base model with the last checkpoint's adapters: what training held
    add_lora(trained, load_config(run["cfg"]), targets=("to_q", "to_k", "to_v", "to_out.0"))
    params = dict(trained.named_parameters())
    with torch.no_grad():
        for name, tensor in load_file(run["out"] / "checkpoints" / "step-00000003" / "adapters.safetensors").items():
            params[name].copy_(tensor)
    loaded, held, base = (_output(edit, m) for m in (pipe.transformer, trained, _base(edit)))
    torch.testing.assert_close(loaded, held, rtol=1e-4, atol=1e-5)
    assert (loaded - base).abs().max() > 100 * (loaded - held).abs().max()  # the adapters do act


@pytest.mark.slow
@pytest.mark.full
def test_a_lora_run_resumes_exactly(lora_runs):
    assert_same_files(lora_runs["out"], lora_runs["resumed"], ("lora/pytorch_lora_weights.safetensors",
                                                               "lora_ema/pytorch_lora_weights.safetensors",
                                                               "checkpoints/step-00000003/ema.safetensors"))


@pytest.mark.slow
@pytest.mark.full
def test_a_full_fine_tune_loads_into_the_edit_pipeline_and_edits(edit, tmp_path):
    from PIL import Image

    cfg = write(tmp_path / "c.json")
    result, printed = train_quiet("--plan", edit["plan"], "--cache", edit["cache"], "--config", cfg,
                                     "--output-dir", tmp_path / "out", "--max-steps", 2)  # fmt: skip
    assert result.steps == 2
    pipe = _run_printed(printed, "load it into the base pipeline", edit["model"])
    trained = pipe.transformer.state_dict()
    assert any(not torch.equal(trained[k], v) for k, v in _base(edit).state_dict().items())
    reader, batches = _batches(edit)
    batch = batches[0]
    reference = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8))
    # a cached (instruction, reference) embedding, as a user edits without the text encoder
    image = pipe(image=reference, prompt_embeds=batch.text[:1], prompt_embeds_mask=batch.text_mask[:1],
                 true_cfg_scale=1.0, height=64, width=64, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images[0]  # fmt: skip
    assert image.shape == (64, 64, 3) and np.isfinite(image).all()


@pytest.mark.parametrize("lora", [True, False])
def test_what_one_80_gb_gpu_holds_is_checked_before_loading(tmp_path, monkeypatch, lora):
    import diffusers

    from tests.test_train_qwen import REAL
    from train.recipes.memory import MEMORY_ENV, check_fits

    name, config = REAL["qwen-image"]  # Qwen/Qwen-Image-Edit's transformer: the same class and config
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": name, **config}))
    monkeypatch.setenv(MEMORY_ENV, "80")
    with pytest.raises(UsageError, match=f"{FAMILY}: .* of its 20.43B-parameter QwenImageTransformer2DModel needs "
                                         f"{81.7 if lora else 326.9} GB per GPU"):  # fmt: skip
        check_fits(FAMILY, getattr(diffusers, name), str(tmp_path), TrainConfig(lora_rank=16 if lora else 0))
