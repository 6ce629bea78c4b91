"""The trainer's model-family recipes on tiny random-weight models of each family's real classes.

One module fixture embeds 6 images for SDXL, SD3 and Flux (the real embed job on Ray, from the
tiny diffusers folders, with two validation prompts) and plans them; the tests train in process:
one step per family (finite loss, gradients where the family's conditioning enters), SDXL's
``time_ids`` against the SDXL pipeline's own, a run interrupted and resumed with an EMA and caption
dropout against an uninterrupted one, validation images, LoRA adapters saved and loaded, and one
two-process run (Flux).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from manifests.cache import CacheReader
from manifests.errors import UsageError
from tests.embed_data import make_dataset, embed_cache
from tests.test_train import run  # noqa: F401  (fixture: the trainer in this process)
from tests.test_train_dist import command, environment
from train.config import TrainConfig
from train.data import BatchLoader, PlanStep, caption_dropout_mask, collate, rank_steps

pytestmark = [pytest.mark.ray]
# The module fixture embeds three caches on Ray (~60 s on an idle 2-core machine): every test that uses it
# is marked slow, so that `make test-floors` leaves them out.

FAMILIES = ("sdxl", "sd3", "flux")
# the parameters each family's conditioning flows through: a gradient there proves the batch field is used
CONDITIONED = {
    "sdxl": ("add_embedding.linear_1.weight", "conv_in.weight"),  # pooled + time_ids; latents
    "sd3": ("time_text_embed.text_embedder.linear_1.weight", "context_embedder.weight", "pos_embed.proj.weight"),
    "flux": ("time_text_embed.guidance_embedder.linear_1.weight", "time_text_embed.text_embedder.linear_1.weight",
             "context_embedder.weight", "x_embedder.weight"),
}  # fmt: skip


@pytest.fixture(scope="module")
def families(tmp_path_factory, ray_local) -> dict[str, dict[str, str]]:
    """Per family: its tiny model folder, cache (6 samples, T5 at 8 tokens) and 1-rank plans."""
    from pipeline import PlanJob, run
    from pipeline.embed.encoders import quiet_loading
    from pipeline.embed.families.tiny import build_tiny

    quiet_loading()
    base = tmp_path_factory.mktemp("train-families")
    manifest, prompts = str(base / "manifest"), base / "prompts.txt"
    make_dataset(str(base / "data"), manifest, 6)  # buckets 64x64 (4 images), 128x32, 32x128
    prompts.write_text("a red cat\na blue dog\n")
    out = {}
    for family in FAMILIES:
        model, cache = str(build_tiny(family, base / family)), str(base / f"cache-{family}")
        embed_cache(manifest, cache, family=family, model=model, validation_prompts=str(prompts),
                    max_text_tokens=None if family == "sdxl" else 8)  # fmt: skip
        plans = {}
        for world in (1, 2) if family == "flux" else (1,):  # 2 ranks: the two-process Flux run
            plans[world] = str(base / f"plan-{family}-w{world}")
            run(PlanJob(manifests=(manifest,), out=plans[world], world_size=world, batch_size=2, epochs=3,
                        cache=(cache,), leftover="pad"))  # fmt: skip
        out[family] = {"model": model, "cache": cache, "plan": plans[1], "plan2": plans.get(2)}
    return out


def first_batch(cache: str, plan: str, **loader):
    reader = CacheReader(cache)
    batches = iter(BatchLoader(reader, list(rank_steps(plan, 0)), reader.meta.latent, **loader))
    return reader, next(batches)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_one_training_step_per_family(families, family):
    from train.model import step_generator
    from train.recipes import recipe_for

    torch.manual_seed(0)
    reader, batch = first_batch(families[family]["cache"], families[family]["plan"])
    cfg = TrainConfig(family=family)
    denoiser = recipe_for(cfg, reader.meta).setup(cfg, reader.meta)
    assert batch.pooled is not None and batch.pooled.shape[0] == batch.latents.shape[0]
    loss = denoiser.loss(denoiser.model, batch, step_generator(0, batch.epoch, batch.step, 0))
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    grads = {n: p.grad for n, p in denoiser.model.named_parameters()}
    for name in CONDITIONED[family]:
        assert grads[name] is not None and torch.isfinite(grads[name]).all() and grads[name].abs().sum() > 0, name
    # the same plan position draws the same noise: the loss is a function of the batch and the position
    again = denoiser.loss(denoiser.model, batch, step_generator(0, batch.epoch, batch.step, 0))
    assert torch.equal(again, loss.detach()) or abs(again.item() - loss.item()) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_model_without_autocast_trains_on_the_float32_batches(families, family):
    """DeepSpeed with mixed_precision bf16 casts the weights to bf16 and autocasts nothing (accelerate turns its
    native autocast off under DeepSpeed): the loader's float32 batch must reach the model in the weights' dtype."""
    from train.model import step_generator
    from train.recipes import recipe_for

    reader, batch = first_batch(families[family]["cache"], families[family]["plan"])
    cfg = TrainConfig(family=family)
    model = recipe_for(cfg, reader.meta).setup(cfg, reader.meta)
    weights = model.model.to(torch.bfloat16)
    loss = model.loss(weights, batch, step_generator(0, batch.epoch, batch.step, 0))
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(p.grad is None or p.grad.dtype == torch.bfloat16 for p in weights.parameters())


@pytest.mark.slow
def test_sdxl_time_ids_equal_the_pipelines(families):
    from diffusers import StableDiffusionXLPipeline

    from train.recipes.sdxl import time_ids

    reader = CacheReader(families["sdxl"]["cache"])
    records = reader.read(reader.sample_ids.tolist())
    assert {r.crop_top_left for r in records} != {(0, 0)}, "the dataset must have crops off the origin"
    pipe = StableDiffusionXLPipeline.from_pretrained(families["sdxl"]["model"])
    for record in records:
        batch = collate([record], PlanStep(0, 0, record.bucket, (record.sample_id,)), layout=reader_layout(reader),
                        scaling_factor=1.0, shift_factor=0.0)  # fmt: skip
        ours = time_ids(batch.resolution, batch.crop_top_left, batch.target_size)
        theirs = pipe._get_add_time_ids(record.original_size, record.crop_top_left, record.target_size,
                                        dtype=torch.float32, text_encoder_projection_dim=40)  # fmt: skip
        assert torch.equal(ours, theirs), (record, ours, theirs)


def reader_layout(reader: CacheReader):

    return reader.meta.text_layout


@pytest.mark.slow
def test_the_config_family_must_be_the_caches(families):
    from train.recipes import recipe_for

    meta = CacheReader(families["sdxl"]["cache"]).meta
    with pytest.raises(UsageError, match="config family 'flux' but the cache was embedded for family 'sdxl'"):
        recipe_for(TrainConfig(family="flux"), meta)
    with pytest.raises(UsageError, match="model:"):  # a fresh-model size does not apply to a pretrained one
        recipe_for(TrainConfig(), meta).setup(TrainConfig(model={"num_layers": 2}), meta)


def test_caption_dropout_is_a_pure_function_of_seed_epoch_and_sample():
    ids = np.arange(20_000, dtype=np.uint64) * 7919 + 3
    a = caption_dropout_mask(0, 1, ids, 0.1)
    assert np.array_equal(a, caption_dropout_mask(0, 1, ids, 0.1))  # no hidden state
    assert np.array_equal(a[5:9], caption_dropout_mask(0, 1, ids[5:9], 0.1))  # per sample, whatever the batch
    assert abs(a.mean() - 0.1) < 0.01
    assert not np.array_equal(a, caption_dropout_mask(0, 2, ids, 0.1))  # another epoch, other draws
    assert not caption_dropout_mask(0, 1, ids, 0.0).any()


@pytest.mark.slow
def test_caption_dropout_trains_on_the_empty_captions_record(families):
    reader = CacheReader(families["sd3"]["cache"])
    (empty,) = reader.read_texts([reader.meta.text.empty_caption_key])
    _, batch = first_batch(families["sd3"]["cache"], families["sd3"]["plan"], caption_dropout=0.999, seed=1)
    embeds, _, pooled = reader_layout(reader).prompt_embeds([empty])
    assert batch.dropped == batch.sample_ids
    assert np.array_equal(batch.text.numpy(), np.repeat(embeds, len(batch.sample_ids), 0))
    assert np.array_equal(batch.pooled.numpy(), np.repeat(pooled, len(batch.sample_ids), 0))


def write(path: Path, **settings) -> Path:
    path.write_text(json.dumps({"lr": 1e-3, "warmup_steps": 0, "log_every": 1, **settings}))
    return path


@pytest.mark.slow
def test_ema_and_caption_dropout_resume_exactly_and_validation_images_are_written(run, families, tmp_path):
    from PIL import Image
    from safetensors.torch import load_file

    f = families["sd3"]
    cfg = write(tmp_path / "c.json", family="sd3", ema_decay=0.9, caption_dropout=0.5, checkpoint_every=2,
                validation_every=2, validation_steps=2, validation_size=32)  # fmt: skip
    common = ["--plan", f["plan"], "--cache", f["cache"], "--config", cfg]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(*common, "--output-dir", straight, "--max-steps", 4).steps == 4
    assert run(*common, "--output-dir", resumed, "--max-steps", 2).steps == 2
    assert run(*common, "--output-dir", resumed, "--max-steps", 4, "--resume").steps == 2  # the 2 not yet run

    for name in ("checkpoints/step-00000004/ema.safetensors", "model/diffusion_pytorch_model.safetensors",
                 "model_ema/diffusion_pytorch_model.safetensors"):  # fmt: skip
        a, b = load_file(straight / name), load_file(resumed / name)
        assert a.keys() == b.keys() and a, name
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)
    ema, model = (load_file(straight / n / "diffusion_pytorch_model.safetensors") for n in ("model_ema", "model"))
    assert any(not torch.equal(ema[k], model[k]) for k in ema)  # the average is not the last weights

    for step in (2, 4):
        images = sorted((straight / "validation" / f"step-{step:08d}").glob("*.png"))
        assert [p.name for p in images] == ["00.png", "01.png"]  # one per validation prompt
        assert all(Image.open(p).size == (32, 32) for p in images)
    assert sorted(p.name for p in (resumed / "validation").iterdir()) == ["step-00000002", "step-00000004"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((straight / "logs").rglob("events.out.tfevents.*")).parent)).Reload()
    assert len(events.Tags()["images"]) == 2 and all(len(events.Images(t)) == 2 for t in events.Tags()["images"])


@pytest.mark.slow
def test_lora_adapters_are_trained_saved_and_loaded(run, families, tmp_path):
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file

    from train.lora import load_lora

    f = families["flux"]
    cfg = write(tmp_path / "c.json", lora_rank=4, lr=1e-2)
    out = tmp_path / "out"
    result = run("--plan", f["plan"], "--cache", f["cache"], "--config", cfg, "--output-dir", out, "--max-steps", 2)
    assert result.steps == 2
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file() and not (out / "model").exists()

    trained = load_file(out / "checkpoints" / "step-00000002" / "model.safetensors")  # the whole model, adapted
    base = FluxTransformer2DModel.from_pretrained(f["model"], subfolder="transformer")
    frozen = {n: p.detach().clone() for n, p in base.named_parameters()}
    loaded = dict(load_lora(base, out / "lora").named_parameters())
    lora = {n: p for n, p in loaded.items() if "lora_" in n}
    assert lora and all(n in trained for n in lora)
    assert loaded.keys() == trained.keys()
    for name, param in loaded.items():  # loaded = trained; the base weights were frozen in training
        assert torch.equal(param.detach(), trained[name]), name
        if "lora_" not in name:
            assert torch.equal(trained[name], frozen[name.replace(".base_layer", "")]), name
    assert any(not torch.equal(trained[n], torch.zeros_like(trained[n])) for n in lora if "lora_B" in n)


@pytest.mark.slow
@pytest.mark.dist
def test_two_processes_train_flux(families, tmp_path):
    f = families["flux"]
    cfg = write(tmp_path / "c.json", ema_decay=0.9, caption_dropout=0.2, checkpoint_every=2)
    out = tmp_path / "out"
    proc = subprocess.run(command(2, "--plan", f["plan2"], "--cache", f["cache"], "--config", cfg, "--output-dir",
                                  out, "--max-steps", 2), env=environment(), capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and np.isfinite(losses).all()
    assert (out / "checkpoints" / "step-00000002" / "ema.safetensors").is_file()
    assert (out / "model_ema" / "diffusion_pytorch_model.safetensors").is_file()
    assert "done: --max-steps 2 reached" in proc.stdout + proc.stderr


def _cache_meta(**fields):
    """A ``_cache.json`` with only ``fields`` beside the required keys, as a recipe reads it."""
    from manifests.cache.meta import CACHE_FORMAT_VERSION, KIND, CacheMeta

    return CacheMeta.from_json({"kind": KIND, "format_version": CACHE_FORMAT_VERSION, "fingerprint": "0" * 64,
                                "settings": {}, "index": {}, "counts": {}, **fields}, "test")  # fmt: skip


def test_a_pretrained_pixart_is_fine_tuned_with_ddpm_noise(tmp_path):
    """``pretrained:`` on a PixArt cache: its transformer (learned sigma: 2C outputs), the epsilon target."""
    from manifests.cache import TextLayout
    from pipeline.embed.families.tiny import T5_WIDTH, build_tiny
    from train.data import Batch
    from train.model import step_generator
    from train.recipes import recipe_for

    folder = str(build_tiny("pixart", tmp_path / "pixart"))
    layout = TextLayout(family="pixart", join="features", masked=True, lengths=(8,), widths=(T5_WIDTH,))
    meta = _cache_meta(family="pixart", latent={"channels": 4}, text={"layout": layout.to_json()})
    cfg = TrainConfig(pretrained=folder)
    denoiser = recipe_for(cfg, meta).setup(cfg, meta)
    assert denoiser.model.config.out_channels == 8 and not denoiser.lora
    b = 2
    batch = Batch(0, 0, "64x64", [1, 2], latents=torch.randn(b, 4, 8, 8), text=torch.randn(b, 8, T5_WIDTH),
                  text_mask=torch.ones(b, 8), resolution=torch.full((b, 2), 64.0), aspect_ratio=torch.ones(b, 1),
                  crop_top_left=torch.zeros(b, 2), target_size=torch.full((b, 2), 64.0))  # fmt: skip
    loss = denoiser.loss(denoiser.model, batch, step_generator(0, 0, 0, 0))
    loss.backward()
    assert torch.isfinite(loss) and denoiser.model.proj_out.weight.grad[:16].abs().sum() > 0
    wide = TextLayout(family="pixart", join="features", masked=True, lengths=(8,), widths=(T5_WIDTH + 1,))
    with pytest.raises(UsageError, match="caption_channels"):  # a cache of another text width is refused
        recipe_for(cfg, meta).setup(cfg, _cache_meta(family="pixart", latent={"channels": 4},
                                                     text={"layout": wide.to_json()}))  # fmt: skip


def test_ddpm_targets_follow_the_schedulers_prediction_type():
    from diffusers import DDPMScheduler

    from train.model import ddpm_sample

    latents = torch.randn(3, 4, 8, 8)
    for kind in ("epsilon", "v_prediction"):
        scheduler = DDPMScheduler(prediction_type=kind)
        noisy, timesteps, target = ddpm_sample(scheduler, latents, torch.Generator().manual_seed(5))
        generator = torch.Generator().manual_seed(5)  # the same draws, in the same order
        want_t = torch.randint(0, 1000, (3,), generator=generator)
        noise = torch.randn(latents.shape, generator=generator)
        assert torch.equal(timesteps, want_t) and torch.equal(noisy, scheduler.add_noise(latents, noise, want_t))
        want = noise if kind == "epsilon" else scheduler.get_velocity(latents, noise, want_t)
        assert torch.equal(target, want)
    with pytest.raises(UsageError, match="'sample'"):
        ddpm_sample(DDPMScheduler(prediction_type="sample"), latents, torch.Generator())
