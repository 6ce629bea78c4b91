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
    with pytest.raises(UsageError, match="family wan2.2-a14b trains its experts by timestep: set expert: high"):
        _setup(a14b)
    with pytest.raises(UsageError, match="config expert: high: family wan2.2-ti2v-5b has one transformer"):
        _setup(ti2v, expert="high")
    with pytest.raises(UsageError, match="config: expert must be one of"):
        TrainConfig(expert="middle")
    with pytest.raises(UsageError, match="config expert: both: family wan2.2-ti2v-5b has one transformer"):
        _setup(ti2v, expert="both", lora_rank=4)
    with pytest.raises(UsageError, match="config expert: both trains LoRA adapters on both experts; set lora_rank"):
        _setup(a14b, expert="both")
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


# ---------------------------------------------------------------- expert: both (LoRA on each expert, one run)

SPANS = {"transformer": (875.0, 1000.0), "transformer_2": (0.0, 875.0)}  # each expert's timesteps (1000 sigma)


def test_both_gives_each_update_one_expert_at_the_samplers_share(a14b):
    """The high expert's share is that of WanPipeline's 50 sampler steps at t >= 875 (16 of 50 at flow_shift 3);
    pick_expert draws it per (seed, epoch, update), the same at every call."""
    from train.recipes.wan import high_share, pick_expert, load_flow_scheduler

    scheduler = load_flow_scheduler(a14b.model)
    scheduler.set_timesteps(50)
    assert high_share(scheduler, 875.0) == pytest.approx(int((scheduler.timesteps >= 875).sum()) / 50) == 0.32
    picks = [pick_expert(0, epoch, update, 0.32) for epoch in range(4) for update in range(1000)]
    assert picks == [pick_expert(0, epoch, update, 0.32) for epoch in range(4) for update in range(1000)]
    assert abs(picks.count("transformer") / len(picks) - 0.32) < 0.03  # 4000 draws: 4 standard deviations
    assert picks != [pick_expert(1, epoch, update, 0.32) for epoch in range(4) for update in range(1000)]
    assert {pick_expert(0, 0, u, 0.0) for u in range(50)} == {"transformer_2"}
    assert {pick_expert(0, 0, u, 1.0) for u in range(50)} == {"transformer"}


def test_both_is_refused_where_both_experts_do_not_fit_but_one_does(a14b, monkeypatch):
    """LoRA holds the frozen experts in float32: both need twice one's 4 bytes per parameter (a GPU of 1.5x)."""
    from diffusers import WanTransformer3DModel

    from train.recipes.memory import MEMORY_ENV, parameters

    params = parameters(WanTransformer3DModel, a14b.model, "transformer")
    assert params == parameters(WanTransformer3DModel, a14b.model, "transformer_2")
    monkeypatch.setenv(MEMORY_ENV, str(6 * params / 1e9))
    with pytest.raises(UsageError, match=r"wan2.2-a14b: LoRA \(frozen float32 weights\) of its .*-parameter "
                                         r"WanTransformer3DModel \(transformer \+ transformer_2\) needs .* or train "
                                         r"transformer and transformer_2 in separate runs"):  # fmt: skip
        _setup(a14b, expert="both", lora_rank=4)
    assert _setup(a14b, expert="high", lora_rank=4).component == "transformer"


def test_both_trains_each_step_as_that_experts_own_run_would(a14b):
    """Every plan step of one update runs one expert (grad_accum 2: steps 2k and 2k + 1), with the loss its
    one-expert recipe (expert: high / low) gives on the same batch and noise, at timesteps in its range; the
    other expert runs no forward."""
    from train.model import step_generator
    from train.recipes.wan import pick_expert

    both = _setup(a14b, expert="both", lora_rank=4, grad_accum=2)
    assert set(both.model.experts) == {"transformer", "transformer_2"}
    one = {"transformer": _setup(a14b, expert="high"), "transformer_2": _setup(a14b, expert="low")}
    for name, expert in both.model.experts.items():  # the base weights of each subfolder
        assert all(torch.equal(p, q) for p, q in zip(expert.parameters(), one[name].model.parameters()))
    calls: list[tuple[str, torch.Tensor]] = []
    for name, expert in both.model.experts.items():
        expert.register_forward_pre_hook(lambda m, a, kw, name=name: calls.append((name, kw["timestep"])),
                                         with_kwargs=True)  # fmt: skip
    batch = _batches(a14b)[0]
    seen = set()
    for epoch, step in [(e, s) for e in range(3) for s in range(8)]:
        batch.epoch, batch.step = epoch, step
        want = pick_expert(0, epoch, step // 2, 0.32)
        with torch.no_grad():
            loss = both.loss(both.model, batch, step_generator(0, epoch, step, 0))
            alone = one[want].loss(one[want].model, batch, step_generator(0, epoch, step, 0))
        (name, t), = calls
        calls.clear()
        lo, hi = SPANS[name]
        assert name == want and lo <= t.min() and t.max() <= hi, (epoch, step, name, t)
        assert both.step_record == {"expert": name, "sigma": pytest.approx((t / 1000).tolist())}
        torch.testing.assert_close(loss, alone, rtol=0, atol=0)
        seen.add(name)
    assert seen == {"transformer", "transformer_2"}


def _adapters(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(checkpoint / "adapters.safetensors")


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    """The experts (``transformer``, ``transformer_2``) whose adapters differ between two checkpoints."""
    assert before.keys() == after.keys() and {k.split(".", 1)[0] for k in before} == set(SPANS)
    return {name.split(".", 1)[0] for name in before if not torch.equal(before[name], after[name])}


def _check_steps(out: Path, records: list[dict]) -> None:
    """Each recorded step's sigmas lie in its expert's range, and between the checkpoints around it only that
    expert's adapters changed (the other's weights and Adam moments untouched: its gradients stayed None)."""
    for position, row in enumerate(records, start=1):
        lo, hi = SPANS[row["expert"]]
        assert all(lo <= 1000 * s <= hi for s in row["sigma"]), row
        before = out / "checkpoints" / f"step-{position - 1:08d}"
        after = _adapters(out / "checkpoints" / f"step-{position:08d}")
        if before.exists():
            assert _changed(_adapters(before), after) == {row["expert"]}, (position, row)
    assert {row["expert"] for row in records} == set(SPANS)


@pytest.mark.slow
def test_both_trains_each_expert_on_its_steps_and_resumes_the_same_sequence(a14b, tmp_path):
    """6 steps with a checkpoint at each; then the same run stopped at step 3 and resumed: the same experts, the
    same sigmas, the same adapters (both experts' optimizer moments and the schedule come back)."""
    cfg = write_settings(tmp_path / "both.json", expert="both", lora_rank=4, lora_alpha=8, lr=1e-2,
                         keep_checkpoints=10)  # fmt: skip
    out, cut = tmp_path / "out", tmp_path / "cut"
    common = ("--plan", a14b.plan, "--cache", a14b.cache, "--config", cfg)
    result, _ = train_quiet(*common, "--output-dir", out, "--max-steps", 6, "--record-samples", out / "rec")
    assert result.steps == 6
    records = [json.loads(line) for line in (out / "rec" / "rank-0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 0, 1, 2]
    _check_steps(out, records)

    train_quiet(*common, "--output-dir", cut, "--max-steps", 3, "--record-samples", cut / "rec")
    resumed, _ = train_quiet(*common, "--output-dir", cut, "--max-steps", 6, "--record-samples", cut / "rec",
                             "--resume")  # fmt: skip
    assert resumed.steps == 3
    again = [json.loads(line) for line in (cut / "rec" / "rank-0.jsonl").read_text().splitlines()]
    assert again == records
    final, replayed = (_adapters(d / "checkpoints" / "step-00000006") for d in (out, cut))
    assert all(torch.equal(final[k], replayed[k]) for k in final)


@pytest.mark.slow
def test_both_exports_load_into_both_transformers_and_give_the_trained_outputs(a14b, tmp_path):
    """OUTPUT/lora loads into transformer, OUTPUT/lora_2 with load_into_transformer_2=True (as the run prints);
    each transformer then gives the outputs of the trained expert; validation runs the trained pair."""
    from diffusers import WanPipeline

    from train.config import load_config
    from train.lora import add_lora

    cfg = write_settings(tmp_path / "both.json", expert="both", lora_rank=4, lora_alpha=8, lr=1e-2,
                         validation_every=3, validation_steps=2, validation_size=64, validation_frames=5)  # fmt: skip
    out = tmp_path / "out"
    result, printed = train_quiet("--plan", a14b.plan, "--cache", a14b.cache, "--config", cfg, "--output-dir", out,
                                  "--max-steps", 3)  # fmt: skip
    assert result.steps == 3
    for folder in ("lora", "lora_2"):
        record = json.loads((out / folder / "lora.json").read_text())
        assert (record["family"], record["component"], record["steps"]) == ("wan2.2-a14b", "transformer", 3)
    assert sorted(p.name for p in (out / "validation" / "step-00000003").iterdir()) == [
        "00.mp4", "00.png", "01.mp4", "01.png"]
    code = printed_code(printed, "load them into the base pipeline")
    assert code.splitlines()[-2:] == [f"pipe.load_lora_weights({str(out / 'lora')!r})",
                                      f"pipe.load_lora_weights({str(out / 'lora_2')!r}, load_into_transformer_2=True)"]

    both = _setup(a14b, expert="both", lora_rank=4)
    add_lora(both.model, load_config(cfg), targets=both.lora_targets)
    params = dict(both.model.named_parameters())
    with torch.no_grad():
        for name, tensor in _adapters(out / "checkpoints" / "step-00000003").items():
            params[name].copy_(tensor)
    scope: dict[str, Any] = {}
    exec(code, scope)
    pipe, batch = scope["pipe"], _batches(a14b)[0]
    assert isinstance(pipe, WanPipeline)
    for name, expert in (("transformer", "high"), ("transformer_2", "low")):
        one = _setup(a14b, expert=expert)
        base = recipe_outputs(one, one.model, batch)
        want = recipe_outputs(one, both.model.experts[name], batch)
        loaded = recipe_outputs(one, getattr(pipe, name), batch)
        torch.testing.assert_close(loaded, want, rtol=1e-4, atol=1e-5)
        assert (loaded - base).abs().max() > 100 * (loaded - want).abs().max(), name  # its adapters do act


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.full
def test_both_on_two_ddp_processes_steps_one_expert_and_leaves_the_other_untouched(a14b, tmp_path):
    """accelerate launch, 2 processes over gloo: every rank trains the same expert at each step (the other
    expert's part of the one DDP model sees no forward), and between checkpoints only that expert changes."""
    from tests.test_train_dist import launch

    cfg = write_settings(tmp_path / "both.json", expert="both", lora_rank=4, lora_alpha=8, lr=1e-2,
                         keep_checkpoints=10)  # fmt: skip
    out = tmp_path / "out"
    launch(2, "--plan", a14b.plan2, "--cache", a14b.cache, "--config", cfg, "--output-dir", out, "--max-steps", 4,
           "--record-samples", out / "rec")  # fmt: skip
    ranks = [[json.loads(line) for line in (out / "rec" / f"rank-{r}.jsonl").read_text().splitlines()]
             for r in range(2)]  # fmt: skip
    assert len(ranks[0]) == 4 and [r["expert"] for r in ranks[0]] == [r["expert"] for r in ranks[1]]
    _check_steps(out, ranks[0])
    _check_steps(out, ranks[1])
