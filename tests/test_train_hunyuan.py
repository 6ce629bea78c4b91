"""The ``hunyuanvideo-1.5`` recipe in the one loop, on the tiny random ``HunyuanVideo15Pipeline``.

A small video cache written with the project's cache and plan writers (as ``bucketeer embed --family
hunyuanvideo-1.5`` writes one: the posterior mean of each clip, ``scaling_factor`` in ``_cache.json``, two masked
text streams per caption, the glyph one empty for captions without quoted text). A batch's loss equals a hand
computation of the pipeline's transformer call (``cat([x_t, zeros, zeros])``, zero ``image_embeds``, each text
stream zero-padded to 1000 / 256 rows with its own mask, timestep ``1000 sigma`` shifted by the scheduler's
``shift`` 5.0); the LoRA export loads with ``pipe.transformer.load_lora_adapter`` as the run prints it and gives
the trained outputs; what the recipe does not do is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from manifests.buckets import BucketSpec
from manifests.cache import CacheReader, CacheWriter, TextLayout
from manifests.cache.records import SampleRecord, TextRecord, caption_key, encode_sample, encode_text, to_float32
from manifests.errors import UsageError
from manifests.plan import DatasetSamples, PlanConfig, write_plan
from tests.test_cache_format import bf16_bits
from tests.train_dataset import printed_code, recipe_outputs, train_quiet, write_settings
from tests.test_train_wan22 import _trained_with_adapters
from train.config import TrainConfig
from train.data import BatchLoader, rank_steps

FAMILY = "hunyuanvideo-1.5"
CAPTIONS = ("a red cat", 'a sign "OPEN"', None)
PROMPTS = ("a red cat", "the thing")
BUCKETS = ("64x64x5", "64x64x5", "64x32x5", "64x32x5")  # latents (8, 2, 4, 4) and (8, 2, 2, 4)


def _text(caption: str | None, rng: np.random.Generator) -> TextRecord:
    from pipeline.embed.families.tiny_hunyuan import BYT5_WIDTH, HUNYUAN_WIDTH

    rows, glyph = 5 + len(caption or "") % 4, 3 if caption and '"' in caption else 0  # glyph rows: quoted text only
    tokens = (bf16_bits(rng.normal(size=(rows, HUNYUAN_WIDTH))), bf16_bits(rng.normal(size=(glyph, BYT5_WIDTH))))
    return TextRecord(caption_key=caption_key(caption), tokens=tokens, pooled=None, dtype="BF16")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    from pipeline.embed.families.tiny import build_tiny
    from pipeline.embed.families.tiny_hunyuan import BYT5_WIDTH, HUNYUAN_WIDTH, LATENT_CHANNELS

    base = tmp_path_factory.mktemp("hunyuan")
    model, cache, plan = str(base / FAMILY), str(base / "cache"), str(base / "plan")
    build_tiny(FAMILY, model)
    scaling = json.loads((Path(model) / "vae" / "config.json").read_text())["scaling_factor"]
    layout = TextLayout(family=FAMILY, join="streams", masked=True, lengths=(1000, 256),
                        widths=(HUNYUAN_WIDTH, BYT5_WIDTH))  # fmt: skip
    settings = {"family": FAMILY, "dtype": "BF16", "model": model, "latent": "posterior_mean",
                "buckets": BucketSpec(area=64 * 64, step=32).to_json(),
                "vae": {"id": model, "subfolder": "vae", "class": "AutoencoderKLHunyuanVideo15", "factor": 16,
                        "channels": LATENT_CHANNELS}}  # fmt: skip
    info = {"family": FAMILY,
            "latent": {"kind": "posterior_mean", "dtype": "BF16", "channels": LATENT_CHANNELS, "factor": 16,
                       "scaling_factor": scaling, "shift_factor": None, "temporal_factor": 4},
            "text": {"family": FAMILY, "pipeline": "HunyuanVideo15Pipeline", "dtype": "BF16",
                     "layout": layout.to_json(), "empty_caption_key": caption_key(""),
                     "validation_prompts": [{"prompt": p, "caption_key": caption_key(p)} for p in PROMPTS]},
            }  # fmt: skip
    writer = CacheWriter(cache, settings, info=info, shard_records=4)
    rng = np.random.default_rng(39)
    for caption in dict.fromkeys(c or "" for c in (*CAPTIONS, "", *PROMPTS)):
        writer.add_text(caption_key(caption), encode_text(_text(caption, rng)))
    writer.commit("texts")
    records = []
    for i, bucket in enumerate(BUCKETS):
        w, h, _ = (int(x) for x in bucket.split("x"))
        latent = bf16_bits(rng.normal(size=(LATENT_CHANNELS, 2, h // 16, w // 16)))
        records.append(SampleRecord(sample_id=2000 + i, bucket=bucket, latent=latent, dtype="BF16",
                                    original_size=(h, w), resized_size=(h, w), crop_top_left=(0, 0),
                                    target_size=(h, w), caption_key=caption_key(CAPTIONS[i % 3])))  # fmt: skip
    for r in records:
        writer.add_sample(r.sample_id, encode_sample(r), r.caption_key, r.bucket)
    meta = writer.finish()
    samples = DatasetSamples(np.asarray([r.sample_id for r in records], np.uint64),
                             pa.array([r.bucket for r in records]), cache_fingerprint=meta.fingerprint, cache=cache)
    write_plan(plan, [samples], PlanConfig(world_size=1, batch_size=2, epochs=2, seed=5))
    return {"model": model, "cache": cache, "plan": plan}


def _setup(data: dict[str, str], **config):
    from train.recipes import recipe_for

    meta = CacheReader(data["cache"]).meta
    cfg = TrainConfig(**config)
    return recipe_for(cfg, meta).setup(cfg, meta)


def _batch(data: dict[str, str]):
    reader = CacheReader(data["cache"])
    return next(iter(BatchLoader(reader, list(rank_steps(data["plan"], 0)), reader.meta.latent)))


def _streams(data: dict[str, str], batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each text stream of ``batch`` by hand from the cached records: ``(B, 1000 | 256, D)`` zero-padded, its mask."""
    reader = CacheReader(data["cache"])
    records = reader.read(batch.sample_ids)
    out = []
    for i, (length, width) in enumerate(((1000, 40), (256, 24))):
        e, m = torch.zeros(len(records), length, width), torch.zeros(len(records), length)
        for b, r in enumerate(records):
            rows = torch.from_numpy(to_float32(r.text.tokens[i], r.text.dtype))
            e[b, : len(rows)], m[b, : len(rows)] = rows, 1.0
        out.append((e, m))
    return out


def _captions(batch) -> list[str | None]:
    return [CAPTIONS[(i - 2000) % 3] for i in batch.sample_ids]


def test_the_loss_is_the_pipelines_transformer_call_on_the_cached_streams(data):
    """sigma = 5u / (1 + 4u) (the scheduler's shift 5), u = sigmoid(N(0, 1)); x0 = mean * scaling_factor."""
    from train.model import step_generator

    denoiser = _setup(data)
    assert (denoiser.pipeline_class, denoiser.component, denoiser.lora) == ("HunyuanVideo15Pipeline", "transformer",
                                                                          True)  # fmt: skip
    batch = _batch(data)
    seen: dict[str, Any] = {}
    hook = denoiser.model.register_forward_pre_hook(lambda mod, args, kw: seen.update(kw), with_kwargs=True)
    try:
        with torch.no_grad():
            loss = denoiser.loss(denoiser.model, batch, step_generator(0, batch.epoch, batch.step, 0))
    finally:
        hook.remove()
    reader = CacheReader(data["cache"])
    scaling = reader.meta.latent.scaling_factor
    x0 = torch.from_numpy(np.stack([to_float32(r.latent, r.dtype) for r in reader.read(batch.sample_ids)])) * scaling
    (e, m), (e2, m2) = _streams(data, batch)
    for name, want in (("encoder_hidden_states", e), ("encoder_attention_mask", m), ("encoder_hidden_states_2", e2),
                       ("encoder_attention_mask_2", m2)):  # fmt: skip
        assert torch.equal(seen[name], want), name  # each stream at the pipeline's length, with its own mask
    assert m2.sum(1).tolist() == [3.0 if '"' in (c or "") else 0.0 for c in _captions(batch)]
    b = len(x0)
    generator = step_generator(0, batch.epoch, batch.step, 0)
    u = torch.sigmoid(torch.normal(0.0, 1.0, size=(b,), generator=generator))
    eps = torch.randn(x0.shape, generator=generator)
    sigma = (5.0 * u / (1 + 4.0 * u)).view(b, 1, 1, 1, 1)
    x_t = (1 - sigma) * x0 + sigma * eps
    _, c, f, h, w = x0.shape
    with torch.no_grad():
        pred = denoiser.model(hidden_states=torch.cat([x_t, torch.zeros(b, c + 1, f, h, w)], dim=1),
                              image_embeds=torch.zeros(b, 729, 16), timestep=1000.0 * sigma.flatten(),
                              encoder_hidden_states=e, encoder_attention_mask=m, encoder_hidden_states_2=e2,
                              encoder_attention_mask_2=m2, return_dict=False)[0]  # fmt: skip
    torch.testing.assert_close(loss, ((pred - (eps - x0)) ** 2).mean(), rtol=1e-5, atol=1e-6)


def test_what_the_recipe_does_not_do_is_refused_in_one_line(data):
    with pytest.raises(UsageError, match="config expert: the hunyuanvideo-1.5 recipe does not have two experts"):
        _setup(data, expert="high")
    with pytest.raises(UsageError, match="config repa: the hunyuanvideo-1.5 recipe does not have REPA for video"):
        _setup(data, repa={"depth": 1})


@pytest.mark.slow
def test_the_lora_export_loads_with_load_lora_adapter_and_gives_the_trained_outputs(data, tmp_path):
    """No load_lora_weights on HunyuanVideo15Pipeline (diffusers 0.42.1): the printed lines load the export into
    pipe.transformer with PeftAdapterMixin.load_lora_adapter; validation clips are written at the last step."""
    from diffusers import HunyuanVideo15Pipeline

    assert not hasattr(HunyuanVideo15Pipeline, "load_lora_weights")
    cfg = write_settings(tmp_path / "lora.json", lora_rank=4, lora_alpha=8, lr=1e-2, validation_every=3,
                         validation_steps=2, validation_size=64, validation_frames=5)  # fmt: skip
    out = tmp_path / "out"
    result, printed = train_quiet("--plan", data["plan"], "--cache", data["cache"], "--config", cfg, "--output-dir",
                                  out, "--max-steps", 3)  # fmt: skip
    assert result.steps == 3
    record = json.loads((out / "lora" / "lora.json").read_text())
    assert (record["family"], record["pipeline"], record["component"]) == (FAMILY, "HunyuanVideo15Pipeline",
                                                                          "transformer")  # fmt: skip
    assert sorted(p.name for p in (out / "validation" / "step-00000003").iterdir()) == [
        "00.mp4", "00.png", "01.mp4", "01.png"]
    code = printed_code(printed, "load them into the base pipeline")
    assert "pipe.transformer.load_lora_adapter(" in code, code

    batch = _batch(data)
    denoiser = _setup(data)
    base = recipe_outputs(denoiser, denoiser.model, batch)
    want = recipe_outputs(denoiser, _trained_with_adapters(denoiser, cfg, out / "checkpoints" / "step-00000003"),
                          batch)  # fmt: skip
    scope: dict[str, Any] = {}
    exec(code, scope)  # the printed lines: from_pretrained(base), pipe.transformer.load_lora_adapter(...)
    pipe = scope["pipe"]
    assert isinstance(pipe, HunyuanVideo15Pipeline) and pipe.transformer.peft_config, "nothing loaded"
    loaded = recipe_outputs(denoiser, pipe.transformer, batch)
    torch.testing.assert_close(loaded, want, rtol=1e-4, atol=1e-5)
    assert (loaded - base).abs().max() > 100 * (loaded - want).abs().max()  # the adapters do act


def test_every_trained_parameter_gets_a_gradient(data):
    """DDP stops on a trained parameter without one: the last block's text outputs, which the model drops, are
    frozen, and every other parameter of a full fine-tune is reached by the loss."""
    from train.model import step_generator

    denoiser = _setup(data)
    batch = _batch(data)
    denoiser.loss(denoiser.model, batch, step_generator(0, batch.epoch, batch.step, 0)).backward()
    frozen = sorted(n for n, p in denoiser.model.named_parameters() if not p.requires_grad)
    assert frozen == [f"transformer_blocks.1.{m}" for m in ("attn.to_add_out.bias", "attn.to_add_out.weight",
                      "ff_context.net.0.proj.bias", "ff_context.net.0.proj.weight", "ff_context.net.2.bias",
                      "ff_context.net.2.weight")]  # fmt: skip
    assert all(p.grad is not None for p in denoiser.model.parameters() if p.requires_grad)
