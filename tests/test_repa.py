"""REPA end to end: `embed --features dinov2` stores the DINOv2 patch features of exactly the pixels the VAE saw
(every variant's), `verify` checks them against `_cache.json`, and the trainer's `repa:` term trains, checkpoints
and resumes its projector. One embed (6 images, --flip, the tiny default DINOv2) serves every test here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from manifests.cache import CacheError, CacheWriter, read_cache_meta
from manifests.cache.records import caption_key, encode_sample, encode_text
from manifests.cache.verify import verify_cache
from manifests.errors import UsageError
from manifests.schema import sample_ids
from manifests.storage import join, open_url
from pipeline.embed.imaging import prepare_views
from tests.embed_data import embed_cache, make_dataset, records_by_id
from tests.test_cache_format import INFO, SETTINGS, sample, text
from tests.train_dataset import train_here
from train.repa import Repa, RepaConfig, interpolate_features, repa_loss, setup_repa


@pytest.fixture(scope="module")
def features_cache(tmp_path_factory, ray_local, bucketeer_home):
    base = tmp_path_factory.mktemp("repa")
    root, manifest, cache = str(base / "images"), str(base / "manifest"), str(base / "cache")
    names = make_dataset(root, manifest, n=6)
    result = embed_cache(manifest, cache, features="dinov2", flip=True)
    return {"base": base, "root": root, "manifest": manifest, "cache": cache, "names": names, "result": result,
            "home": bucketeer_home}  # fmt: skip


def _dinov2(pixels: np.ndarray, model, size: tuple[int, int]) -> np.ndarray:
    """The DINOv2 patch tokens of uint8 ``(H, W, 3)`` pixels as the module docstring of pipeline.embed.features
    says: bicubic antialiased resize to ``size``, ImageNet normalisation, last_hidden_state without CLS."""
    x = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1)[None].float() / 255.0
    x = torch.nn.functional.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    x = (x - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    with torch.inference_mode():
        tokens = model(pixel_values=x).last_hidden_state[0, 1:]  # (gh * gw, D)
    gh, gw = size[0] // model.config.patch_size, size[1] // model.config.patch_size
    return tokens.reshape(gh, gw, -1).to(torch.float16).numpy()


@pytest.mark.slow
def test_features_are_dinov2_of_each_variants_crop(features_cache):
    from transformers import Dinov2Model

    from pipeline.embed.families.tiny import tiny_dir

    meta = features_cache["result"].meta
    info = meta.features
    assert (info.class_, info.input_size, info.patch_size, info.grid, info.dim, info.dtype) == \
        ("Dinov2Model", (32, 32), 8, (4, 4), 32, "F16")  # fmt: skip
    assert meta.settings.features.weights_sha256 == info.weights_sha256 and len(info.weights_sha256) == 64
    model = Dinov2Model.from_pretrained(tiny_dir("dinov2", features_cache["home"])).eval()
    fs, root = open_url(features_cache["root"])
    by_id = dict(zip(sample_ids(features_cache["names"]), features_cache["names"]))
    records = records_by_id(features_cache["cache"])
    assert len(records) == 6
    for sid, record in records.items():
        bw, bh = (int(x) for x in record.bucket.split("x"))
        view = prepare_views(fs.cat_file(join(root, by_id[sid])), (bh, bw), sample_id=sid)[0]
        assert view.crop_top_left == record.crop_top_left
        assert record.features.dtype == np.float16 and record.variants == 2
        np.testing.assert_array_equal(record.features, _dinov2(view.pixels, model, (32, 32)))
        flipped = record.variant(1)  # the mirrored crop: its own features
        np.testing.assert_array_equal(flipped.features, _dinov2(view.pixels[:, ::-1], model, (32, 32)))
    assert verify_cache(features_cache["cache"]).ok


def test_a_cache_resumed_with_another_features_model_is_refused(features_cache, tmp_path):
    from pipeline.embed.features import build_tiny_dinov2

    other = tmp_path / "dinov2"
    build_tiny_dinov2(other)
    with pytest.raises(CacheError, match="features.id"):
        embed_cache(features_cache["manifest"], features_cache["cache"], features="dinov2", flip=True,
                    features_model=str(other))  # fmt: skip


def test_verify_checks_features_against_cache_json(tmp_path):
    features = {"kind": "dinov2", "id": "x", "grid": [2, 2], "dim": 8, "weights_sha256": "bb"}
    url = str(tmp_path / "cache")
    writer = CacheWriter(url, {**SETTINGS, "features": features}, info={**INFO, "features": features})
    writer.add_text(caption_key("a cat"), encode_text(text("a cat", 3)))
    writer.commit("texts")
    good = dataclasses.replace(sample(1, "a cat"), features=np.ones((2, 2, 8), np.float16))
    missing = sample(2, "a cat")
    wrong = dataclasses.replace(sample(3, "a cat"), features=np.ones((3, 3, 8), np.float16))
    for rec in (good, missing, wrong):
        writer.add_sample(rec.sample_id, encode_sample(rec), rec.caption_key, rec.bucket)
    writer.finish()
    reasons = {b.sample_id: b.reason for b in verify_cache(url).bad}
    assert set(reasons) == {2, 3}
    assert "no DINOv2 features" in reasons[2] and "(3, 3, 8) != grid x dim (2, 2, 8)" in reasons[3]
    # and a cache without features whose record has some
    url2 = str(tmp_path / "plain")
    writer = CacheWriter(url2, SETTINGS, info=INFO)
    writer.add_text(caption_key("a cat"), encode_text(text("a cat", 3)))
    writer.commit("texts")
    writer.add_sample(1, encode_sample(good), good.caption_key, good.bucket)
    writer.finish()
    assert "whose settings have none" in verify_cache(url2).bad[0].reason


def test_repa_loss_is_negative_cosine_to_interpolated_features():
    torch.manual_seed(0)
    project = torch.nn.Linear(6, 4)
    hidden = torch.randn(2, 6, 6)  # (B, T = 2 x 3 grid, H)
    features = torch.randn(2, 4, 6, 4).half()  # (B, gh, gw, D): twice the grid
    got = repa_loss(hidden, features, project, (2, 3))
    # by hand: bilinear 4x6 -> 2x3 without corners aligned is the mean of each 2x2 block
    f = features.float()
    target = (f[:, 0::2, 0::2] + f[:, 1::2, 0::2] + f[:, 0::2, 1::2] + f[:, 1::2, 1::2]) / 4  # (B, 2, 3, D)
    target = target.reshape(2, 6, 4)
    pred = project(hidden)
    cos = (pred * target).sum(-1) / (pred.norm(dim=-1) * target.norm(dim=-1))
    torch.testing.assert_close(got, -cos.mean())
    torch.testing.assert_close(interpolate_features(features, (4, 6)), f.reshape(2, 24, 4))


def test_repa_hooks_the_image_tokens_of_sd3_and_flux_blocks_and_refuses_a_unet():
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DModel

    batch = type("B", (), {})()
    batch.latents, batch.features = torch.randn(2, 16, 8, 8), torch.randn(2, 4, 4, 12).half()
    sd3 = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                                attention_head_dim=8, num_attention_heads=2, caption_projection_dim=16,
                                joint_attention_dim=16, pooled_projection_dim=8, pos_embed_max_size=16)  # fmt: skip
    repa = Repa(RepaConfig(depth=0, projector_dim=16), sd3, 12, "cpu")
    sd3(hidden_states=batch.latents, encoder_hidden_states=torch.randn(2, 5, 16), pooled_projections=torch.randn(2, 8),
        timestep=torch.tensor([1.0, 2.0]))
    loss = repa.loss(batch)
    loss.backward()
    assert loss.shape == () and all(p.grad is not None for p in repa.parameters())
    flux = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                  pooled_projection_dim=8, axes_dims_rope=(4, 6, 6))  # fmt: skip
    repa = Repa(RepaConfig(depth=0, projector_dim=16), flux, 12, "cpu")
    packed = batch.latents.view(2, 16, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, 16, 64)  # (B, h/2 * w/2, 64)
    flux(hidden_states=packed, encoder_hidden_states=torch.randn(2, 5, 16), pooled_projections=torch.randn(2, 8),
         timestep=torch.tensor([0.5, 0.5]), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3))
    assert torch.isfinite(repa.loss(batch))
    unet = UNet2DModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 8), norm_num_groups=4,
                       down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"))
    with pytest.raises(UsageError, match="sdxl"):
        Repa(RepaConfig(depth=0), unet, 12, "cpu")
    with pytest.raises(UsageError, match="depth 5"):
        Repa(RepaConfig(depth=5), sd3, 12, "cpu")
    with pytest.raises(UsageError, match="unknown keys"):
        RepaConfig.from_json({"depth": 1, "wieght": 1.0})


def test_training_with_repa_saves_and_resumes_the_projector(features_cache, tmp_path):
    from pipeline import PlanJob, run
    from train.config import DEFAULT_CONFIG

    plan = str(tmp_path / "plan")
    run(PlanJob(manifests=(features_cache["manifest"],), out=plan, world_size=1, batch_size=2, epochs=2, seed=3,
                cache=(features_cache["cache"],)))  # fmt: skip
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    cfg.update(repa={"weight": 0.5, "depth": 1, "projector_dim": 32}, checkpoint_every=2, warmup_steps=0)
    config = tmp_path / "repa.yaml"
    config.write_text(yaml.safe_dump(cfg))
    args = ("--plan", plan, "--cache", features_cache["cache"], "--config", config)
    whole = train_here(*args, "--output-dir", tmp_path / "whole", "--max-steps", 4)
    train_here(*args, "--output-dir", tmp_path / "split", "--max-steps", 2)
    resumed = train_here(*args, "--output-dir", tmp_path / "split", "--max-steps", 4, "--resume")
    assert whole.position == resumed.position == 4 and resumed.steps == 2
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / run_ / "checkpoints" / "step-00000004" / "repa.safetensors"))
            for run_ in ("whole", "split"))  # fmt: skip
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.last_loss == pytest.approx(whole.last_loss, rel=1e-5)
    first = load_file(str(tmp_path / "split" / "checkpoints" / "step-00000002" / "repa.safetensors"))
    assert any(not torch.equal(first[k], a[k]) for k in a)  # trained between the checkpoints
    # a checkpoint without a projector, or a cache without features: one-line errors naming the fix
    plain = {k: v for k, v in cfg.items() if k != "repa"}
    config.write_text(yaml.safe_dump(plain))
    train_here(*args, "--output-dir", tmp_path / "plain", "--max-steps", 2)
    config.write_text(yaml.safe_dump(cfg))
    with pytest.raises(UsageError, match="trained without REPA"):
        train_here(*args, "--output-dir", tmp_path / "plain", "--max-steps", 4, "--resume")
    meta = dataclasses.replace(read_cache_meta(features_cache["cache"]), features=None)
    with pytest.raises(UsageError, match="--features dinov2"):
        setup_repa(None, {"depth": 0}, torch.nn.Linear(1, 1), meta, 0)
    assert json.loads(Path(features_cache["cache"], "_cache.json").read_text())["features"]["grid"] == [4, 4]
