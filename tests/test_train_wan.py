"""The ``wan`` recipe in the one loop, on a tiny random ``WanPipeline`` and a small video cache (tests/wan_cache.py).

The loader hands out ``(B, C, F, h, w)`` latents normalised per channel; one batch's loss equals a hand
computation from the cached records with the same generator draws (Wan's UMT5 text zero-padded to 512, the
scheduler's ``flow_shift``); 2 steps resumed after 1 equal 2 straight; a full fine-tune's ``model/`` loads into
``WanPipeline`` as printed and its validation writes clips; the LoRA export loads with ``load_lora_weights`` and
gives the trained transformer's outputs; what the recipe does not train yet is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from manifests.cache import CacheReader
from manifests.cache.records import to_float32
from manifests.errors import UsageError
from tests.wan_cache import TEXT_TOKENS, WanData, build, latent_shape
from tests.train_dataset import logged_losses, recipe_outputs, train_quiet, write_settings
from train.config import TrainConfig
from train.data import BatchLoader, rank_steps


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> WanData:
    return build(tmp_path_factory.mktemp("wan-train"))


def _batches(data: WanData, **loader) -> list:
    reader = CacheReader(data.cache)
    return list(BatchLoader(reader, list(rank_steps(data.plan, 0)), reader.meta.latent, **loader))


def test_batches_are_video_latents_normalised_per_channel(wan):
    reader = CacheReader(wan.cache)
    latent = reader.meta.latent
    mean, std = np.asarray(latent.latents_mean, np.float32), np.asarray(latent.latents_std, np.float32)
    widened, stored = _batches(wan, widen=True), _batches(wan, widen=False)
    assert [b.bucket for b in widened][:3] == ["64x64x9", "64x64x9", "64x32x5"]
    for a, b in zip(widened, stored):
        assert a.latents.shape == (len(a.sample_ids), *latent_shape(a.bucket))  # (B, C, F, h, w)
        assert a.latent_positions == np.prod(a.latents.shape) // 16
        assert b.latents.dtype == torch.bfloat16 and torch.equal(a.latents, b.to("cpu").latents)  # the same values
        records = [r.variant(v) for r, v in zip(reader.read(a.sample_ids), a.variants)]
        z = np.stack([to_float32(r.latent, r.dtype) for r in records])
        want = (z - mean[:, None, None, None]) / std[:, None, None, None]
        np.testing.assert_allclose(a.latents.numpy(), want, rtol=1e-6, atol=1e-6)
    chosen = {tuple(b.variants)[b.sample_ids.index(1000)] for b in widened if 1000 in b.sample_ids}
    assert chosen == {0, 1}, "the long video's two clips are both trained over the epochs"


def test_the_loss_of_one_batch_equals_a_hand_computation(wan):
    """x0 = (z - mean) / std; u = sigmoid(N(0, 1)) and eps drawn in that order from the step's generator; sigma
    = 3u / (1 + 2u) (the tiny Wan scheduler's flow_shift 3); the transformer fed (1 - sigma) x0 + sigma eps, 1000
    sigma and the caption's tokens zero-padded to 512 rows; the loss the mean squared error to eps - x0."""
    from train.model import step_generator
    from train.recipes import recipe_for

    reader = CacheReader(wan.cache)
    batch = _batches(wan)[0]
    cfg = TrainConfig()
    denoiser = recipe_for(cfg, reader.meta).setup(cfg, reader.meta)
    assert denoiser.pipeline_class == "WanPipeline" and denoiser.tokens_per_position == 1 / 4
    assert json.loads((Path(wan.model) / "scheduler" / "scheduler_config.json").read_text())["flow_shift"] == 3.0
    with torch.no_grad():
        loss = denoiser.loss(denoiser.model, batch, step_generator(0, batch.epoch, batch.step, 0))

    latent = reader.meta.latent
    records = [r.variant(v) for r, v in zip(reader.read(batch.sample_ids), batch.variants)]
    z = torch.from_numpy(np.stack([to_float32(r.latent, r.dtype) for r in records]))  # (B, C, F, h, w)
    mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (latent.latents_mean, latent.latents_std))
    x0 = (z - mean) / std
    b = len(records)
    text = torch.zeros(b, TEXT_TOKENS, 64)
    for i, r in enumerate(records):
        tokens = torch.from_numpy(to_float32(r.text.tokens[0], r.text.dtype))
        text[i, : len(tokens)] = tokens
    generator = step_generator(0, batch.epoch, batch.step, 0)
    u = torch.sigmoid(torch.normal(0.0, 1.0, size=(b,), generator=generator))
    eps = torch.randn(x0.shape, generator=generator)
    sigma = (3.0 * u / (1 + 2.0 * u)).view(b, 1, 1, 1, 1)
    with torch.no_grad():
        pred = denoiser.model(hidden_states=(1 - sigma) * x0 + sigma * eps, timestep=1000.0 * sigma.flatten(),
                              encoder_hidden_states=text, return_dict=False)[0]  # fmt: skip
    want = ((pred - (eps - x0)) ** 2).mean()
    assert torch.isfinite(want)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


def test_the_shift_is_the_schedulers_flow_shift_and_bf16_weights_train_on_float32_batches(wan):
    """timestep_shift auto: UniPC's flow_shift (Wan 2.1 480p: 3, 720p: 5), FlowMatch's shift. DeepSpeed bf16 casts
    the weights and autocasts nothing: the recipe hands the model its inputs in the weights' dtype."""
    from train.model import step_generator
    from train.recipes import recipe_for
    from train.shift import timestep_shift

    assert timestep_shift("auto", {"flow_shift": 5.0, "use_flow_sigmas": True}).shift(60, 104) == 5.0
    assert timestep_shift("auto", {"shift": 3.0}).shift(60, 104) == 3.0
    reader = CacheReader(wan.cache)
    batch = _batches(wan)[0]
    denoiser = recipe_for(TrainConfig(), reader.meta).setup(TrainConfig(), reader.meta)
    weights = denoiser.model.to(torch.bfloat16)
    loss = denoiser.loss(weights, batch, step_generator(0, batch.epoch, batch.step, 0))
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(p.grad is None or p.grad.dtype == torch.bfloat16 for p in weights.parameters())


@pytest.mark.slow
def test_two_steps_resume_exactly_and_a_full_fine_tune_loads_into_the_pipeline(wan, tmp_path):
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    cfg = write_settings(tmp_path / "c.json", validation_every=2, validation_steps=2, validation_size=32,
                 validation_frames=5)  # fmt: skip
    common = ["--plan", wan.plan, "--cache", wan.cache, "--config", cfg]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result, printed = train_quiet(*common, "--output-dir", straight, "--max-steps", 2)
    assert result.steps == 2
    assert train_quiet(*common, "--output-dir", resumed, "--max-steps", 1)[0].steps == 1
    assert train_quiet(*common, "--output-dir", resumed, "--max-steps", 2, "--resume")[0].steps == 1
    assert logged_losses(straight) == logged_losses(resumed) and len(logged_losses(straight)) == 2
    weights = "model/diffusion_pytorch_model.safetensors"
    a, b = load_file(straight / weights), load_file(resumed / weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # validation at step 2: a clip per prompt, its first/middle/last frames side by side
    from PIL import Image

    step = straight / "validation" / "step-00000002"
    assert sorted(p.name for p in step.iterdir()) == ["00.mp4", "00.png", "01.mp4", "01.png"]
    assert Image.open(step / "00.png").size == (3 * 32, 32)
    import av

    with av.open(str(step / "00.mp4")) as clip:
        frames = [f.to_ndarray(format="rgb24") for f in clip.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3)

    # the trained transformer, as the run printed: WanTransformer3DModel.from_pretrained into WanPipeline
    trained = WanTransformer3DModel.from_pretrained(straight / "model")
    base = WanTransformer3DModel.from_pretrained(wan.model, subfolder="transformer")
    assert any(not torch.equal(p, q) for p, q in zip(trained.parameters(), base.parameters()))
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if "load it into the base pipeline" in line) + 1
    code = "\n".join(line[4:] for line in lines[start : start + 3])
    assert "WanTransformer3DModel.from_pretrained" in code and "WanPipeline.from_pretrained" in code
    scope: dict[str, Any] = {}
    exec(code, scope)
    video = scope["pipe"]("a red cat", height=32, width=32, num_frames=5, num_inference_steps=2,
                          generator=torch.Generator().manual_seed(0), output_type="np").frames[0]  # fmt: skip
    assert video.shape == (5, 32, 32, 3) and np.isfinite(video).all()


@pytest.mark.slow
def test_the_lora_export_loads_into_wan_pipeline_and_gives_the_trained_outputs(wan, tmp_path):
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    from train.config import load_config
    from train.lora import add_lora
    from train.recipes import recipe_for

    cfg = write_settings(tmp_path / "lora.json", lora_rank=4, lora_alpha=8, lr=1e-2)
    out = tmp_path / "out"
    result, printed = train_quiet("--plan", wan.plan, "--cache", wan.cache, "--config", cfg, "--output-dir", out,
                             "--max-steps", 3)  # fmt: skip
    assert result.steps == 3 and "pipe.load_lora_weights" in printed
    record = json.loads((out / "lora" / "lora.json").read_text())
    assert (record["family"], record["pipeline"], record["rank"], record["alpha"]) == ("wan", "WanPipeline", 4, 8)

    reader = CacheReader(wan.cache)
    batch = _batches(wan)[0]
    denoiser = recipe_for(TrainConfig(), reader.meta).setup(TrainConfig(), reader.meta)
    base = recipe_outputs(denoiser, denoiser.model, batch)
    trained = denoiser.model  # the base with the adapters of the last checkpoint, by parameter name
    add_lora(trained, load_config(cfg), targets=denoiser.lora_targets)
    saved = load_file(out / "checkpoints" / "step-00000003" / "adapters.safetensors")
    params = dict(trained.named_parameters())
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor)
    want = recipe_outputs(denoiser, trained, batch)

    pipe = WanPipeline.from_pretrained(wan.model)
    pipe.load_lora_weights(str(out / "lora"))
    assert pipe.get_list_adapters(), "load_lora_weights loaded nothing"
    loaded = recipe_outputs(denoiser, pipe.transformer, batch)
    torch.testing.assert_close(loaded, want, rtol=1e-4, atol=1e-5)
    assert (loaded - base).abs().max() > 100 * (loaded - want).abs().max()  # the adapters do act


@pytest.mark.parametrize("setting, message", [
    ({"masked_loss": {"weight_outside": 0.0}}, "config masked_loss: the wan recipe does not weight video latents"),
    ({"repa": {"weight": 0.5, "depth": 1}}, "config repa: the wan recipe has no REPA for video latents yet"),
])  # fmt: skip
def test_what_the_recipe_does_not_train_yet_is_one_line(wan, tmp_path, capsys, setting, message):
    from tests.train_dataset import train_cli

    cfg = write_settings(tmp_path / "c.json", **setting)
    code = train_cli("--plan", wan.plan, "--cache", wan.cache, "--config", cfg, "--output-dir", tmp_path / "out")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {message}"), err


def test_an_image_cache_odd_latents_and_bad_validation_frames_are_refused(wan):
    import dataclasses

    from train.recipes import recipe_for
    from train.validation import validation_frames

    meta = CacheReader(wan.cache).meta
    image = dataclasses.replace(meta, latent=dataclasses.replace(meta.latent, temporal_factor=None))
    with pytest.raises(UsageError, match="the cache holds no video latents"):
        recipe_for(TrainConfig(), image).setup(TrainConfig(), image)
    batch = _batches(wan)[0]
    denoiser = recipe_for(TrainConfig(), meta).setup(TrainConfig(), meta)
    odd = dataclasses.replace(batch, latents=batch.latents[..., :7])  # (B, C, F, 8, 7): no 2x2 patches
    with pytest.raises(UsageError, match="bucket 64x64x9: latents of 3x8x7 .* multiple of 16 pixels"):
        denoiser.loss(denoiser.model, odd, torch.Generator())
    assert validation_frames(TrainConfig(), meta) == 17 and validation_frames(TrainConfig(), image) is None
    with pytest.raises(UsageError, match="validation_frames 8: the cache's video VAE decodes 1 \\+ 4k frames"):
        validation_frames(TrainConfig(validation_frames=8), meta)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.full
def test_two_processes_train_wan_and_resume_elastically_on_one(wan, tmp_path):
    import subprocess

    from tests.test_train_dist import command, environment

    cfg = write_settings(tmp_path / "c.json", lora_rank=4, lr=1e-2, caption_dropout=0.2)
    out = tmp_path / "out"
    proc = subprocess.run(command(2, "--plan", wan.plan2, "--cache", wan.cache, "--config", cfg, "--output-dir", out,
                                  "--max-steps", 2), env=environment(), capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: --max-steps 2 reached" in proc.stdout + proc.stderr
    losses = logged_losses(out)
    assert len(losses) == 2 and np.isfinite(losses).all()
    result, _ = train_quiet("--plan", wan.plan2, "--cache", wan.cache, "--config", cfg, "--output-dir", out,
                       "--max-steps", 4, "--resume")  # fmt: skip
    assert (result.steps, result.position) == (2, 4) and (out / "plans" / "resume-00000002-w1").is_dir()
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
