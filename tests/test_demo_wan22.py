"""`bucketeer demo --family wan2.2-ti2v-5b`: generated clips -> scan --frames -> embed with Wan 2.2's VAE -> train.

The demo path of the Wan 2.2 families is one, with the family's options: this runs it for TI2V-5B (its own VAE,
bucket sides in steps of 32), on its default 24 clips (fewer leave no bucket a global batch of 8);
``wan2.2-a14b`` goes through the same code with ``expert: both`` and ``lora_rank`` in the written config (checked
here without a run), and its embed, recipe and LoRA through tests/test_families_video.py and
tests/test_train_wan22.py (CI's whole run is near its limit: one demo, not two).
Its own file so that pytest-xdist (make test: --dist loadfile) runs it beside the other demos.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("av")

from tests.test_demo import run_demo  # noqa: E402


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
@pytest.mark.full
def test_demo_family_wan22_ti2v_embeds_clips_with_its_vae_and_trains(tmp_path, bucketeer_home):
    out = tmp_path / "out"
    output, seconds = run_demo(tmp_path, "--family", "wan2.2-ti2v-5b", "--out-dir", str(out))
    print(f"bucketeer demo --family wan2.2-ti2v-5b took {seconds:.1f} s")
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["embed"]["samples"] == figures["scan"]["samples"] > 0, output[-3000:]
    assert figures["train"]["steps"] >= 1
    cache = json.loads((out / "cache" / "_cache.json").read_text())
    assert cache["family"] == "wan2.2-ti2v-5b" and cache["latent"]["temporal_factor"] == 4
    assert (cache["latent"]["channels"], cache["latent"]["factor"]) == (48, 16)
    assert "--bucket-step 32" in output
    assert sorted((out / "train" / "validation").glob("step-*/*.mp4")), output[-3000:]


def test_the_a14b_demo_trains_lora_on_both_experts(tmp_path):
    from pipeline.demo.trainer import family_config
    from train.config import load_config

    _, path = family_config("wan2.2-a14b", tmp_path, plan_steps=4)
    cfg = load_config(path)
    assert (cfg.family, cfg.expert, cfg.lora_rank, cfg.validation_every) == ("wan2.2-a14b", "both", 8, 4)
    _, path = family_config("wan2.2-ti2v-5b", tmp_path, plan_steps=4)
    assert load_config(path).expert is None
