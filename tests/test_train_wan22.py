"""The Wan 2.2 recipes in the one loop: ``wan2.2-a14b`` (one expert per run) and ``wan2.2-ti2v-5b``.

Tiny random pipelines (:mod:`pipeline.embed.families.tiny_wan22`) and small video caches (tests/wan_cache.py).
A14B: ``expert: high`` trains ``transformer`` and feeds it only timesteps ``>= boundary_ratio * 1000`` (875),
``expert: low`` trains ``transformer_2`` below 875; a batch's loss equals a hand computation (the shifted draw
mapped linearly into the expert's range). TI2V-5B: the transformer gets one timestep per latent token, as
``WanPipeline(expand_timesteps=True)`` gives it. LoRA exports load with ``load_lora_weights`` (the low expert's
with ``load_into_transformer_2=True``, as the run prints) and give the trained outputs; what does not fit is
refused in one line.
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
from tests.train_dataset import printed_code, recipe_outputs, train_quiet, write_settings
from train.config import TrainConfig
from train.data import BatchLoader, rank_steps

BOUNDARY = 0.875  # the tiny A14B folder's boundary_ratio (Wan2.2-T2V-A14B's)


@pytest.fixture(scope="module")
def a14b(tmp_path_factory) -> WanData:
    return build(tmp_path_factory.mktemp("wan22-a14b"), "wan2.2-a14b")


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory) -> WanData:
    return build(tmp_path_factory.mktemp("wan22-ti2v"), "wan2.2-ti2v-5b")


def _batches(data: WanData) -> list:
    reader = CacheReader(data.cache)
    return list(BatchLoader(reader, list(rank_steps(data.plan, 0)), reader.meta.latent))


def _setup(data: WanData, **config):
    from train.recipes import recipe_for

    meta = CacheReader(data.cache).meta
    cfg = TrainConfig(**config)
    return recipe_for(cfg, meta).setup(cfg, meta)


def _inputs(data: WanData, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x0, text)`` of ``batch`` by hand from the cached records: latents normalised per channel, the
    caption's tokens zero-padded to 512 rows."""
    reader = CacheReader(data.cache)
    latent = reader.meta.latent
    records = [r.variant(v) for r, v in zip(reader.read(batch.sample_ids), batch.variants)]
    z = torch.from_numpy(np.stack([to_float32(r.latent, r.dtype) for r in records]))  # (B, C, F, h, w)
    mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (latent.latents_mean, latent.latents_std))
    text = torch.zeros(len(records), TEXT_TOKENS, 64)
    for i, r in enumerate(records):
        tokens = torch.from_numpy(to_float32(r.text.tokens[0], r.text.dtype))
        text[i, : len(tokens)] = tokens
    return (z - mean) * (1.0 / std), text


def _timesteps(denoiser, batch, draws: int) -> torch.Tensor:
    """The timesteps the recipe feeds its model over ``draws`` plan positions of ``batch``."""
    from train.model import step_generator

    seen = []
    hook = denoiser.model.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["timestep"]), with_kwargs=True)
    try:
        with torch.no_grad():
            for step in range(draws):
                denoiser.loss(denoiser.model, batch, step_generator(0, 0, step, 0))
    finally:
        hook.remove()
    return torch.cat([t.flatten() for t in seen])


@pytest.mark.parametrize("expert, subfolder", [("high", "transformer"), ("low", "transformer_2")])
def test_each_expert_is_its_own_transformer_and_trains_on_its_own_timesteps(a14b, expert, subfolder):
    """sigma = 3u / (1 + 2u) (flow_shift 3), u = sigmoid(N(0, 1)), then mapped into the expert's range: high
    0.875 + 0.125 sigma, low 0.875 sigma; the transformer fed (1 - sigma) x0 + sigma eps at 1000 sigma."""
    from diffusers import WanTransformer3DModel

    from train.model import step_generator

    denoiser = _setup(a14b, expert=expert)
    assert (denoiser.component, denoiser.pipeline_class) == (subfolder, "WanPipeline")
    folder = WanTransformer3DModel.from_pretrained(a14b.model, subfolder=subfolder)
    assert all(torch.equal(p, q) for p, q in zip(denoiser.model.parameters(), folder.parameters()))
    batch = _batches(a14b)[0]
    t = _timesteps(denoiser, batch, 40)
    if expert == "high":  # the pipeline runs transformer for t >= boundary_ratio * num_train_timesteps
        assert t.min() >= 875.0 and t.max() <= 1000.0
    else:
        assert t.min() >= 0.0 and t.max() < 875.0
    assert t.max() - t.min() > 0.3 * (125.0 if expert == "high" else 875.0)  # spread over the range

    with torch.no_grad():
        loss = denoiser.loss(denoiser.model, batch, step_generator(0, batch.epoch, batch.step, 0))
    x0, text = _inputs(a14b, batch)
    b = len(x0)
    generator = step_generator(0, batch.epoch, batch.step, 0)
    u = torch.sigmoid(torch.normal(0.0, 1.0, size=(b,), generator=generator))
    eps = torch.randn(x0.shape, generator=generator)
    shifted = (3.0 * u / (1 + 2.0 * u)).view(b, 1, 1, 1, 1)
    sigma = BOUNDARY + (1 - BOUNDARY) * shifted if expert == "high" else BOUNDARY * shifted
    with torch.no_grad():
        pred = folder(hidden_states=(1 - sigma) * x0 + sigma * eps, timestep=1000.0 * sigma.flatten(),
                      encoder_hidden_states=text, return_dict=False)[0]  # fmt: skip
    torch.testing.assert_close(loss, ((pred - (eps - x0)) ** 2).mean(), rtol=1e-5, atol=1e-6)


def test_ti2v_feeds_one_timestep_per_latent_token_as_its_pipeline_does(ti2v):
    """expand_timesteps: timestep (B, F h w / 4), every token of a sample at its 1000 sigma (flow_shift 5)."""
    from train.model import step_generator

    denoiser = _setup(ti2v)
    assert denoiser.component == "transformer" and denoiser.tokens_per_position == 1 / 4
    batch = _batches(ti2v)[0]
    assert batch.latents.shape[1:] == latent_shape(batch.bucket, "wan2.2-ti2v-5b")  # (48, F, h, w)
    with torch.no_grad():
        loss = denoiser.loss(denoiser.model, batch, step_generator(0, batch.epoch, batch.step, 0))
    x0, text = _inputs(ti2v, batch)
    b, _, f, h, w = x0.shape
    generator = step_generator(0, batch.epoch, batch.step, 0)
    u = torch.sigmoid(torch.normal(0.0, 1.0, size=(b,), generator=generator))
    eps = torch.randn(x0.shape, generator=generator)
    sigma = (5.0 * u / (1 + 4.0 * u)).view(b, 1, 1, 1, 1)
    timestep = (1000.0 * sigma.flatten())[:, None].expand(b, f * (h // 2) * (w // 2))
    with torch.no_grad():
        pred = denoiser.model(hidden_states=(1 - sigma) * x0 + sigma * eps, timestep=timestep,
                              encoder_hidden_states=text, return_dict=False)[0]  # fmt: skip
    torch.testing.assert_close(loss, ((pred - (eps - x0)) ** 2).mean(), rtol=1e-5, atol=1e-6)


def test_what_does_not_fit_the_family_is_refused_in_one_line(a14b, ti2v):
    with pytest.raises(UsageError, match="family wan2.2-a14b trains one of its two experts per run: set expert"):
        _setup(a14b)
    with pytest.raises(UsageError, match="config expert: high: family wan2.2-ti2v-5b has one transformer"):
        _setup(ti2v, expert="high")
    with pytest.raises(UsageError, match="config: expert must be one of"):
        TrainConfig(expert="middle")
    with pytest.raises(UsageError, match="expert: both: a run trains one of .* two runs on the same cache and plan"):
        TrainConfig(expert="both")
    with pytest.raises(UsageError, match=r"is a wan2.2-ti2v-5b pipeline .* the cache's family is wan2.2-a14b"):
        _setup(a14b, expert="low", pretrained=ti2v.model)
    with pytest.raises(UsageError, match=r"is a wan2.2-a14b pipeline .* the cache's family is wan2.2-ti2v-5b"):
        _setup(ti2v, pretrained=a14b.model)


def _trained_with_adapters(denoiser, cfg: Path, checkpoint: Path) -> Any:
    """The recipe's model with the adapters of ``checkpoint`` (by parameter name)."""
    from safetensors.torch import load_file

    from train.config import load_config
    from train.lora import add_lora

    model = denoiser.model
    add_lora(model, load_config(cfg), targets=denoiser.lora_targets)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in load_file(checkpoint / "adapters.safetensors").items():
            params[name].copy_(tensor)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("family, expert", [("wan2.2-a14b", "low"), ("wan2.2-ti2v-5b", None)])
def test_the_lora_export_loads_with_load_lora_weights_and_gives_the_trained_outputs(a14b, ti2v, tmp_path, family,
                                                                                     expert):  # fmt: skip
    """The low expert's export loads into transformer_2 (load_into_transformer_2=True, as the run prints) and
    leaves transformer as it was; validation at the last step runs both experts (clips written)."""
    from diffusers import WanPipeline

    data = a14b if family == "wan2.2-a14b" else ti2v
    settings = {"expert": expert} if expert else {}
    cfg = write_settings(tmp_path / "lora.json", lora_rank=4, lora_alpha=8, lr=1e-2, validation_every=3,
                         validation_steps=2, validation_size=64, validation_frames=5, **settings)  # fmt: skip
    out = tmp_path / "out"
    result, printed = train_quiet("--plan", data.plan, "--cache", data.cache, "--config", cfg, "--output-dir", out,
                                  "--max-steps", 3)  # fmt: skip
    assert result.steps == 3
    record = json.loads((out / "lora" / "lora.json").read_text())
    assert (record["family"], record["pipeline"], record["component"]) == (family, "WanPipeline", "transformer")
    assert sorted(p.name for p in (out / "validation" / "step-00000003").iterdir()) == [
        "00.mp4", "00.png", "01.mp4", "01.png"]
    code = printed_code(printed, "load them into the base pipeline")
    assert ("load_into_transformer_2=True" in code) == (expert == "low"), code

    batch = _batches(data)[0]
    denoiser = _setup(data, **settings)
    base = recipe_outputs(denoiser, denoiser.model, batch)
    want = recipe_outputs(denoiser, _trained_with_adapters(denoiser, cfg, out / "checkpoints" / "step-00000003"),
                          batch)  # fmt: skip
    scope: dict[str, Any] = {}
    exec(code, scope)  # the printed lines: WanPipeline.from_pretrained(base), pipe.load_lora_weights(...)
    pipe = scope["pipe"]
    assert isinstance(pipe, WanPipeline) and pipe.get_list_adapters(), "load_lora_weights loaded nothing"
    loaded = recipe_outputs(denoiser, getattr(pipe, denoiser.component), batch)
    torch.testing.assert_close(loaded, want, rtol=1e-4, atol=1e-5)
    assert (loaded - base).abs().max() > 100 * (loaded - want).abs().max()  # the adapters do act
    if expert == "low":  # the high-noise expert is untouched
        high = _setup(data, expert="high")
        assert "transformer" not in pipe.get_list_adapters()
        torch.testing.assert_close(recipe_outputs(high, pipe.transformer, batch),
                                   recipe_outputs(high, high.model, batch), rtol=0, atol=0)  # fmt: skip


@pytest.mark.slow
def test_a_full_fine_tune_of_the_low_expert_loads_into_the_pipeline_as_printed(a14b, tmp_path):
    from diffusers import WanTransformer3DModel

    cfg = write_settings(tmp_path / "c.json", expert="low")
    out = tmp_path / "out"
    result, printed = train_quiet("--plan", a14b.plan, "--cache", a14b.cache, "--config", cfg, "--output-dir", out,
                                  "--max-steps", 1)  # fmt: skip
    assert result.steps == 1
    trained = WanTransformer3DModel.from_pretrained(out / "model")
    base = WanTransformer3DModel.from_pretrained(a14b.model, subfolder="transformer_2")
    assert any(not torch.equal(p, q) for p, q in zip(trained.parameters(), base.parameters()))
    code = printed_code(printed, "load it into the base pipeline")
    assert "transformer_2 = WanTransformer3DModel.from_pretrained" in code and "transformer_2=transformer_2" in code
    scope: dict[str, Any] = {}
    exec(code, scope)
    pipe = scope["pipe"]
    assert all(torch.equal(p, q) for p, q in zip(pipe.transformer_2.parameters(), trained.parameters()))
    assert pipe.config.boundary_ratio == BOUNDARY
