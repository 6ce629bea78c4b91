"""The trainer's model-family recipes on tiny random-weight models of each family's real classes.

One module fixture embeds 6 images for SDXL, SD3 and Flux (the real embed job on Ray, from the
tiny diffusers folders, with two validation prompts) and plans them; the tests train in process:
one step per family (finite loss, gradients where the family's conditioning enters), SDXL's
``time_ids`` against the SDXL pipeline's own, a run interrupted and resumed with an EMA and caption
dropout against an uninterrupted one, validation images, and one two-process run (Flux LoRA, resumed on
one process). LoRA, as a user takes it: per family, 3-step runs whose export the family's diffusers
pipeline loads (``from_pretrained`` + ``load_lora_weights``, the code the trainer printed) and whose
denoiser then gives the trained model's outputs, for an alpha equal to and other than the rank;
adapter-only checkpoints that resume exactly; a full fine-tune's ``model/`` and ``model_ema/`` in the
pipeline, generating a 64x64 image.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from manifests.cache import CacheReader
from manifests.errors import UsageError
from tests.train_dataset import assert_same_files, printed_code, train_quiet
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
    from pipeline.embed.loading import quiet_loading
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
@pytest.mark.full
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
@pytest.mark.full
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
@pytest.mark.full
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
@pytest.mark.full
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
@pytest.mark.full
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
@pytest.mark.full
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

    assert_same_files(straight, resumed, ("checkpoints/step-00000004/ema.safetensors",
                                          "model/diffusion_pytorch_model.safetensors",
                                          "model_ema/diffusion_pytorch_model.safetensors"))  # fmt: skip
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


RANK = 4
ALPHAS = {"alpha_is_rank": RANK, "alpha_is_not": 3 * RANK}


@pytest.fixture(scope="module")
def lora_runs(families, tmp_path_factory) -> dict[tuple[str, str], dict[str, Any]]:
    """Per family and alpha: a 3-step LoRA run (EMA on, log_every 10 as the demo's) and, for an alpha other than
    the rank, the same run stopped after 2 steps and resumed."""
    base = tmp_path_factory.mktemp("lora-runs")
    runs = {}
    for family in FAMILIES:
        f = families[family]
        for name, alpha in ALPHAS.items():
            cfg = write(base / f"{family}-{name}.json", lora_rank=RANK, lora_alpha=alpha, lr=1e-2, ema_decay=0.9,
                        log_every=10)  # fmt: skip
            common = ["--plan", f["plan"], "--cache", f["cache"], "--config", cfg]
            out = base / f"{family}-{name}"
            result, printed = train_quiet(*common, "--output-dir", out, "--max-steps", 3)
            assert result.steps == 3, printed
            runs[family, name] = {"out": out, "printed": printed, "cfg": cfg, "common": common}
            if alpha != RANK:
                resumed = base / f"{family}-{name}-resumed"
                train_quiet(*common, "--output-dir", resumed, "--max-steps", 2)
                assert train_quiet(*common, "--output-dir", resumed, "--max-steps", 3, "--resume")[0].steps == 1
                runs[family, name]["resumed"] = resumed
    return runs


def _denoiser_output(family: str, families, model: torch.nn.Module) -> torch.Tensor:
    """``model``'s output on the first batch of the family's plan, with the recipe's inputs and fixed noise."""
    from train.model import step_generator
    from train.recipes import recipe_for

    reader, batch = first_batch(families[family]["cache"], families[family]["plan"])
    cfg = TrainConfig(family=family)
    recipe = recipe_for(cfg, reader.meta).setup(cfg, reader.meta)
    outputs = []
    hook = model.register_forward_hook(lambda module, args, out: outputs.append(out[0] if isinstance(out, tuple)
                                                                                 else out.sample))  # fmt: skip
    try:
        with torch.no_grad():
            recipe.loss(model, batch, step_generator(0, batch.epoch, batch.step, 0))
    finally:
        hook.remove()
    return outputs[0]


def _trained_model(family: str, families, run: dict[str, Any]) -> torch.nn.Module:
    """The base model with the adapters of the run's last checkpoint (by parameter name): what training held."""
    from safetensors.torch import load_file

    from train.config import load_config
    from train.lora import add_lora

    model = _base_model(family, families)
    add_lora(model, load_config(run["cfg"]), targets=("to_q", "to_k", "to_v", "to_out.0"))
    saved = load_file(run["out"] / "checkpoints" / "step-00000003" / "adapters.safetensors")
    params = dict(model.named_parameters())
    assert saved.keys() == {n for n, p in params.items() if p.requires_grad}
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor)
    return model


def _base_model(family: str, families) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel

    cls, sub = {"sdxl": (UNet2DConditionModel, "unet"), "sd3": (SD3Transformer2DModel, "transformer"),
                "flux": (FluxTransformer2DModel, "transformer")}[family]  # fmt: skip
    return cls.from_pretrained(families[family]["model"], subfolder=sub)


@pytest.mark.slow
@pytest.mark.parametrize("alpha", sorted(ALPHAS))
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.full
def test_the_lora_export_loads_into_the_familys_pipeline_with_the_printed_code(lora_runs, families, family, alpha):
    run = lora_runs[family, alpha]
    out = run["out"]
    record = json.loads((out / "lora" / "lora.json").read_text())
    assert (record["family"], record["rank"], record["alpha"], record["steps"]) == (family, RANK, ALPHAS[alpha], 3)
    assert record["base_model"] == families[family]["model"] and len(record["base_sha256"]) == 64
    # the run's last lines: the folders, and the diffusers code that loads them, run here as printed
    code = printed_code(run["printed"], "LoRA adapters in")
    assert f"pipe.load_lora_weights('{out / 'lora'}')" in code and "tensorboard --logdir" in run["printed"]
    scope: dict[str, Any] = {}
    exec(code, scope)
    pipe = scope["pipe"]
    assert pipe.get_list_adapters(), "load_lora_weights loaded nothing"
    component = "unet" if family == "sdxl" else "transformer"
    loaded = _denoiser_output(family, families, getattr(pipe, component))
    trained = _denoiser_output(family, families, _trained_model(family, families, run))
    base = _denoiser_output(family, families, _base_model(family, families))
    torch.testing.assert_close(loaded, trained, rtol=1e-4, atol=1e-5)
    assert (loaded - base).abs().max() > 100 * (loaded - trained).abs().max()  # the adapters do act


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.full
def test_a_lora_checkpoint_holds_the_adapters_only_and_resumes_exactly(lora_runs, families, family):
    from safetensors.torch import load_file

    run = lora_runs[family, "alpha_is_not"]
    checkpoint = run["out"] / "checkpoints" / "step-00000003"
    files = {p.name: p.stat().st_size for p in checkpoint.iterdir()}
    assert "adapters.safetensors" in files and "lora.json" in files and "model.safetensors" not in files
    sub = "unet" if family == "sdxl" else "transformer"
    base = Path(families[family]["model"]) / sub / "diffusion_pytorch_model.safetensors"
    assert sum(files.values()) < base.stat().st_size, (files, base.stat().st_size)
    for name in ("lora/pytorch_lora_weights.safetensors", "lora_ema/pytorch_lora_weights.safetensors",
                 "checkpoints/step-00000003/ema.safetensors"):  # fmt: skip
        a, b = load_file(run["out"] / name), load_file(run["resumed"] / name)
        assert a.keys() == b.keys() and a, name
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")


@pytest.mark.slow
@pytest.mark.full
def test_a_lora_resume_refuses_another_base_model_in_one_line(lora_runs, families, tmp_path, capsys):
    from diffusers import FluxTransformer2DModel

    from tests.train_dataset import train_cli

    run = lora_runs["flux", "alpha_is_not"]
    other = tmp_path / "other-flux"
    shutil.copytree(families["flux"]["model"], other)
    transformer = FluxTransformer2DModel.from_pretrained(other, subfolder="transformer")
    with torch.no_grad():
        transformer.x_embedder.weight[0, 0] += 0.01  # one weight changed: another base model
    transformer.save_pretrained(other / "transformer")
    out = tmp_path / "out"
    shutil.copytree(run["out"], out)
    cfg = write(tmp_path / "c.json", lora_rank=RANK, lora_alpha=ALPHAS["alpha_is_not"], lr=1e-2, ema_decay=0.9,
                pretrained=str(other))  # fmt: skip
    argv = ["--plan", families["flux"]["plan"], "--cache", families["flux"]["cache"], "--output-dir", out,
            "--max-steps", 4, "--resume"]  # fmt: skip
    assert train_cli(*argv, "--config", cfg) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "trained adapters on another base model" in err[0], err
    assert train_cli(*argv, "--config", write(tmp_path / "full.json", ema_decay=0.9)) == 2  # the whole model: refused
    assert "holds LoRA adapters (lora_rank 4) but the config trains the whole model" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.full
def test_a_whole_model_lora_checkpoint_of_an_earlier_version_still_resumes(lora_runs, families, tmp_path, capsys):
    from safetensors.torch import save_file

    run = lora_runs["flux", "alpha_is_not"]
    out = tmp_path / "out"
    shutil.copytree(run["out"], out)
    checkpoint = out / "checkpoints" / "step-00000003"
    trained = _trained_model("flux", families, run)
    (checkpoint / "adapters.safetensors").unlink()
    (checkpoint / "lora.json").unlink()
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, checkpoint / "model.safetensors")
    result, printed = train_quiet(*run["common"], "--output-dir", out, "--max-steps", 4, "--resume")
    assert result.steps == 1 and "a whole-model checkpoint of an earlier version" in printed


@pytest.mark.slow
@pytest.mark.full
def test_load_lora_reads_the_export_and_the_model_level_files_of_earlier_versions(lora_runs, families, tmp_path):
    from train.lora import load_lora

    run = lora_runs["flux", "alpha_is_not"]
    trained = _trained_model("flux", families, run)
    want = _denoiser_output("flux", families, trained)
    trained.save_lora_adapter(str(tmp_path / "old"), weight_name="pytorch_lora_weights.safetensors")  # 0.x format
    for folder in (run["out"] / "lora", tmp_path / "old"):
        got = _denoiser_output("flux", families, load_lora(_base_model("flux", families), folder))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.full
def test_a_short_runs_last_step_is_in_metrics_and_tensorboard(lora_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = lora_runs["sd3", "alpha_is_rank"]["out"]  # 3 steps with log_every 10, as the demo's 6
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["position"] for r in rows] == [3] and np.isfinite(rows[0]["loss"])
    events = EventAccumulator(str(next((out / "logs").rglob("events.out.tfevents.*")).parent)).Reload()
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("loss")] == [(3, round(rows[0]["loss"], 5))]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.full
def test_a_full_fine_tunes_model_and_ema_load_as_the_pipelines_denoiser_and_generate(families, family, tmp_path):
    f = families[family]
    out = tmp_path / "out"
    cfg = write(tmp_path / "c.json", ema_decay=0.9)
    result, printed = train_quiet("--plan", f["plan"], "--cache", f["cache"], "--config", cfg, "--output-dir",
                                     out, "--max-steps", 2)  # fmt: skip
    assert result.steps == 2
    code = printed_code(printed, "load it into the base pipeline")
    for folder in ("model", "model_ema"):
        scope: dict[str, Any] = {}
        exec(code.replace(f"'{out / 'model'}'", f"'{out / folder}'"), scope)  # as printed, for either folder
        pipe = scope["pipe"]
        kwargs = {"guidance_scale": 1.0} if family != "flux" else {}
        image = pipe("a red cat", height=64, width=64, num_inference_steps=2, output_type="pil",
                     generator=torch.Generator().manual_seed(0), **kwargs).images[0]  # fmt: skip
        assert image.size == (64, 64)
    assert f"(the EMA's: {out / 'model_ema'})" in printed


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.full
def test_two_processes_train_flux_lora_and_resume_elastically_on_one(families, tmp_path):
    from tests.train_dataset import train_here

    f = families["flux"]
    cfg = write(tmp_path / "c.json", lora_rank=RANK, lr=1e-2, ema_decay=0.9, caption_dropout=0.2, checkpoint_every=2)
    out = tmp_path / "out"
    proc = subprocess.run(command(2, "--plan", f["plan2"], "--cache", f["cache"], "--config", cfg, "--output-dir",
                                  out, "--max-steps", 2), env=environment(), capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and np.isfinite(losses).all()
    checkpoint = out / "checkpoints" / "step-00000002"
    assert {"adapters.safetensors", "ema.safetensors", "lora.json"} <= {p.name for p in checkpoint.iterdir()}
    assert not (checkpoint / "model.safetensors").exists()
    assert (out / "lora_ema" / "pytorch_lora_weights.safetensors").is_file()
    assert "done: --max-steps 2 reached" in proc.stdout + proc.stderr
    # the rest on one process: the plan re-cut, the adapters, their optimizer state and the EMA read back
    result = train_here("--plan", f["plan2"], "--cache", f["cache"], "--config", cfg, "--output-dir", out,
                        "--max-steps", 4, "--resume")  # fmt: skip
    assert (result.steps, result.position) == (2, 4) and (out / "plans" / "resume-00000002-w1").is_dir()
    assert not (out / "checkpoints" / "step-00000004" / "model.safetensors").exists()


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
