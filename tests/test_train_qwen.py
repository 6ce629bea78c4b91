"""The qwen-image and z-image recipes on tiny random-weight pipelines of the real classes.

A module fixture embeds 6 images per family (the real embed job on Ray, from the tiny diffusers folders, with
a validation prompt) and plans them. Per family: one batch's loss recomputed by hand as the pipeline calls
its transformer (Qwen-Image: packed latents, ``img_shapes``, the text mask, the bucket's dynamic shift from
the pipeline's own ``calculate_shift``; Z-Image: per-image lists, ``1 - sigma``, the output negated), LoRA
runs whose export the family's pipeline loads with ``load_lora_weights`` (the code the trainer printed) and
then gives the trained model's outputs, a LoRA run stopped and resumed equal to a straight one, and a full
fine-tune's ``model/`` loaded into the pipeline, generating. The memory check refuses real-size models a GPU
cannot hold, from their configs alone (the GPU's memory faked by ``BUCKETEER_GPU_MEMORY_GB``).
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
from tests.embed_data import embed_cache, make_dataset
from tests.test_train_families import write
from train.config import TrainConfig
from train.data import BatchLoader, rank_steps

FAMILIES = ("qwen-image", "z-image")
RANK = 4


@pytest.fixture(scope="module")
def families(tmp_path_factory, ray_local) -> dict[str, dict[str, str]]:
    from pipeline import PlanJob, run
    from pipeline.embed.loading import quiet_loading
    from pipeline.embed.families.tiny import build_tiny

    quiet_loading()
    base = tmp_path_factory.mktemp("train-qwen")
    manifest, prompts = str(base / "manifest"), base / "prompts.txt"
    make_dataset(str(base / "data"), manifest, 6)  # buckets 64x64 (4 images), 128x32, 32x128
    prompts.write_text("a red cat\n")
    out = {}
    for family in FAMILIES:
        model, cache, plan = (str(build_tiny(family, base / family)), str(base / f"cache-{family}"),
                              str(base / f"plan-{family}"))
        embed_cache(manifest, cache, family=family, model=model, validation_prompts=str(prompts))
        run(PlanJob(manifests=(manifest,), out=plan, world_size=1, batch_size=2, epochs=3, cache=(cache,),
                    leftover="pad"))  # fmt: skip
        out[family] = {"model": model, "cache": cache, "plan": plan}
    return out


def _batches(f: dict[str, str]):
    reader = CacheReader(f["cache"])
    return reader, list(BatchLoader(reader, list(rank_steps(f["plan"], 0)), reader.meta.latent))


def _by_hand(family: str, model: torch.nn.Module, batch: Any, scheduler_config: dict, seed: tuple) -> torch.Tensor:
    """The loss of ``batch``, computed here with the pipeline's own pieces (see the module docstring)."""
    from diffusers import QwenImagePipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from train.model import step_generator

    generator = step_generator(*seed)
    x0 = batch.latents
    b, c, h, w = x0.shape
    u = compute_density_for_timestep_sampling("logit_normal", b, logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                              generator=generator)  # fmt: skip
    noise = torch.randn(x0.shape, generator=generator)
    if scheduler_config.get("use_dynamic_shifting"):  # as QwenImagePipeline.__call__ sets the bucket's schedule
        c_ = scheduler_config
        s = math.exp(calculate_shift((h // 2) * (w // 2), c_["base_image_seq_len"], c_["max_image_seq_len"],
                                     c_["base_shift"], c_["max_shift"]))  # fmt: skip
    else:
        s = scheduler_config["shift"]
    sigma = (s * u / (1 + (s - 1) * u)).view(b, 1, 1, 1)
    noisy = (1 - sigma) * x0 + sigma * noise
    if family == "qwen-image":
        mask = None if batch.text_mask.all() else batch.text_mask
        pred = model(hidden_states=QwenImagePipeline._pack_latents(noisy, b, c, h, w), timestep=sigma.flatten(),
                     encoder_hidden_states=batch.text, encoder_hidden_states_mask=mask,
                     img_shapes=[[(1, h // 2, w // 2)]] * b, return_dict=False)[0]  # fmt: skip
        target = QwenImagePipeline._pack_latents(noise - x0, b, c, h, w)
    else:
        feats = [t[m.bool()] for t, m in zip(batch.text, batch.text_mask)]
        out = model(list(noisy.unsqueeze(2).unbind(0)), 1 - sigma.flatten(), feats, return_dict=False)[0]
        pred, target = -torch.stack(out).squeeze(2), noise - x0
    return ((pred.float() - target) ** 2).mean()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.full
def test_the_loss_is_the_pipelines_forward_by_hand(families, family):
    from train.model import step_generator
    from train.recipes import recipe_for

    reader, batches = _batches(families[family])
    cfg = TrainConfig(family=family)
    denoiser = recipe_for(cfg, reader.meta).setup(cfg, reader.meta)
    model = denoiser.model
    scheduler = json.loads((Path(families[family]["model"]) / "scheduler" / "scheduler_config.json").read_text())
    padded = [b for b in batches if not b.text_mask.all()]
    assert padded, "a batch of captions of different lengths, so that the text mask matters"
    for batch in (batches[0], padded[0]):
        seed = (0, batch.epoch, batch.step, 0)
        loss = denoiser.loss(model, batch, step_generator(*seed))
        with torch.no_grad():
            assert torch.equal(loss.detach(), _by_hand(family, model, batch, scheduler, seed))
    loss.backward()
    text_in = model.txt_in.weight if family == "qwen-image" else model.cap_embedder[1].weight
    assert torch.isfinite(loss) and text_in.grad is not None and text_in.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def lora_runs(families, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Per family: a 3-step LoRA run (alpha 3x the rank, EMA on), and the same stopped after 2 steps and resumed."""
    base = tmp_path_factory.mktemp("qwen-lora")
    runs = {}
    for family in FAMILIES:
        f = families[family]
        cfg = write(base / f"{family}.json", lora_rank=RANK, lora_alpha=3 * RANK, lr=1e-2, ema_decay=0.9,
                    log_every=10)  # fmt: skip
        common = ["--plan", f["plan"], "--cache", f["cache"], "--config", cfg]
        out, resumed = base / family, base / f"{family}-resumed"
        result, printed = train_quiet(*common, "--output-dir", out, "--max-steps", 3)
        assert result.steps == 3, printed
        train_quiet(*common, "--output-dir", resumed, "--max-steps", 2)
        assert train_quiet(*common, "--output-dir", resumed, "--max-steps", 3, "--resume")[0].steps == 1
        runs[family] = {"out": out, "resumed": resumed, "printed": printed, "cfg": cfg}
    return runs


def _output(family: str, families, model: torch.nn.Module) -> torch.Tensor:
    """``model``'s output on the first batch of the plan, through the recipe's loss (fixed noise)."""
    from train.model import step_generator
    from train.recipes import recipe_for

    reader, batches = _batches(families[family])
    batch = batches[0]
    cfg = TrainConfig(family=family)
    recipe = recipe_for(cfg, reader.meta).setup(cfg, reader.meta)
    outputs = []
    hook = model.register_forward_hook(lambda module, args, out: outputs.append(out[0]))
    try:
        with torch.no_grad():
            recipe.loss(model, batch, step_generator(0, batch.epoch, batch.step, 0))
    finally:
        hook.remove()
    return torch.stack(outputs[0]) if isinstance(outputs[0], list) else outputs[0]


def _base(family: str, families) -> torch.nn.Module:
    from diffusers import QwenImageTransformer2DModel, ZImageTransformer2DModel

    cls = QwenImageTransformer2DModel if family == "qwen-image" else ZImageTransformer2DModel
    return cls.from_pretrained(families[family]["model"], subfolder="transformer")


def _trained(family: str, families, run: dict[str, Any]) -> torch.nn.Module:
    """The base model with the adapters of the run's last checkpoint, by parameter name: what training held."""
    from safetensors.torch import load_file

    from train.config import load_config
    from train.lora import add_lora

    model = _base(family, families)
    add_lora(model, load_config(run["cfg"]), targets=("to_q", "to_k", "to_v", "to_out.0"))
    saved = load_file(run["out"] / "checkpoints" / "step-00000003" / "adapters.safetensors")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.full
def test_the_lora_export_loads_into_the_pipeline_and_gives_the_trained_outputs(lora_runs, families, family):
    run = lora_runs[family]
    code = printed_code(run["printed"], "LoRA adapters in")
    assert f"pipe.load_lora_weights('{run['out'] / 'lora'}')" in code
    scope: dict[str, Any] = {}
    exec(code, scope)  # as printed: from_pretrained(base) + load_lora_weights
    pipe = scope["pipe"]
    assert type(pipe).__name__ == {"qwen-image": "QwenImagePipeline", "z-image": "ZImagePipeline"}[family]
    assert pipe.get_list_adapters(), "load_lora_weights loaded nothing"
    loaded = _output(family, families, pipe.transformer)
    trained = _output(family, families, _trained(family, families, run))
    base = _output(family, families, _base(family, families))
    torch.testing.assert_close(loaded, trained, rtol=1e-4, atol=1e-5)
    assert (loaded - base).abs().max() > 100 * (loaded - trained).abs().max()  # the adapters do act


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.full
def test_a_lora_run_resumes_exactly(lora_runs, family):
    run = lora_runs[family]
    assert_same_files(run["out"], run["resumed"], ("lora/pytorch_lora_weights.safetensors",
                                                   "lora_ema/pytorch_lora_weights.safetensors",
                                                   "checkpoints/step-00000003/ema.safetensors"))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.full
def test_a_full_fine_tune_loads_into_the_pipeline_and_generates(families, family, tmp_path):
    f = families[family]
    out = tmp_path / "out"
    cfg = write(tmp_path / "c.json", validation_every=2, validation_steps=2, validation_size=32)
    result, printed = train_quiet("--plan", f["plan"], "--cache", f["cache"], "--config", cfg, "--output-dir",
                                     out, "--max-steps", 2)  # fmt: skip
    assert result.steps == 2
    assert [p.name for p in (out / "validation" / "step-00000002").glob("*.png")] == ["00.png"]
    scope: dict[str, Any] = {}
    exec(printed_code(printed, "load it into the base pipeline"), scope)
    pipe = scope["pipe"]
    trained = pipe.transformer.state_dict()
    assert any(not torch.equal(trained[k], v) for k, v in _base(family, families).state_dict().items())
    kwargs = {"true_cfg_scale": 1.0} if family == "qwen-image" else {"guidance_scale": 0.0}
    image = pipe("a red cat", height=64, width=64, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0), **kwargs).images[0]  # fmt: skip
    assert image.shape == (64, 64, 3) and np.isfinite(image).all()


# ---- what one GPU holds ---------------------------------------------------------------------------

REAL = {  # the published transformer configs (Qwen/Qwen-Image, Tongyi-MAI/Z-Image-Turbo)
    "qwen-image": ("QwenImageTransformer2DModel", {"patch_size": 2, "in_channels": 64, "out_channels": 16,
                                                   "num_layers": 60, "attention_head_dim": 128,
                                                   "num_attention_heads": 24, "joint_attention_dim": 3584,
                                                   "axes_dims_rope": [16, 56, 56]}),
    "z-image": ("ZImageTransformer2DModel", {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16,
                                             "dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30,
                                             "n_kv_heads": 30, "cap_feat_dim": 2560, "axes_dims": [32, 48, 48],
                                             "axes_lens": [1536, 512, 512]}),
}  # fmt: skip


@pytest.mark.parametrize("family, params, lora_fits, full_fits", [("qwen-image", 20.43e9, False, False),
                                                                  ("z-image", 6.15e9, True, False)])
def test_what_one_80_gb_gpu_holds_is_checked_before_loading(tmp_path, monkeypatch, family, params, lora_fits,
                                                            full_fits):
    import diffusers

    from train.recipes.memory import MEMORY_ENV, check_fits, parameters

    name, config = REAL[family]
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": name, **config}))
    cls = getattr(diffusers, name)
    assert parameters(cls, str(tmp_path)) == pytest.approx(params, rel=0.005)  # counted on the meta device
    monkeypatch.setenv(MEMORY_ENV, "80")
    for cfg, fits in ((TrainConfig(lora_rank=16), lora_fits), (TrainConfig(), full_fits)):
        if fits:
            check_fits(family, cls, str(tmp_path), cfg)
            continue
        with pytest.raises(UsageError, match=f"{family}: .* needs .* GB per GPU before activations; this GPU has "
                                             "80.0 GB: shard it with FSDP"):  # fmt: skip
            check_fits(family, cls, str(tmp_path), cfg)
    with pytest.raises(UsageError) as refused:  # LoRA is suggested where its frozen weights fit
        check_fits(family, cls, str(tmp_path), TrainConfig())
    assert ("or train LoRA" in str(refused.value)) == lora_fits
    monkeypatch.setenv(MEMORY_ENV, "400")  # a figure that holds it: nothing to say
    check_fits(family, cls, str(tmp_path), TrainConfig())
