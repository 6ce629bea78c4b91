"""`bucketeer demo --family qwen-image` and `--family z-image`: generated images -> scan -> embed -> plan -> train
(2 CPU processes, LoRA-free fine-tune with an EMA, caption dropout and validation images) -> verify -> report,
with the family's tiny random-weight pipeline. Its own file so that pytest-xdist runs it beside the other demos.
`--family qwen-image-edit`: the same on (image, grey reference) pairs, scanned with --conditioning, without caption
dropout or validation images (both would need a reference).
"""

from __future__ import annotations

import json

import pytest

from tests.test_demo import run_demo


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
@pytest.mark.parametrize("family", ["qwen-image", "z-image"])
@pytest.mark.full
def test_demo_family_embeds_and_fine_tunes(tmp_path, bucketeer_home, family):
    out = tmp_path / "out"
    output, _ = run_demo(tmp_path, "--family", family, "--images", "40", "--out-dir", str(out))
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["embed"]["samples"] == figures["scan"]["samples"] == 40, output[-3000:]
    assert figures["train"]["steps"] >= 2 and figures["train"]["loss_last"] is not None
    cache = json.loads((out / "cache" / "_cache.json").read_text())
    assert cache["family"] == family and cache["text"]["layout"]["masked"]
    assert ("normalised" in cache["latent"]) == (family == "qwen-image")
    assert (out / "train" / "model" / "config.json").exists() and (out / "train" / "model_ema").is_dir()
    assert sorted(p.name for p in (out / "train" / "validation").glob("step-*/*.png")) == ["00.png", "01.png"]


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
@pytest.mark.full
def test_demo_qwen_image_edit_embeds_pairs_and_fine_tunes(tmp_path, bucketeer_home):
    from manifests.cache import CacheReader

    out = tmp_path / "out"
    output, _ = run_demo(tmp_path, "--family", "qwen-image-edit", "--images", "40", "--out-dir", str(out))
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["embed"]["samples"] == figures["scan"]["samples"] == 40, output[-3000:]
    assert "--conditioning" in output and "--reference-resolution 256" in output
    assert figures["train"]["steps"] >= 2 and figures["train"]["loss_last"] is not None
    reader = CacheReader(str(out / "cache"))
    assert reader.meta.family == "qwen-image-edit" and reader.meta.text.empty_caption_key is None
    records = reader.read(list(reader.sample_ids)[:4])
    # every sample's text inline, keyed by its own (instruction, reference); a reference latent per record
    assert all(r.text is not None and r.cond_latent is not None for r in records)
    assert len({r.caption_key for r in records}) == 4
    assert (out / "train" / "model" / "config.json").exists() and not (out / "train" / "validation").exists()
