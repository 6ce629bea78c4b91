"""The qwen-image-2.1 recipe on a tiny random-weight ``QwenImage21Pipeline`` of the real classes.

A module fixture embeds 6 images (the real embed job on Ray, from the tiny diffusers folder, with a validation
prompt) and plans them in batches of 2. The transformer's arguments are taken from ``QwenImage21Pipeline.__call__``
itself (a forward pre-hook on its transformer, one step, for the batch's two captions): the recipe builds the same
``img_shapes``, ``img_mask`` and text mask, its text rows equal the pipeline's ``encode_prompt`` of the batch (right
padded to the longer caption: the target image's RoPE frame position is that padded length), and one batch's loss
recomputed by hand with the pipeline's arguments equals the recipe's, also for a batch of two caption lengths.
LoRA runs export adapters that the pipeline's ``load_lora_weights`` loads (the code the trainer printed, the
processor passed in: no torchvision here), giving the trained model's outputs; a full fine-tune's ``model/`` loads
into the pipeline and generates. Real-size checks: the memory check, and the bytes of a record.
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
from manifests.errors import UsageError
from manifests.manifest import read_manifest
from tests.embed_data import family_plan, plan_batches
from tests.test_train_families import write
from tests.train_dataset import printed_code, recipe_outputs, train_quiet
from train.config import TrainConfig

MISSING = missing_classes("qwen-image-2.1")  # why this diffusers cannot run the family (None: it can)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

FAMILY = "qwen-image-2.1"
RANK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, ray_local) -> dict[str, str]:
    return family_plan(tmp_path_factory.mktemp("train-qwen21"), FAMILY)


def _batches(f: dict[str, str]):
    return plan_batches(f)


def _pipeline(model: str, **components):
    from diffusers import QwenImage21Pipeline

    from pipeline.embed.families.qwen_image21 import load_processor

    return QwenImage21Pipeline.from_pretrained(model, processor=load_processor(model), **components)


class _Called(Exception):
    pass


def _pipeline_arguments(pipe, captions: list[str], h: int, w: int) -> dict[str, Any]:
    """The transformer's keyword arguments in ``QwenImage21Pipeline.__call__`` for ``captions`` at latents (h, w)."""
    seen: dict[str, Any] = {}

    def grab(module, args, kwargs):
        seen.update(kwargs)
        raise _Called

    handle = pipe.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        pipe(prompt=captions, height=16 * h, width=16 * w, num_inference_steps=1, use_kv_cache=False,
             output_type="latent")  # fmt: skip
    except _Called:
        pass
    finally:
        handle.remove()
    return seen


def _by_hand(model: torch.nn.Module, batch: Any, called: dict[str, Any], scheduler: dict, seed: tuple,
             text: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The loss of ``batch`` with the pipeline's own transformer arguments ``called`` (``text``: its rows)."""
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from train.model import step_generator

    generator = step_generator(*seed)
    x0 = batch.latents
    b, c, h, w = x0.shape
    u = compute_density_for_timestep_sampling("logit_normal", b, logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                              generator=generator)  # fmt: skip
    noise = torch.randn(x0.shape, generator=generator)
    # as __call__ sets the bucket's schedule: mu of latents.shape[1] = h * w tokens (patch 1)
    s = math.exp(calculate_shift(h * w, scheduler["base_image_seq_len"], scheduler["max_image_seq_len"],
                                 scheduler["base_shift"], scheduler["max_shift"]))  # fmt: skip
    sigma = (s * u / (1 + (s - 1) * u)).view(b, 1, 1, 1)
    noisy = (1 - sigma) * x0 + sigma * noise
    flat = lambda t: t.flatten(2).transpose(1, 2)  # noqa: E731 # _pack_latents: (B, C, h, w) -> (B, h*w, C)
    pred = model(hidden_states=flat(noisy), timestep=sigma.flatten(), encoder_hidden_states=text,
                 encoder_hidden_states_mask=called["encoder_hidden_states_mask"], img_shapes=called["img_shapes"],
                 img_mask=called["img_mask"], return_dict=False)[0][:, -h * w:]  # fmt: skip
    return ((pred.float() - flat(noise - x0)) ** 2).mean()


@pytest.mark.slow
@pytest.mark.full
def test_the_loss_is_the_pipelines_transformer_call_by_hand(tiny):
    from train.model import step_generator
    from train.recipes import recipe_for
    from train.recipes.qwen_image21 import model_inputs

    reader, batches = _batches(tiny)
    cfg = TrainConfig(family=FAMILY)
    denoiser = recipe_for(cfg, reader.meta).setup(cfg, reader.meta)
    model = denoiser.model
    pipe = _pipeline(tiny["model"], transformer=model)
    scheduler = json.loads((Path(tiny["model"]) / "scheduler" / "scheduler_config.json").read_text())
    captions = {r["sample_id"]: r["caption"] or "" for r in read_manifest(tiny["manifest"]).samples.to_pylist()}
    padded = [b for b in batches if not b.text_mask.all()]
    assert padded, "a batch of captions of different lengths, so that the text mask and the padding matter"
    for batch in (batches[0], padded[0]):
        b, _, h, w = batch.latents.shape
        called = _pipeline_arguments(pipe, [captions[i] for i in batch.sample_ids], h, w)
        ours = model_inputs(batch.latents, batch.text, batch.text_mask)
        assert ours["img_shapes"] == called["img_shapes"] and torch.equal(ours["img_mask"], called["img_mask"])
        mask = called["encoder_hidden_states_mask"]  # None when nothing is padded, as encode_prompt drops it
        assert (mask is None) == (ours["encoder_hidden_states_mask"] is None) == bool(batch.text_mask.all())
        if mask is not None:  # right-padded to the longer caption: the same length, the same rows masked
            assert torch.equal(mask.bool(), batch.text_mask.bool())
        text = called["encoder_hidden_states"].to(torch.bfloat16).float()  # the cache holds bf16 rows
        assert text.shape == batch.text.shape
        if mask is None:  # the pipeline pads nothing: its rows, rounded, are the cache's
            assert torch.equal(text, batch.text)
        else:  # its encoder pads the shorter caption on the left: a bf16 ulp apart at most
            assert bool(((text - batch.text).abs() <= batch.text.abs() * 2**-7 + 1e-7).all())
        seed = (0, batch.epoch, batch.step, 0)
        loss = denoiser.loss(model, batch, step_generator(*seed))
        with torch.no_grad():  # bit for bit with the cached rows; with the pipeline's (padded batch): close
            assert torch.equal(loss.detach(), _by_hand(model, batch, called, scheduler, seed, batch.text))
            assert torch.allclose(loss.detach(), _by_hand(model, batch, called, scheduler, seed, text), rtol=1e-4)
    loss.backward()
    assert torch.isfinite(loss) and model.txt_in.in_layer.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.parameters()), "every parameter takes part (DDP needs it)"


@pytest.fixture(scope="module")
def lora_run(tiny, tmp_path_factory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("qwen21-lora")
    cfg = write(base / "lora.json", lora_rank=RANK, lora_alpha=3 * RANK, lr=1e-2, log_every=10)
    out = base / "out"
    result, printed = train_quiet("--plan", tiny["plan"], "--cache", tiny["cache"], "--config", cfg,
                                  "--output-dir", out, "--max-steps", 3)  # fmt: skip
    assert result.steps == 3, printed
    return {"out": out, "printed": printed, "cfg": cfg}


def _printed_pipeline(printed: str, after: str, base: str):
    """The pipeline the trainer's printed code loads, the processor passed in (no torchvision here)."""
    from pipeline.embed.families.qwen_image21 import load_processor

    code = printed_code(printed, after).replace(f".from_pretrained({base!r}",
                                                f".from_pretrained({base!r}, processor=processor")  # fmt: skip
    assert "processor=processor" in code
    scope: dict[str, Any] = {"processor": load_processor(base)}
    exec(code, scope)
    return scope["pipe"]


def _output(tiny, model: torch.nn.Module) -> torch.Tensor:
    """``model``'s output on the first batch of the plan, through the recipe's loss (fixed noise)."""
    from train.recipes import recipe_for

    reader, batches = _batches(tiny)
    cfg = TrainConfig(family=FAMILY)
    return recipe_outputs(recipe_for(cfg, reader.meta).setup(cfg, reader.meta), model, batches[0])


def _base(tiny) -> torch.nn.Module:
    from diffusers import QwenImage21Transformer2DModel

    return QwenImage21Transformer2DModel.from_pretrained(tiny["model"], subfolder="transformer")


@pytest.mark.slow
@pytest.mark.full
def test_the_lora_export_loads_into_the_pipeline_and_gives_the_trained_outputs(lora_run, tiny):
    from safetensors.torch import load_file

    from train.config import load_config
    from train.lora import add_lora

    run = lora_run
    assert f"pipe.load_lora_weights('{run['out'] / 'lora'}')" in printed_code(run["printed"], "LoRA adapters in")
    pipe = _printed_pipeline(run["printed"], "LoRA adapters in", tiny["model"])
    assert type(pipe).__name__ == "QwenImage21Pipeline" and pipe.get_list_adapters()
    trained = _base(tiny)  # the base with the run's last adapters, by parameter name: what training held
    add_lora(trained, load_config(run["cfg"]), targets=("to_q", "to_k", "to_v", "to_out.0"))
    params = dict(trained.named_parameters())
    with torch.no_grad():
        for name, tensor in load_file(run["out"] / "checkpoints" / "step-00000003" / "adapters.safetensors").items():
            params[name].copy_(tensor)
    loaded, want, base = (_output(tiny, m) for m in (pipe.transformer, trained, _base(tiny)))
    torch.testing.assert_close(loaded, want, rtol=1e-4, atol=1e-5)
    assert (loaded - base).abs().max() > 100 * (loaded - want).abs().max()  # the adapters do act


@pytest.mark.slow
@pytest.mark.full
def test_a_full_fine_tune_validates_loads_into_the_pipeline_and_generates(tiny, tmp_path):
    out = tmp_path / "out"
    cfg = write(tmp_path / "c.json", validation_every=2, validation_steps=2, validation_size=32)
    result, printed = train_quiet("--plan", tiny["plan"], "--cache", tiny["cache"], "--config", cfg, "--output-dir",
                                  out, "--max-steps", 2)  # fmt: skip
    assert result.steps == 2
    assert [p.name for p in (out / "validation" / "step-00000002").glob("*.png")] == ["00.png"]
    pipe = _printed_pipeline(printed, "load it into the base pipeline", tiny["model"])
    trained = pipe.transformer.state_dict()
    assert any(not torch.equal(trained[k], v) for k, v in _base(tiny).state_dict().items())
    image = pipe("a red cat", height=64, width=64, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images[0]  # fmt: skip
    assert image.shape == (64, 64, 4) and np.isfinite(image).all()  # the VAE decodes RGBA


def test_a_cache_of_another_vae_is_refused():
    from types import SimpleNamespace

    from train.recipes.qwen_image21 import setup

    qwen_image = SimpleNamespace(latent=SimpleNamespace(_extra={"normalised": {}}, factor=8, channels=16))
    with pytest.raises(UsageError, match="not Qwen-Image 2.1's"):  # Qwen-Image's 8x VAE, also stored normalised
        setup(TrainConfig(family=FAMILY), qwen_image)


# ---- real size ----------------------------------------------------------------------------------------------------


def _real_folder(tmp_path: Path) -> Path:
    from benchmarks.real_configs import QWEN3_VL_8B, QWEN_IMAGE21_TRANSFORMER, QWEN_IMAGE21_VAE

    for sub, cls, config in (("transformer", "QwenImage21Transformer2DModel", QWEN_IMAGE21_TRANSFORMER),
                             ("vae", "AutoencoderKLQwenImage21", QWEN_IMAGE21_VAE)):  # fmt: skip
        (tmp_path / sub).mkdir(parents=True)
        (tmp_path / sub / "config.json").write_text(json.dumps({"_class_name": cls, **config}))
    (tmp_path / "text_encoder").mkdir()
    (tmp_path / "text_encoder" / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", **QWEN3_VL_8B}))
    return tmp_path


def test_what_one_80_gb_gpu_holds_is_checked_before_loading(tmp_path, monkeypatch):
    from diffusers import QwenImage21Transformer2DModel

    from train.recipes.memory import MEMORY_ENV, check_fits, parameters

    source = str(_real_folder(tmp_path))
    params = parameters(QwenImage21Transformer2DModel, source)
    assert params == pytest.approx(7.12e9, rel=0.005)  # the README's "7B parameters", counted on the meta device
    monkeypatch.setenv(MEMORY_ENV, "80")
    check_fits(FAMILY, QwenImage21Transformer2DModel, source, TrainConfig(lora_rank=16))  # 28.5 GB frozen: fits
    with pytest.raises(UsageError, match=f"{FAMILY}: a full fine-tune .* needs 113.8 GB per GPU before "
                                         r"activations; this GPU has 80.0 GB: shard it with FSDP over >= 2 GPUs "
                                         r"\(accelerate config\), or train LoRA"):  # fmt: skip
        check_fits(FAMILY, QwenImage21Transformer2DModel, source, TrainConfig())


def test_the_bytes_of_a_record_at_real_size(tmp_path):
    """A 1024x1024 sample's latents and a caption's rows, in bf16, from the real configs alone (meta device)."""
    from transformers import AutoConfig

    from pipeline.embed.latents import LatentSpec, latent_shape
    from pipeline.embed.loading import EncoderSource

    folder = _real_folder(tmp_path)
    shape = latent_shape(LatentSpec(EncoderSource(str(folder), "vae")))
    assert (shape["factor"], shape["channels"]) == (16, 64)
    latent_bytes = shape["channels"] * (1024 // shape["factor"]) ** 2 * 2
    width = AutoConfig.from_pretrained(folder / "text_encoder").get_text_config().hidden_size
    rows = 3 + 40 + 5  # <|im_start|>user\n, a 40-token caption, the 5 closing tokens (system message dropped)
    assert (latent_bytes, width, rows * width * 2) == (524_288, 4096, 393_216)
    assert 1024 * width * 2 == 8_388_608  # the longest record: 1024 rows


# ---- bucketeer demo -----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
@pytest.mark.full
def test_demo_embeds_and_fine_tunes(tmp_path, bucketeer_home):
    """`bucketeer demo --family qwen-image-2.1`: generated images -> scan -> embed -> plan -> train (2 CPU processes,
    caption dropout, an EMA, validation images) -> verify -> report, with the tiny pipeline."""
    from tests.test_demo import run_demo

    out = tmp_path / "out"
    output, _ = run_demo(tmp_path, "--family", FAMILY, "--images", "40", "--out-dir", str(out))
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["embed"]["samples"] == figures["scan"]["samples"] == 40, output[-3000:]
    assert figures["train"]["steps"] >= 2 and figures["train"]["loss_last"] is not None
    cache = json.loads((out / "cache" / "_cache.json").read_text())
    assert cache["family"] == FAMILY and cache["text"]["layout"]["masked"] and "normalised" in cache["latent"]
    assert (out / "train" / "model" / "config.json").exists() and (out / "train" / "model_ema").is_dir()
    assert sorted(p.name for p in (out / "train" / "validation").glob("step-*/*.png")) == ["00.png", "01.png"]
