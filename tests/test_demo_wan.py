"""`bucketeer demo --family wan`: generated clips -> scan --frames -> embed (video) -> plan -> train, end to end.

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
def test_demo_family_wan_embeds_clips_and_trains(tmp_path, bucketeer_home):
    out = tmp_path / "out"
    output, _ = run_demo(tmp_path, "--family", "wan", "--out-dir", str(out))
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["embed"]["samples"] == figures["scan"]["samples"] > 0, output[-3000:]
    assert figures["train"]["steps"] >= 1
    cache = json.loads((out / "cache" / "_cache.json").read_text())
    assert cache["family"] == "wan" and cache["latent"]["temporal_factor"] == 4
    assert cache["settings"]["video"]["max_clips"] == 4
