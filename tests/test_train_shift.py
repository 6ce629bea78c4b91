"""``timestep_shift``: training shifts its noise levels as the family's diffusers sampler does, per bucket.

Flux against ``FluxPipeline`` itself (a tiny random ``FluxTransformer2DModel``, the FLUX.1 scheduler
config): the sigmas the pipeline sampled a 1024² and a 512² image with are the training shift of those
buckets applied to the unshifted schedule, and the training draw is ``scheduler.time_shift(mu, 1, u)``
of its ``u``; SD3's fixed shift against its scheduler; the log line once per bucket; the config values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from manifests.errors import UsageError
from train.config import TrainConfig, load_config
from train.model import flow_sample, step_generator
from train.shift import TimestepShift, timestep_shift

# FLUX.1-dev's scheduler/scheduler_config.json (the dynamic-shifting keys)
FLUX_SCHEDULER = {"shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                  "base_image_seq_len": 256, "max_image_seq_len": 4096}  # fmt: skip
STEPS = 4


@pytest.fixture(scope="module")
def flux_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                         attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                         pooled_projection_dim=8, guidance_embeds=True, axes_dims_rope=(2, 2, 4))
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER), vae=None, text_encoder=None,
                        tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=transformer)  # fmt: skip


@pytest.mark.parametrize("side", [1024, 512])
def test_the_flux_shift_of_a_bucket_is_the_one_flux_pipeline_samples_it_with(flux_pipeline, side):
    pipe = flux_pipeline
    assert pipe.vae_scale_factor == 8  # no VAE: Flux's 8, so a side of 1024 pixels is 128 latents, 4096 tokens
    pipe(prompt_embeds=torch.zeros(1, 4, 16), pooled_prompt_embeds=torch.zeros(1, 8), height=side, width=side,
         num_inference_steps=STEPS, output_type="latent", generator=torch.Generator().manual_seed(0))  # fmt: skip
    sampled = pipe.scheduler.sigmas[:-1]  # the shifted schedule the pipeline stepped through (the last: 0)

    latent = side // 8
    shift = timestep_shift("auto", pipe.scheduler.config, patch=2)  # as the flux recipe makes it
    t = torch.from_numpy(np.linspace(1.0, 1 / STEPS, STEPS).astype(np.float32))  # the pipeline's unshifted sigmas
    s = shift.shift(latent, latent)
    torch.testing.assert_close(s * t / (1 + (s - 1) * t), sampled, rtol=1e-6, atol=1e-6)
    assert shift.mu(latent, latent) == pytest.approx(1.15 if side == 1024 else 0.5 + 0.65 * 768 / 3840)

    # the training draw: t from the config's density, shifted as the scheduler's dynamic shift (time_shift)
    from diffusers.training_utils import compute_density_for_timestep_sampling

    latents = torch.zeros(3, 16, latent, latent)
    draw = flow_sample(latents, step_generator(0, 0, 5, 0), shift=shift.for_bucket("b", latent, latent))
    u = compute_density_for_timestep_sampling("logit_normal", 3, logit_mean=0.0, logit_std=1.0,
                                              generator=step_generator(0, 0, 5, 0))  # fmt: skip
    expected = pipe.scheduler.time_shift(shift.mu(latent, latent), 1.0, u.double()).float()
    torch.testing.assert_close(draw.sigma.flatten(), expected, rtol=1e-6, atol=1e-6)


def test_sd3s_fixed_shift_is_its_schedulers():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # SD3's scheduler config
    t = np.linspace(1.0, 1 / STEPS, STEPS).tolist()
    scheduler.set_timesteps(sigmas=t)
    shift = timestep_shift("auto", scheduler.config, patch=2)
    assert shift.dynamic is None and shift.shift(128, 128) == shift.shift(64, 32) == 3.0
    draw = flow_sample(torch.zeros(STEPS, 1, 2, 2), torch.Generator(), shift=shift.shift(128, 128))
    u = torch.tensor(t)
    torch.testing.assert_close(3.0 * u / (1 + 2.0 * u), scheduler.sigmas[:-1])
    assert draw.sigma.shape == (STEPS, 1, 1, 1)
    # none: unshifted whatever the scheduler; a number: that shift, for a dynamic scheduler too
    assert timestep_shift("none", scheduler.config).shift(128, 128) == 1.0
    assert timestep_shift(2.5, FLUX_SCHEDULER, patch=2).shift(128, 128) == 2.5
    assert timestep_shift("auto", None).shift(128, 128) == 1.0  # no flow scheduler (PixArt from scratch)


def test_each_buckets_shift_is_logged_once():
    lines: list[str] = []
    shift = TimestepShift(dynamic=FLUX_SCHEDULER, patch=2, log=lines.append)
    for bucket, side in [("1024x1024", 128), ("1024x1024", 128), ("512x512", 64), ("1024x1024", 128)]:
        shift.for_bucket(bucket, side, side)
    assert lines == ["timestep shift: bucket 1024x1024 (4096 tokens): mu 1.1500, shift 3.1582",
                     "timestep shift: bucket 512x512 (1024 tokens): mu 0.6300, shift 1.8776"]  # fmt: skip
    fixed: list[str] = []
    TimestepShift(3.0, log=fixed.append).for_bucket("b", 8, 8)
    assert fixed == ["timestep shift: bucket b (64 tokens): shift 3.0000"]


def test_timestep_shift_config_values(tmp_path):
    assert TrainConfig().timestep_shift == "auto"
    path = tmp_path / "c.yaml"
    for text, value in [("auto", "auto"), ("none", "none"), ("3", 3.0), ("2.5", 2.5), ("'1.5'", 1.5)]:
        path.write_text(f"timestep_shift: {text}\n")
        assert load_config(path).timestep_shift == value
    for bad in ["fast", "0", "-1", "true"]:
        path.write_text(f"timestep_shift: {bad}\n")
        with pytest.raises(UsageError, match="timestep_shift must be auto, none or a number > 0"):
            load_config(path)
    with pytest.raises(UsageError, match="timestep_shift"):
        TrainConfig(timestep_shift="fast")


def test_a_fixed_shift_is_refused_for_ddpm_families():
    from train.shift import refuse_shift

    refuse_shift("auto", "sdxl")
    with pytest.raises(UsageError, match="sdxl trains with DDPM noise"):
        refuse_shift(3.0, "sdxl")


def test_a_cache_embedded_with_model_default_trains_from_that_same_tiny_model(tmp_path, monkeypatch):
    """``embed --model default`` records ``bucketeer:default-<family>-<version>``; the trainer starts from that
    tiny model's folder (built as embed builds it), and a config's ``pretrained`` still wins."""
    from types import SimpleNamespace

    from pipeline.embed.families.tiny import TINY_VERSION, tiny_dir
    from train.config import TrainConfig
    from train.recipes.base import pretrained_source

    monkeypatch.setenv("BUCKETEER_HOME", str(tmp_path))
    folder = tiny_dir("flux")
    folder.mkdir(parents=True)
    (folder / "README.txt").write_text("built")  # build_once: a complete build is not rebuilt
    meta = SimpleNamespace(family="flux", settings=SimpleNamespace(model=f"bucketeer:default-flux-{TINY_VERSION}"))
    assert pretrained_source(TrainConfig(family="flux"), meta) == str(folder)
    assert pretrained_source(TrainConfig(family="flux", pretrained="/my/flux"), meta) == "/my/flux"
    other = SimpleNamespace(family="flux", settings=SimpleNamespace(model="bucketeer:default-flux-v0"))
    assert pretrained_source(TrainConfig(family="flux"), other) == "bucketeer:default-flux-v0"  # not ours: as is
