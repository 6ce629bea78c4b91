"""`bucketeer demo --family flux2|flux2-klein|chroma`: the whole flow on tiny random-weight pipelines, on the CPU.

Scan, embed (Ray), plan, two training processes (caption dropout, an EMA, validation images at the end),
verify, report: 40 images, as the SDXL demo test. For flux2, the demo's training is run again in two launches
of the demo's own 2-process launcher, stopped after 3 steps and resumed: the model equals the demo's
straight run (each recipe's exact resume is also tested in process, tests/test_train_flux2.py). In a file of
its own, so that pytest-xdist (make test: --dist loadfile) runs it beside the other demos.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_demo import run_demo


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
@pytest.mark.parametrize("family", ["flux2", "flux2-klein", "chroma"])
@pytest.mark.full
def test_demo_family_trains_end_to_end(tmp_path, bucketeer_home, family):
    out = tmp_path / "out"
    output, _ = run_demo(tmp_path, "--family", family, "--images", "40", "--out-dir", str(out))
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["embed"]["samples"] == 40 and figures["train"]["steps"] >= 2
    cache = json.loads((out / "cache" / "_cache.json").read_text())
    assert cache["family"] == family and len(cache["text"]["validation_prompts"]) == 2
    assert cache["latent"]["channels"] == (16 if family == "chroma" else 128)
    images = sorted((out / "train" / "validation").glob("step-*/*.png"))
    assert len(images) == 2, output[-3000:]  # one per validation prompt, after the last step
    assert (out / "train" / "model" / "config.json").exists() and (out / "train" / "model_ema").is_dir()
    if family != "flux2":
        return

    from safetensors.torch import load_file

    from pipeline.demo.trainer import train

    steps = figures["train"]["steps"]
    config = out / "train-config.yaml"
    config.write_text(config.read_text().replace("checkpoint_every: 100", "checkpoint_every: 1"))
    again = tmp_path / "again"
    again.mkdir()
    argv = ["--plan", str(out / "plan"), "--cache", str(out / "cache"), "--output-dir", str(again / "train"),
            "--config", str(config)]  # fmt: skip
    train([*argv, "--max-steps", str(steps // 2)], again)
    train([*argv, "--resume"], again)
    name = "model/diffusion_pytorch_model.safetensors"
    a, b = load_file(out / "train" / name), load_file(again / "train" / name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
