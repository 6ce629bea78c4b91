"""`bucketeer demo --family sdxl`: the whole flow on a tiny random-weight SDXL, as the README shows it.

Its own file so that pytest-xdist (make test: --dist loadfile) runs it beside tests/test_demo.py.
"""

from __future__ import annotations

import json

import pytest

from tests.test_demo import run_demo


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
@pytest.mark.full
def test_demo_family_sdxl_fine_tunes_and_writes_validation_images(tmp_path, bucketeer_home):
    out = tmp_path / "out"
    output, _ = run_demo(tmp_path, "--family", "sdxl", "--images", "40", "--out-dir", str(out))
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["scan"]["samples"] == 40 and figures["embed"]["samples"] == 40
    cache = json.loads((out / "cache" / "_cache.json").read_text())
    assert cache["family"] == "sdxl" and len(cache["text"]["validation_prompts"]) == 2
    config = (out / "train-config.yaml").read_text()
    assert "ema_decay" in config and "caption_dropout" in config
    images = sorted((out / "train" / "validation").glob("step-*/*.png"))
    assert len(images) >= 2, output[-3000:]  # one per validation prompt, at the end of the run at least
    assert (out / "train" / "model" / "config.json").exists()
    assert (out / "train" / "model_ema").is_dir()
    # what a newcomer opens next: TensorBoard (tensorboard --logdir OUTPUT/logs) holds the loss, last step included
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = figures["train"]["steps"]
    logs = next((out / "train" / "logs").rglob("events.out.tfevents.*")).parent
    losses = EventAccumulator(str(logs)).Reload().Scalars("loss")
    assert losses and losses[-1].step == steps, (steps, [e.step for e in losses])
    assert f"tensorboard --logdir {out / 'train'}/logs" in output
