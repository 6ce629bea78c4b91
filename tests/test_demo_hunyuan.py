"""`bucketeer demo --family hunyuanvideo-1.5`: generated clips -> scan --frames -> embed with its VAE and both
text encoders -> train (2 processes), validation clips at the end.

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
def test_demo_family_hunyuan_embeds_clips_with_both_text_streams_and_trains(tmp_path, bucketeer_home):
    out = tmp_path / "out"
    output, seconds = run_demo(tmp_path, "--family", "hunyuanvideo-1.5", "--out-dir", str(out))
    print(f"bucketeer demo --family hunyuanvideo-1.5 took {seconds:.1f} s")
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["embed"]["samples"] == figures["scan"]["samples"] > 0, output[-3000:]
    assert figures["train"]["steps"] >= 1
    cache = json.loads((out / "cache" / "_cache.json").read_text())
    assert cache["family"] == "hunyuanvideo-1.5" and cache["latent"]["temporal_factor"] == 4
    assert (cache["latent"]["channels"], cache["latent"]["factor"]) == (8, 16)
    layout = cache["text"]["layout"]
    assert (layout["join"], layout["lengths"]) == ("streams", [1000, 256])
    assert "--bucket-step 32" in output
    assert sorted((out / "train" / "validation").glob("step-*/*.mp4")), output[-3000:]
    assert "pipe.transformer.load_lora_adapter" not in output  # a full fine-tune: from_pretrained lines
