"""`bucketeer demo --family wan`: generated clips -> scan --frames -> embed (video) -> plan -> train, end to end.

Its own file so that pytest-xdist (make test: --dist loadfile) runs it beside the other demos.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("av")

from pipeline.demo.job import VIDEO_WHERE  # noqa: E402
from pipeline.sample_data import CUT_AT  # noqa: E402
from tests.test_demo import run_demo  # noqa: E402


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
@pytest.mark.full
def test_demo_family_wan_embeds_clips_and_trains(tmp_path, bucketeer_home):
    out = tmp_path / "out"
    output, _ = run_demo(tmp_path, "--family", "wan", "--out-dir", str(out))
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["embed"]["samples"] == figures["scan"]["samples"] > 0, output[-3000:]
    assert figures["train"]["steps"] >= 1
    cache = json.loads((out / "cache" / "_cache.json").read_text())
    assert cache["family"] == "wan" and cache["latent"]["temporal_factor"] == 4
    assert cache["settings"]["video"]["max_clips"] == 4
    # prepared as people prepare video: shots, motion and a caption per shot; clips inside the shots, each with its
    # own shot's caption; the still clip left out by --where
    assert figures["annotate"]["tasks"] == ["scenes", "motion", "caption"] and figures["annotate"]["errors"] == 0
    assert figures["plan"]["where"] == VIDEO_WHERE and figures["plan"]["dropped_by_where"] == 1, output[-3000:]
    from manifests.annotations import read_annotations
    from manifests.manifest import read_manifest

    rows = {r["filename"]: r for r in read_manifest(str(out / "clips")).samples.to_pylist()}
    cut = rows["cases/cut.mp4"]
    assert cut["clip_starts"] == [0, CUT_AT] and cut["bucket"].endswith("x17") and cut["clip_captions"] == [0, 1]
    shots = {r["sample_id"]: r for r in read_annotations(str(out / "annotations"))[1].to_pylist()}
    assert [s["start"] for s in shots[cut["sample_id"]]["scenes"]] == [0, CUT_AT]
    assert cut["captions"] == shots[cut["sample_id"]]["scene_caption"]
    assert "rebucket" in output and "clips cut inside the shots" in output
