"""The longcat-image recipe on the tiny random-weight ``LongCatImagePipeline`` of the real classes.

A module fixture embeds 6 images (the real embed job on Ray, from the tiny diffusers folder, with a validation
prompt) and plans them. A batch's loss equals a hand computation of the transformer call ``LongCatImagePipeline.
__call__`` makes (packed latents, the 512 cached rows with no mask, ``prepare_pos_ids`` text ids and image ids of
modality 1 from (512, 512), ``guidance=None``, timestep ``sigma`` shifted by the pipeline's own ``calculate_shift`` of
the bucket), on latents the loader normalised as FLUX.1's VAE wants; every parameter gets a gradient (DDP). The
pipeline has no ``load_lora_weights``: a LoRA run's export loads with ``pipe.transformer.load_lora_adapter`` as the
run prints it and gives the trained outputs; a full fine-tune writes validation images and loads into the pipeline,
which generates. The memory check sizes the published transformer (6.27B) from its config alone. ``bucketeer demo
--family longcat-image`` runs end to end.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.embed.families.base import missing_classes
from manifests.cache import CacheReader
from manifests.cache.records import to_float32
from manifests.errors import UsageError
from tests.embed_data import family_plan
from tests.test_train_wan22 import _trained_with_adapters
from tests.train_dataset import printed_code, recipe_outputs, train_quiet, write_settings
from train.config import TrainConfig
from train.data import BatchLoader, rank_steps

MISSING = missing_classes("longcat-image")  # why this diffusers cannot run the family (None: it can)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

FAMILY = "longcat-image"


@pytest.fixture(scope="module")
def data(tmp_path_factory, ray_local) -> dict[str, str]:
    return family_plan(tmp_path_factory.mktemp("train-longcat"), FAMILY, 'a sign saying "HELLO"\n')


def _setup(data: dict[str, str], **config):
    from train.recipes import recipe_for

    meta = CacheReader(data["cache"]).meta
    cfg = TrainConfig(**config)
    return recipe_for(cfg, meta).setup(cfg, meta)


def _batches(data: dict[str, str]):
    reader = CacheReader(data["cache"])
    return list(BatchLoader(reader, list(rank_steps(data["plan"], 0)), reader.meta.latent))


def _by_hand(model: torch.nn.Module, batch: Any, scheduler: dict, seed: tuple) -> torch.Tensor:
    """The loss of ``batch``, computed here with the pipeline's own pieces (see the module docstring)."""
    from diffusers import LongCatImagePipeline
    from diffusers.pipelines.longcat_image.pipeline_longcat_image import calculate_shift, prepare_pos_ids
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from train.model import step_generator

    generator = step_generator(*seed)
    x0 = batch.latents
    b, c, h, w = x0.shape
    u = compute_density_for_timestep_sampling("logit_normal", b, logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                              generator=generator)  # fmt: skip
    noise = torch.randn(x0.shape, generator=generator)
    s = math.exp(calculate_shift((h // 2) * (w // 2), scheduler["base_image_seq_len"], scheduler["max_image_seq_len"],
                                 scheduler["base_shift"], scheduler["max_shift"]))  # as __call__ sets the schedule
    sigma = (s * u / (1 + (s - 1) * u)).view(b, 1, 1, 1)
    noisy = (1 - sigma) * x0 + sigma * noise
    pred = model(hidden_states=LongCatImagePipeline._pack_latents(noisy, b, c, h, w), timestep=sigma.flatten(),
                 guidance=None, encoder_hidden_states=batch.text,
                 txt_ids=prepare_pos_ids(modality_id=0, type="text", start=(0, 0), num_token=512),
                 img_ids=prepare_pos_ids(modality_id=1, type="image", start=(512, 512), height=h // 2, width=w // 2),
                 return_dict=False)[0]  # fmt: skip
    return ((pred.float() - LongCatImagePipeline._pack_latents(noise - x0, b, c, h, w)) ** 2).mean()


@pytest.mark.slow
def test_the_loss_is_the_pipelines_transformer_call_by_hand(data):
    from train.model import step_generator

    denoiser = _setup(data)
    assert (denoiser.pipeline_class, denoiser.component, denoiser.lora) == ("LongCatImagePipeline", "transformer",
                                                                          True)  # fmt: skip
    scheduler = json.loads((Path(data["model"]) / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["use_dynamic_shifting"]
    reader = CacheReader(data["cache"])
    vae = reader.meta.latent
    batches = _batches(data)
    for batch in batches[:2]:
        records = reader.read(batch.sample_ids)
        stored = torch.from_numpy(np.stack([to_float32(r.latent, r.dtype) for r in records]))
        assert torch.equal(batch.latents, (stored - vae.shift_factor) * vae.scaling_factor)  # FLUX.1's normalisation
        text = torch.from_numpy(np.stack([to_float32(r.text.tokens[0], r.text.dtype) for r in records]))
        assert batch.text.shape[1] == 512 and torch.equal(batch.text, text)  # every row, pads included
        seed = (0, batch.epoch, batch.step, 0)
        loss = denoiser.loss(denoiser.model, batch, step_generator(*seed))
        with torch.no_grad():
            assert torch.equal(loss.detach(), _by_hand(denoiser.model, batch, scheduler, seed))
    loss.backward()  # a full fine-tune under DDP needs a gradient on every parameter
    assert torch.isfinite(loss) and all(p.grad is not None for p in denoiser.model.parameters())
    assert denoiser.model.context_embedder.weight.grad.abs().sum() > 0


def test_a_cache_of_another_layout_is_refused(data, tmp_path):
    from dataclasses import replace

    from train.recipes import longcat_image

    meta = CacheReader(data["cache"]).meta
    masked = replace(meta, text=replace(meta.text, layout=replace(meta.text_layout, masked=True)))
    with pytest.raises(UsageError, match="not LongCat-Image's 512 rows: embed with `bucketeer embed --family "
                                         "longcat-image"):  # fmt: skip
        longcat_image.setup(TrainConfig(), masked)


@pytest.mark.slow
def test_the_lora_export_loads_with_load_lora_adapter_and_gives_the_trained_outputs(data, tmp_path):
    """No load_lora_weights on LongCatImagePipeline (diffusers 0.42.1): the printed lines load the export into
    pipe.transformer with PeftAdapterMixin.load_lora_adapter; validation images are written at the last step."""
    from diffusers import LongCatImagePipeline

    assert not hasattr(LongCatImagePipeline, "load_lora_weights")
    cfg = write_settings(tmp_path / "lora.json", lora_rank=4, lora_alpha=8, lr=1e-2, validation_every=3,
                         validation_steps=2, validation_size=64)  # fmt: skip
    out = tmp_path / "out"
    result, printed = train_quiet("--plan", data["plan"], "--cache", data["cache"], "--config", cfg, "--output-dir",
                                  out, "--max-steps", 3)  # fmt: skip
    assert result.steps == 3
    record = json.loads((out / "lora" / "lora.json").read_text())
    assert (record["family"], record["pipeline"], record["component"]) == (FAMILY, "LongCatImagePipeline",
                                                                          "transformer")  # fmt: skip
    assert [p.name for p in (out / "validation" / "step-00000003").glob("*.png")] == ["00.png"]
    code = printed_code(printed, "load them into the base pipeline")
    assert "pipe.transformer.load_lora_adapter(" in code, code

    batch = _batches(data)[0]
    denoiser = _setup(data)
    base = recipe_outputs(denoiser, denoiser.model, batch)
    want = recipe_outputs(denoiser, _trained_with_adapters(denoiser, cfg, out / "checkpoints" / "step-00000003"),
                          batch)  # fmt: skip
    scope: dict[str, Any] = {}
    exec(code, scope)  # the printed lines: from_pretrained(base), pipe.transformer.load_lora_adapter(...)
    pipe = scope["pipe"]
    assert isinstance(pipe, LongCatImagePipeline) and pipe.transformer.peft_config, "nothing loaded"
    loaded = recipe_outputs(denoiser, pipe.transformer, batch)
    torch.testing.assert_close(loaded, want, rtol=1e-4, atol=1e-5)
    assert (loaded - base).abs().max() > 100 * (loaded - want).abs().max()  # the adapters do act


@pytest.mark.slow
def test_a_full_fine_tune_loads_into_the_pipeline_and_generates(data, tmp_path):
    out = tmp_path / "out"
    cfg = write_settings(tmp_path / "c.json", validation_every=2, validation_steps=2, validation_size=32)
    result, printed = train_quiet("--plan", data["plan"], "--cache", data["cache"], "--config", cfg, "--output-dir",
                                  out, "--max-steps", 2)  # fmt: skip
    assert result.steps == 2
    assert [p.name for p in (out / "validation" / "step-00000002").glob("*.png")] == ["00.png"]
    scope: dict[str, Any] = {}
    exec(printed_code(printed, "load it into the base pipeline"), scope)
    pipe = scope["pipe"]
    image = pipe('a sign saying "HELLO"', height=64, width=64, num_inference_steps=2, guidance_scale=4.5,
                 enable_prompt_rewrite=False, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images[0]  # fmt: skip
    assert image.shape == (64, 64, 3) and np.isfinite(image).all()


def test_what_one_80_gb_gpu_holds_is_checked_before_loading(tmp_path, monkeypatch):
    """The published transformer (benchmarks/real_configs.py LONGCAT_IMAGE): 6.27B parameters; LoRA's frozen fp32
    weights fit 80 GB, a full fine-tune's 16 bytes per parameter do not (LoRA is suggested)."""
    import diffusers

    from benchmarks.real_configs import LONGCAT_IMAGE
    from train.recipes.memory import MEMORY_ENV, check_fits, parameters

    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": "LongCatImageTransformer2DModel",
                                                                      **LONGCAT_IMAGE}))  # fmt: skip
    cls = diffusers.LongCatImageTransformer2DModel
    assert parameters(cls, str(tmp_path)) == pytest.approx(6.27e9, rel=0.005)  # counted on the meta device
    monkeypatch.setenv(MEMORY_ENV, "80")
    check_fits(FAMILY, cls, str(tmp_path), TrainConfig(lora_rank=16))
    with pytest.raises(UsageError, match=f"{FAMILY}: .* needs .* GB per GPU before activations; this GPU has 80.0 GB: "
                                         "shard it with FSDP .*or train LoRA"):  # fmt: skip
        check_fits(FAMILY, cls, str(tmp_path), TrainConfig())


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
@pytest.mark.full
def test_demo_longcat_image_embeds_and_fine_tunes(tmp_path, bucketeer_home):
    """`bucketeer demo --family longcat-image`: generated images -> scan -> embed -> plan -> train (2 CPU processes,
    EMA, caption dropout, validation images) -> verify -> report, with the tiny pipeline."""
    from tests.test_demo import run_demo

    out = tmp_path / "out"
    output, _ = run_demo(tmp_path, "--family", FAMILY, "--images", "40", "--out-dir", str(out))
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["embed"]["samples"] == figures["scan"]["samples"] == 40, output[-3000:]
    assert figures["train"]["steps"] >= 2 and figures["train"]["loss_last"] is not None
    cache = json.loads((out / "cache" / "_cache.json").read_text())
    assert cache["family"] == FAMILY and not cache["text"]["layout"]["masked"]
    assert cache["text"]["layout"]["lengths"] == [512] and cache["latent"]["shift_factor"] == 0.1159
    assert (out / "train" / "model" / "config.json").exists() and (out / "train" / "model_ema").is_dir()
    assert sorted(p.name for p in (out / "train" / "validation").glob("step-*/*.png")) == ["00.png", "01.png"]
