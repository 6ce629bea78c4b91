"""`bucketeer demo --family ltx-2`: generated clips -> scan --frames -> embed with LTX-2's VAE and Gemma -> train.

The Wan demos' path with LTX-2's options: bucket sides in steps of 32 (its VAE is 32x), frame buckets 9 and 17
(8k + 1), the recipe's video-only training (the audio stream fed as noise), validation clips of 9 frames.
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
def test_demo_family_ltx2_embeds_clips_with_its_vae_and_trains(tmp_path, bucketeer_home):
    out = tmp_path / "out"
    output, seconds = run_demo(tmp_path, "--family", "ltx-2", "--out-dir", str(out))
    print(f"bucketeer demo --family ltx-2 took {seconds:.1f} s")
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["embed"]["samples"] == figures["scan"]["samples"] > 0, output[-3000:]
    assert figures["train"]["steps"] >= 1
    cache = json.loads((out / "cache" / "_cache.json").read_text())
    assert cache["family"] == "ltx-2" and cache["latent"]["temporal_factor"] == 8
    assert (cache["latent"]["channels"], cache["latent"]["factor"]) == (8, 32) and "normalised" in cache["latent"]
    assert "--bucket-step 32" in output
    assert sorted((out / "train" / "validation").glob("step-*/*.mp4")), output[-3000:]
