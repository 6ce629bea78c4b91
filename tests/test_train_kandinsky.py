"""The Kandinsky 5 recipes (``kandinsky-5``, ``kandinsky-5-video``) on tiny random-weight pipelines of the real classes.

``kandinsky-5``: a module fixture embeds 6 images with the real embed job (Ray) from the tiny ``Kandinsky5T2IPipeline``
folder, with a validation prompt, and plans them. One batch's loss is recomputed by hand as
``Kandinsky5T2IPipeline.__call__`` calls its transformer, one sample at a time (each caption's own rows, unpadded,
``text_rope_pos = arange(rows)``; channel-last latents scaled without shift; ``timestep = 1000 sigma`` shifted by the
scheduler's fixed shift; RoPE ``scale_factor`` (1, 1, 1)), to float rounding (1e-6); a batch of captions of different
lengths is among them, and feeding it padded (what the transformer cannot mask) would give another loss. A LoRA
run's export loads with the pipeline's own ``load_lora_weights`` (the code the trainer printed) and gives the trained
outputs; a full fine-tune writes validation images and its ``model/`` loads into the pipeline, generating. The memory
check refuses the real T2I-Lite transformer (6.0B) where one GPU cannot hold it, from its config alone.

``kandinsky-5-video``: a clip cache written with the cache writer; the loss by hand as ``Kandinsky5T2VPipeline``
calls the transformer (the zero visual condition, ``_get_scale_factor``), what it does not train refused, the LoRA
export loaded with ``load_lora_weights`` and validation clips written. Each family's ``bucketeer demo`` runs once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.embed.families.base import missing_classes
from manifests.cache import CacheReader
from manifests.errors import UsageError
from tests.embed_data import family_plan, plan_batches
from tests.test_train_families import write
from tests.train_dataset import printed_code, train_quiet
from train.config import TrainConfig

MISSING = missing_classes("kandinsky-5")  # why this diffusers cannot run the families (None: it can)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

FAMILY = "kandinsky-5"
RANK = 4


@pytest.fixture(scope="module")
def image(tmp_path_factory, ray_local) -> dict[str, str]:
    return family_plan(tmp_path_factory.mktemp("train-kandinsky"), FAMILY)


def _batches(f: dict[str, str]):
    return plan_batches(f)


def _setup(f: dict[str, str], **config):
    from train.recipes import recipe_for

    meta = CacheReader(f["cache"]).meta
    cfg = TrainConfig(**config)
    return recipe_for(cfg, meta).setup(cfg, meta)


def _by_hand(model: torch.nn.Module, batch: Any, shift: float, seed: tuple, padded: bool = False) -> torch.Tensor:
    """The loss of ``batch`` with the pipeline's own call of its transformer, one sample at a time (``padded``: the
    whole batch in one call, every caption padded to the longest, as the transformer would see a padded batch)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from train.model import step_generator

    generator = step_generator(*seed)
    x0 = batch.latents  # (B, C, h, w): the loader scaled them (scaling_factor, no shift)
    b, c, h, w = x0.shape
    u = compute_density_for_timestep_sampling("logit_normal", b, logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                              generator=generator)  # fmt: skip
    noise = torch.randn(x0.shape, generator=generator)
    sigma = (shift * u / (1 + (shift - 1) * u)).view(b, 1, 1, 1)
    noisy = ((1 - sigma) * x0 + sigma * noise).permute(0, 2, 3, 1).unsqueeze(1)  # (B, 1, h, w, C): prepare_latents
    counts = batch.text_mask.sum(1).long().tolist()
    rope = [torch.arange(1), torch.arange(h // 2), torch.arange(w // 2)]  # __call__'s visual_rope_pos
    groups = [list(range(b))] if padded else [[i] for i in range(b)]
    preds = []
    for idx in groups:
        n = max(counts[i] for i in idx)
        preds.append(model(hidden_states=noisy[idx], encoder_hidden_states=batch.text[idx, :n],
                           pooled_projections=batch.pooled[idx], timestep=1000.0 * sigma.flatten()[idx],
                           visual_rope_pos=rope, text_rope_pos=torch.arange(n), scale_factor=[1.0, 1.0, 1.0],
                           sparse_params=None, return_dict=True).sample)  # (g, 1, h, w, C)  # fmt: skip
    pred = torch.cat(preds).squeeze(1).permute(0, 3, 1, 2)  # (B, C, h, w)
    return ((pred.float() - (noise - x0)) ** 2).mean()


@pytest.mark.slow
@pytest.mark.full
def test_the_loss_is_the_pipelines_transformer_call_one_caption_at_a_time(image):
    from train.model import step_generator

    reader, batches = _batches(image)
    assert (reader.meta.latent.scaling_factor, reader.meta.latent.shift_factor) == (0.3611, None)
    denoiser = _setup(image)
    assert (denoiser.pipeline_class, denoiser.lora) == ("Kandinsky5T2IPipeline", True)
    shift = json.loads((Path(image["model"]) / "scheduler" / "scheduler_config.json").read_text())["shift"]
    assert shift == 3.0 and not json.loads((Path(image["model"]) / "scheduler" / "scheduler_config.json").read_text(
        ))["use_dynamic_shifting"]  # the pipeline's set_timesteps(n): the config's fixed shift  # fmt: skip
    padded = [b for b in batches if len(set(b.text_mask.sum(1).tolist())) > 1]
    assert padded, "a batch of captions of different lengths, each fed its own rows"
    model = denoiser.model
    for batch in (batches[0], padded[0]):
        seed = (0, batch.epoch, batch.step, 0)
        loss = denoiser.loss(model, batch, step_generator(*seed))
        with torch.no_grad():
            torch.testing.assert_close(loss.detach(), _by_hand(model, batch, shift, seed), rtol=1e-6, atol=1e-7)
    with torch.no_grad():  # the pad rows would condition the model: the same batch padded gives another loss
        assert (loss.detach() - _by_hand(model, padded[0], shift, seed, padded=True)).abs() > 1e-6
    loss.backward()
    assert torch.isfinite(loss)
    # every parameter is reached by the loss (DDP refuses a trained parameter that gets no gradient)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_what_the_recipe_cannot_train_is_refused_in_one_line(image, tmp_path):
    import shutil

    from diffusers import Kandinsky5Transformer3DModel

    pro = tmp_path / "pro"
    shutil.copytree(image["model"], pro)
    config = json.loads((pro / "transformer" / "config.json").read_text())
    (pro / "transformer" / "config.json").write_text(json.dumps({**config, "attention_type": "nabla"}))
    assert Kandinsky5Transformer3DModel.load_config(str(pro), subfolder="transformer")["attention_type"] == "nabla"
    with pytest.raises(UsageError, match="NABLA sparse attention \\(a Kandinsky 5 Pro config\\)"):
        _setup(image, pretrained=str(pro))


@pytest.fixture(scope="module")
def lora_run(image, tmp_path_factory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("kandinsky-lora")
    cfg = write(base / "lora.json", lora_rank=RANK, lora_alpha=3 * RANK, lr=1e-2, log_every=10)
    out = base / "out"
    result, printed = train_quiet("--plan", image["plan"], "--cache", image["cache"], "--config", cfg,
                                  "--output-dir", out, "--max-steps", 3)  # fmt: skip
    assert result.steps == 3, printed
    return {"out": out, "printed": printed, "cfg": cfg}


def _output(image: dict[str, str], model: torch.nn.Module) -> torch.Tensor:
    """``model``'s outputs on the first batch of the plan, through the recipe's loss (fixed noise)."""
    from train.model import step_generator

    _, batches = _batches(image)
    batch = batches[0]
    outputs = []
    hook = model.register_forward_hook(lambda module, args, out: outputs.append(out[0]))
    try:
        with torch.no_grad():
            _setup(image).loss(model, batch, step_generator(0, batch.epoch, batch.step, 0))
    finally:
        hook.remove()
    return torch.cat(outputs)


def _base(image: dict[str, str]) -> torch.nn.Module:
    from diffusers import Kandinsky5Transformer3DModel

    return Kandinsky5Transformer3DModel.from_pretrained(image["model"], subfolder="transformer")


@pytest.mark.slow
@pytest.mark.full
def test_the_lora_export_loads_with_load_lora_weights_and_gives_the_trained_outputs(image, lora_run):
    from safetensors.torch import load_file

    from train.config import load_config
    from train.lora import add_lora

    code = printed_code(lora_run["printed"], "LoRA adapters in")
    assert f"pipe.load_lora_weights('{lora_run['out'] / 'lora'}')" in code, code
    scope: dict[str, Any] = {}
    exec(code, scope)  # as printed: from_pretrained(base) + load_lora_weights (KandinskyLoraLoaderMixin)
    pipe = scope["pipe"]
    assert type(pipe).__name__ == "Kandinsky5T2IPipeline" and pipe.get_list_adapters(), "nothing loaded"
    trained = _base(image)  # the adapters of the last checkpoint, by parameter name: what training held
    add_lora(trained, load_config(lora_run["cfg"]), targets=_setup(image).lora_targets)
    params = dict(trained.named_parameters())
    with torch.no_grad():
        for name, tensor in load_file(lora_run["out"] / "checkpoints" / "step-00000003" /
                                      "adapters.safetensors").items():  # fmt: skip
            params[name].copy_(tensor)
    loaded, want, base = _output(image, pipe.transformer), _output(image, trained), _output(image, _base(image))
    torch.testing.assert_close(loaded, want, rtol=1e-4, atol=1e-5)
    assert (loaded - base).abs().max() > 100 * (loaded - want).abs().max()  # the adapters do act


@pytest.mark.slow
@pytest.mark.full
def test_a_full_fine_tune_writes_validation_images_and_loads_into_the_pipeline(image, tmp_path):
    out = tmp_path / "out"
    cfg = write(tmp_path / "c.json", validation_every=2, validation_steps=2, validation_size=32)
    result, printed = train_quiet("--plan", image["plan"], "--cache", image["cache"], "--config", cfg,
                                  "--output-dir", out, "--max-steps", 2)  # fmt: skip
    assert result.steps == 2
    assert [p.name for p in (out / "validation" / "step-00000002").glob("*.png")] == ["00.png"]
    scope: dict[str, Any] = {}
    exec(printed_code(printed, "load it into the base pipeline"), scope)
    pipe = scope["pipe"]
    trained = pipe.transformer.state_dict()
    assert any(not torch.equal(trained[k], v) for k, v in _base(image).state_dict().items())
    # the pipeline sizes its images from its own list (1024x1024 for a square request)
    picture = pipe("a red cat", height=1024, width=1024, num_inference_steps=2, guidance_scale=1.0,
                   output_type="np", generator=torch.Generator().manual_seed(0)).image[0]  # fmt: skip
    assert picture.shape == (1024, 1024, 3) and np.isfinite(picture).all()


# ---- what one GPU holds ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, params, lora_fits, full_fits", [("KANDINSKY5_T2I", 6.02e9, True, False),
                                                                ("KANDINSKY5_T2V", 2.01e9, True, True)])
def test_what_one_80_gb_gpu_holds_is_checked_before_loading(tmp_path, monkeypatch, name, params, lora_fits,
                                                            full_fits):  # fmt: skip
    from diffusers import Kandinsky5Transformer3DModel

    from benchmarks import real_configs
    from train.recipes.memory import MEMORY_ENV, check_fits, parameters

    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": "Kandinsky5Transformer3DModel",
                                                                      **getattr(real_configs, name)}))  # fmt: skip
    cls = Kandinsky5Transformer3DModel
    assert parameters(cls, str(tmp_path)) == pytest.approx(params, rel=0.005)  # counted on the meta device
    monkeypatch.setenv(MEMORY_ENV, "80")
    for cfg, fits in ((TrainConfig(lora_rank=16), lora_fits), (TrainConfig(), full_fits)):
        if fits:
            check_fits(FAMILY, cls, str(tmp_path), cfg)
            continue
        with pytest.raises(UsageError, match=f"{FAMILY}: a full fine-tune .* needs 96.4 GB per GPU before "
                                             "activations; this GPU has 80.0 GB: shard it with FSDP .* or train LoRA"):
            check_fits(FAMILY, cls, str(tmp_path), cfg)
    monkeypatch.setenv(MEMORY_ENV, "400")  # a figure that holds it: nothing to say
    check_fits(FAMILY, cls, str(tmp_path), TrainConfig())


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
@pytest.mark.full
def test_demo_embeds_and_fine_tunes_kandinsky_5(tmp_path, bucketeer_home):
    """``bucketeer demo --family kandinsky-5``: generated images -> scan -> embed -> plan -> train (2 CPU processes,
    caption dropout, EMA, validation images) -> verify -> report, with the tiny ``Kandinsky5T2IPipeline``."""
    from tests.test_demo import run_demo

    out = tmp_path / "out"
    output, _ = run_demo(tmp_path, "--family", FAMILY, "--images", "40", "--out-dir", str(out))
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["embed"]["samples"] == figures["scan"]["samples"] == 40, output[-3000:]
    assert figures["train"]["steps"] >= 2 and figures["train"]["loss_last"] is not None
    cache = json.loads((out / "cache" / "_cache.json").read_text())
    assert cache["family"] == FAMILY and cache["text"]["layout"]["masked"] and cache["text"]["layout"]["pooled_dim"]
    assert cache["latent"]["shift_factor"] is None and cache["latent"]["scaling_factor"] == 0.3611
    assert (out / "train" / "model" / "config.json").exists() and (out / "train" / "model_ema").is_dir()
    assert sorted(p.name for p in (out / "train" / "validation").glob("step-*/*.png")) == ["00.png", "01.png"]


# ---- kandinsky-5-video ------------------------------------------------------------------------------

VIDEO = "kandinsky-5-video"
CAPTIONS = ("a red cat", "a dog running on the beach at night", None)
PROMPTS = ("a red cat", "the thing")
BUCKETS = ("64x64x9", "64x64x9", "64x32x9", "64x32x9")  # latents (16, 3, 8, 8) and (16, 3, 4, 8)


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> dict[str, str]:
    """A small clip cache written with the project's cache and plan writers, as ``bucketeer embed --family
    kandinsky-5-video`` writes one: each clip's posterior mean, ``scaling_factor`` in ``_cache.json``, each
    caption's real Qwen rows (a count of its own) and its pooled CLIP vector."""
    import pyarrow as pa

    from manifests.buckets import BucketSpec
    from manifests.cache import CacheWriter, TextLayout
    from manifests.cache.records import SampleRecord, TextRecord, caption_key, encode_sample, encode_text
    from manifests.plan import DatasetSamples, PlanConfig, write_plan
    from pipeline.embed.families.tiny import CLIP_L, build_tiny
    from pipeline.embed.families.tiny_qwen import QWEN_WIDTH
    from tests.test_cache_format import bf16_bits

    base = tmp_path_factory.mktemp("kandinsky-video")
    model, cache, plan = str(base / VIDEO), str(base / "cache"), str(base / "plan")
    build_tiny(VIDEO, model)
    scaling = json.loads((Path(model) / "vae" / "config.json").read_text())["scaling_factor"]
    layout = TextLayout(family=VIDEO, join="features", masked=True, lengths=(512,), widths=(QWEN_WIDTH,),
                        pooled_dim=CLIP_L, pooled_source="pooler_output of text_encoder_2 (CLIP-L)")  # fmt: skip
    settings = {"family": VIDEO, "dtype": "BF16", "model": model, "latent": "posterior_mean",
                "buckets": BucketSpec(area=64 * 64, step=16).to_json(),
                "vae": {"id": model, "subfolder": "vae", "class": "AutoencoderKLHunyuanVideo", "factor": 8,
                        "channels": 16}}  # fmt: skip
    info = {"family": VIDEO,
            "latent": {"kind": "posterior_mean", "dtype": "BF16", "channels": 16, "factor": 8,
                       "scaling_factor": scaling, "shift_factor": None, "temporal_factor": 4},
            "text": {"family": VIDEO, "pipeline": "Kandinsky5T2VPipeline", "dtype": "BF16", "pooled_dim": CLIP_L,
                     "layout": layout.to_json(), "empty_caption_key": caption_key(""),
                     "validation_prompts": [{"prompt": p, "caption_key": caption_key(p)} for p in PROMPTS]},
            }  # fmt: skip
    writer = CacheWriter(cache, settings, info=info, shard_records=4)
    rng = np.random.default_rng(55)
    for caption in dict.fromkeys(c or "" for c in (*CAPTIONS, "", *PROMPTS)):
        rows = 1 + len(caption.split())  # its tokens and <|im_end|>: a count of its own
        record = TextRecord(caption_key=caption_key(caption), tokens=(bf16_bits(rng.normal(size=(rows, QWEN_WIDTH))),),
                            pooled=bf16_bits(rng.normal(size=(CLIP_L,))), dtype="BF16")  # fmt: skip
        writer.add_text(caption_key(caption), encode_text(record))
    writer.commit("texts")
    records = []
    for i, bucket in enumerate(BUCKETS):
        w, h, _ = (int(x) for x in bucket.split("x"))
        latent = bf16_bits(rng.normal(size=(16, 3, h // 8, w // 8)))
        records.append(SampleRecord(sample_id=3000 + i, bucket=bucket, latent=latent, dtype="BF16",
                                    original_size=(h, w), resized_size=(h, w), crop_top_left=(0, 0),
                                    target_size=(h, w), caption_key=caption_key(CAPTIONS[i % 3])))  # fmt: skip
    for r in records:
        writer.add_sample(r.sample_id, encode_sample(r), r.caption_key, r.bucket)
    meta = writer.finish()
    samples = DatasetSamples(np.asarray([r.sample_id for r in records], np.uint64),
                             pa.array([r.bucket for r in records]), cache_fingerprint=meta.fingerprint, cache=cache)
    write_plan(plan, [samples], PlanConfig(world_size=1, batch_size=2, epochs=2, seed=5))
    return {"model": model, "cache": cache, "plan": plan}


def test_the_video_loss_is_the_pipelines_transformer_call_one_caption_at_a_time(video):
    """sigma = 5u / (1 + 4u) (the scheduler's shift 5), x0 = mean * scaling_factor; hidden_states channel-last with
    the zero visual condition and its zero mask; scale_factor as _get_scale_factor gives a 64-pixel side."""
    from diffusers import Kandinsky5T2VPipeline

    from train.model import step_generator

    denoiser = _setup(video)
    assert (denoiser.pipeline_class, denoiser.lora) == ("Kandinsky5T2VPipeline", True)
    _, batches = _batches(video)
    batch = next(b for b in batches if len(set(b.text_mask.sum(1).tolist())) > 1)
    with torch.no_grad():
        loss = denoiser.loss(denoiser.model, batch, step_generator(0, batch.epoch, batch.step, 0))
    generator = step_generator(0, batch.epoch, batch.step, 0)
    x0 = batch.latents  # (B, C, F, h, w), scaled by the loader
    b, c, f, h, w = x0.shape
    u = torch.sigmoid(torch.normal(0.0, 1.0, size=(b,), generator=generator))
    eps = torch.randn(x0.shape, generator=generator)
    sigma = (5.0 * u / (1 + 4.0 * u)).view(b, 1, 1, 1, 1)
    x_t = ((1 - sigma) * x0 + sigma * eps).permute(0, 2, 3, 4, 1)  # (B, F, h, w, C): prepare_latents
    hidden = torch.cat([x_t, torch.zeros(b, f, h, w, c + 1)], dim=-1)  # + visual_cond, visual_cond_mask
    scale = Kandinsky5T2VPipeline._get_scale_factor(None, 8 * h, 8 * w)
    assert scale == (1, 3.16, 3.16)  # below 480 pixels
    counts = batch.text_mask.sum(1).long().tolist()
    preds = []
    with torch.no_grad():
        for i in range(b):
            preds.append(denoiser.model(
                hidden_states=hidden[i : i + 1], encoder_hidden_states=batch.text[i : i + 1, : counts[i]],
                pooled_projections=batch.pooled[i : i + 1], timestep=1000.0 * sigma.flatten()[i : i + 1],
                visual_rope_pos=[torch.arange(f), torch.arange(h // 2), torch.arange(w // 2)],
                text_rope_pos=torch.arange(counts[i]), scale_factor=scale, sparse_params=None).sample)  # fmt: skip
    pred = torch.cat(preds).permute(0, 4, 1, 2, 3)  # (B, C, F, h, w)
    torch.testing.assert_close(loss, ((pred - (eps - x0)) ** 2).mean(), rtol=1e-6, atol=1e-7)
    assert Kandinsky5T2VPipeline._get_scale_factor(None, 512, 768) == (1, 2, 2)  # the 480p sizes


def test_what_the_video_recipe_does_not_do_is_refused_in_one_line(video):
    with pytest.raises(UsageError, match="config expert: the kandinsky-5-video recipe does not have two experts"):
        _setup(video, expert="high")
    with pytest.raises(UsageError, match="config masked_loss: the kandinsky-5-video recipe does not weight video"):
        _setup(video, masked_loss={"weight_outside": 0.5})


@pytest.mark.slow
def test_the_video_lora_export_loads_with_load_lora_weights_and_gives_the_trained_outputs(video, tmp_path):
    """Validation clips are written at the last step; the printed lines load the export with load_lora_weights."""
    from diffusers import Kandinsky5T2VPipeline

    from tests.test_train_wan22 import _trained_with_adapters
    from tests.train_dataset import recipe_outputs, write_settings

    cfg = write_settings(tmp_path / "lora.json", lora_rank=4, lora_alpha=8, lr=1e-2, validation_every=3,
                         validation_steps=2, validation_size=64, validation_frames=5)  # fmt: skip
    out = tmp_path / "out"
    result, printed = train_quiet("--plan", video["plan"], "--cache", video["cache"], "--config", cfg,
                                  "--output-dir", out, "--max-steps", 3)  # fmt: skip
    assert result.steps == 3
    assert sorted(p.name for p in (out / "validation" / "step-00000003").iterdir()) == [
        "00.mp4", "00.png", "01.mp4", "01.png"]
    code = printed_code(printed, "LoRA adapters in")
    assert f"pipe.load_lora_weights('{out / 'lora'}')" in code, code
    _, batches = _batches(video)
    denoiser = _setup(video)
    base = recipe_outputs(denoiser, denoiser.model, batches[0])
    want = recipe_outputs(denoiser, _trained_with_adapters(denoiser, cfg, out / "checkpoints" / "step-00000003"),
                          batches[0])  # fmt: skip
    scope: dict[str, Any] = {}
    exec(code, scope)
    pipe = scope["pipe"]
    assert isinstance(pipe, Kandinsky5T2VPipeline) and pipe.get_list_adapters(), "nothing loaded"
    loaded = recipe_outputs(denoiser, pipe.transformer, batches[0])
    torch.testing.assert_close(loaded, want, rtol=1e-4, atol=1e-5)
    assert (loaded - base).abs().max() > 100 * (loaded - want).abs().max()  # the adapters do act


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
@pytest.mark.full
def test_demo_embeds_clips_and_fine_tunes_kandinsky_5_video(tmp_path, bucketeer_home):
    """``bucketeer demo --family kandinsky-5-video``: generated clips -> scan --frames -> embed with HunyuanVideo's VAE,
    Qwen2.5-VL and CLIP -> train (2 processes), validation clips at the end."""
    pytest.importorskip("av")
    from tests.test_demo import run_demo

    out = tmp_path / "out"
    output, _ = run_demo(tmp_path, "--family", VIDEO, "--out-dir", str(out))
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["embed"]["samples"] == figures["scan"]["samples"] > 0, output[-3000:]
    assert figures["train"]["steps"] >= 1
    cache = json.loads((out / "cache" / "_cache.json").read_text())
    assert cache["family"] == VIDEO and cache["latent"]["temporal_factor"] == 4
    assert (cache["latent"]["channels"], cache["latent"]["factor"], cache["latent"]["shift_factor"]) == (16, 8, None)
    assert cache["text"]["layout"]["masked"] and cache["text"]["layout"]["pooled_dim"] == 32
    assert sorted((out / "train" / "validation").glob("step-*/*.mp4")), output[-3000:]
