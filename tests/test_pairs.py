"""Paired conditioning images: ``scan --conditioning`` (a root or a --captions column) -> one manifest row
per pair with error rows for missing, mis-sized and unreadable pairs; rescans re-probe a changed side;
embed encodes the conditioning image with exactly the target's crop (``cond_latent``)."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from PIL import Image

from manifests.buckets import BucketSpec, parse_bucket
from manifests.cache import CacheReader, read_cache_meta
from manifests.cache.verify import verify_cache
from manifests.manifest import read_manifest
from manifests.schema import CONDITIONING_COLUMNS
from pipeline.embed.imaging import prepare_views
from pipeline import ScanJob, run
from pipeline.scan import ScanConfig
from tests.embed_data import embed_args, jpeg, records_by_id, embed_cache

pytestmark = pytest.mark.ray
SPEC = BucketSpec(area=64 * 64, step=32)
QUIET = ScanConfig(progress=False)


def _pairs(base: Path) -> tuple[str, str]:
    """6 images under ``ds/``, their conditioning maps under ``cond/`` (and ``ds/cond/`` for column mode):
    img_0 has none, img_1's is 8 px too wide, img_2's is stored sideways with EXIF orientation 6 (a
    good pair), img_3's is not an image; the rest pair up."""
    ds, cond = base / "ds", base / "cond"
    (ds / "sub").mkdir(parents=True)
    (cond / "sub").mkdir(parents=True)
    for i in range(6):
        name = f"sub/img_{i}.jpg" if i == 5 else f"img_{i}.jpg"
        w, h = (96, 64) if i % 2 else (64, 96)
        (ds / name).write_bytes(jpeg(w, h, i))
        if i == 0:
            continue
        if i == 1:
            data = jpeg(w + 8, h, 100 + i)
        elif i == 2:
            data = jpeg(h, w, 100 + i, orientation=6)  # stored 96x64, displayed 64x96 like its target
        elif i == 3:
            data = b"<html>not an image</html>"
        else:
            data = jpeg(w, h, 100 + i)
        (cond / name).write_bytes(data)
    return str(ds), str(cond)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, ray_local):
    base = tmp_path_factory.mktemp("pairs")
    ds, cond = _pairs(base)
    out = str(base / "manifest")
    meta = run(ScanJob(source=ds, out=out, spec=SPEC, conditioning=cond, config=QUIET)).meta
    return base, ds, cond, out, meta


def test_pairs_and_error_rows(pairs):
    base, ds, cond, out, meta = pairs
    m = read_manifest(out)
    samples = {r["filename"]: r for r in m.samples.to_pylist()}
    errors = {r["filename"]: r for r in m.errors.to_pylist()}
    assert set(samples) == {"img_2.jpg", "img_4.jpg", "sub/img_5.jpg"}
    assert {n: e["error"] for n, e in errors.items()} == {
        "img_0.jpg": "conditioning_missing", "img_1.jpg": "conditioning_mismatch", "img_3.jpg": "conditioning_unusable"}
    assert "104x64" in errors["img_1.jpg"]["message"] and "not_an_image" in errors["img_3.jpg"]["message"]
    for name, row in samples.items():
        assert row["conditioning"] == name
        assert row["conditioning_size"] == os.path.getsize(os.path.join(cond, name))
        assert row["conditioning_mtime"] is not None
    assert meta.conditioning.to_json() == {"root": cond, "column": None}
    assert meta.summary.conditioning_probed == 5


def test_rescan_reprobes_only_changed_pairs(pairs, tmp_path):
    base, _, _, out, _ = pairs
    ds, cond = str(tmp_path / "ds"), str(tmp_path / "cond")
    shutil.copytree(base / "ds", ds, copy_function=shutil.copy2)  # same sizes and mtimes: the rows are reused
    shutil.copytree(base / "cond", cond, copy_function=shutil.copy2)
    again = str(tmp_path / "again")
    first = run(ScanJob(source=ds, out=again, spec=SPEC, conditioning=cond, config=QUIET, previous=out)).meta
    assert first.summary.conditioning_probed == 2  # the mismatched and unusable pairs again; no sample
    assert read_manifest(again).samples.equals(read_manifest(out).samples)
    # fix img_1's pair and break img_4's: both re-probed, the pairs' rows follow
    Path(cond, "img_1.jpg").write_bytes(jpeg(96, 64, 7))
    Path(cond, "img_4.jpg").write_bytes(jpeg(80, 96, 7))
    second = run(ScanJob(source=ds, out=again, spec=SPEC, conditioning=cond, config=QUIET)).meta
    m = read_manifest(again)
    assert {r["filename"] for r in m.samples.to_pylist()} == {"img_1.jpg", "img_2.jpg", "sub/img_5.jpg"}
    assert {r["filename"]: r["error"] for r in m.errors.to_pylist()}["img_4.jpg"] == "conditioning_mismatch"
    assert second.summary.reused == 6 and second.summary.conditioning_probed == 3


def test_column_of_the_caption_table(tmp_path, ray_local):
    ds = tmp_path / "ds"
    (ds / "maps").mkdir(parents=True)
    for i in range(3):
        (ds / f"img_{i}.jpg").write_bytes(jpeg(64, 96, i))
    (ds / "maps" / "m0.png").write_bytes(jpeg(64, 96, 50))
    (ds / "maps" / "m1.png").write_bytes(jpeg(64, 64, 51))
    table = tmp_path / "captions.jsonl"
    table.write_text("\n".join(json.dumps(r) for r in [
        {"filename": "img_0.jpg", "caption": "zero", "control": "maps/m0.png"},
        {"filename": "img_1.jpg", "caption": "one", "control": "./maps/m1.png"},
        {"filename": "img_2.jpg", "caption": "two", "control": None}]))
    out = str(tmp_path / "m")
    meta = run(ScanJob(source=str(ds), out=out, spec=SPEC, captions=str(table), conditioning="control",
                       config=QUIET)).meta
    m = read_manifest(out)
    assert meta.counts.listed == 3 and meta.summary.conditioning_files == 2  # maps are no samples
    assert [(r["filename"], r["conditioning"], r["caption"]) for r in m.samples.to_pylist()] == [
        ("img_0.jpg", "maps/m0.png", "zero")]
    assert {r["filename"]: r["error"] for r in m.errors.to_pylist()} == {
        "img_1.jpg": "conditioning_mismatch", "img_2.jpg": "conditioning_missing"}
    assert meta.conditioning.to_json() == {"root": str(ds), "column": "control"}


# --- embed: conditioning latents with the target's crop, --flip and --crops variants, and the trainer ----------


@pytest.fixture(scope="module")
def paired_cache(pairs, bucketeer_home):
    """The pairs' manifest embedded with 2 crops x flips, in fp32 (so latents compare to fp32 tolerance)."""
    base, ds, cond, out, _ = pairs
    cache = str(base / "cache")
    embed_cache(out, cache, crops=2, flip=True, dtype="fp32", seed=5)
    return out, cache


def _vae(manifest: str, cache: str):
    from pipeline.embed.job import _factories

    make_vae, _ = _factories(embed_args(manifest, cache), "F32")
    return make_vae(use_gpu=False)


@pytest.mark.slow
@pytest.mark.full
def test_conditioning_and_variant_latents(pairs, paired_cache):
    base, ds, cond, _, _ = pairs
    manifest, cache = paired_cache
    meta = read_cache_meta(cache)
    assert meta.settings.hashed["variants"] == {"crops": 2, "flip": True} and "conditioning" in meta.settings.hashed
    checked = verify_cache(cache)  # 4 variants and a conditioning latent in every record, as the settings say
    assert checked.ok and checked.checked_samples == 3
    vae = _vae(manifest, cache)
    records = records_by_id(cache)
    rows = read_manifest(manifest).samples.to_pylist()
    assert {r["sample_id"] for r in rows} == set(records)
    for row in rows:
        rec = records[row["sample_id"]]
        bw, bh = parse_bucket(row["bucket"])
        views = prepare_views(Path(ds, row["filename"]).read_bytes(), (bh, bw), seed=5, sample_id=row["sample_id"],
                              crops=2)  # fmt: skip
        assert views[0].crop_top_left != views[1].crop_top_left  # two different crops, from (seed, sample id)
        again = prepare_views(Path(ds, row["filename"]).read_bytes(), (bh, bw), seed=5, sample_id=row["sample_id"],
                              crops=2)  # fmt: skip
        assert [v.crop_top_left for v in again] == [v.crop_top_left for v in views]  # reproducible
        conds = prepare_views(Path(cond, row["conditioning"]).read_bytes(), (bh, bw),
                              at=[v.crop_top_left for v in views], size=views[0].original_size)  # fmt: skip
        assert rec.variants == 4 and rec.variant_flips.tolist() == [0, 1, 0, 1]
        resized_w = views[0].resized_size[1]
        inputs, stored = [], []
        for v in range(4):
            k, flipped = divmod(v, 2)
            one = rec.variant(v)
            top, left = views[k].crop_top_left
            # SDXL's mirrored crop box: left -> resized_w - left - target_w
            assert one.crop_top_left == ((top, resized_w - left - bw) if flipped else (top, left))
            inputs += [views[k].pixels, conds[k].pixels]
            inputs[-2:] = [x[:, ::-1] for x in inputs[-2:]] if flipped else inputs[-2:]
            stored += [one.latent, one.cond_latent]
        expected = vae.encode(np.stack(inputs))["latent"].numpy()  # (8, C, h, w): image, pair per variant
        # the worker encodes other batch compositions: equal to fp32 tolerance, not bitwise
        np.testing.assert_allclose(np.stack(stored), expected, rtol=1e-4, atol=1e-5)
        # the flipped variant is the mirrored image's crop at the mirrored box (Lanczos: within one level)
        mirrored = Image.open(io.BytesIO(Path(ds, row["filename"]).read_bytes())).transpose(Image.FLIP_LEFT_RIGHT)
        buf = io.BytesIO()
        mirrored.save(buf, "PNG")
        (flip_view,) = prepare_views(buf.getvalue(), (bh, bw), at=[rec.variant(1).crop_top_left])
        assert np.abs(flip_view.pixels.astype(int) - views[0].pixels[:, ::-1].astype(int)).max() <= 1


@pytest.mark.slow
@pytest.mark.full
def test_changed_conditioning_image_re_embeds(pairs, paired_cache, tmp_path):
    from manifests.cache.freshness import source_key

    manifest = read_manifest(paired_cache[0])
    keys = source_key(manifest.samples)
    changed = manifest.samples.set_column(manifest.samples.schema.get_field_index("conditioning_size"),
                                          "conditioning_size", pa.array([1] * manifest.samples.num_rows, pa.int64()))
    assert not np.any(source_key(changed) == keys)
    unpaired = manifest.samples.drop_columns(list(CONDITIONING_COLUMNS))
    assert not np.any(source_key(unpaired) == keys)  # rows without a pair keep the key they always had


@pytest.mark.slow
@pytest.mark.full
def test_trainer_batches_carry_the_chosen_variant(paired_cache):
    from train.data import BatchLoader, PlanStep, variant_choice

    _, cache = paired_cache
    reader = CacheReader(cache)
    ids = sorted(int(i) for i in reader.sample_ids)
    records = records_by_id(cache)
    steps = [PlanStep(epoch, 0, "64x64", tuple(ids)) for epoch in range(6)]
    info = reader.meta.latent
    batches = list(BatchLoader(reader, steps, info, seed=11))
    chosen = [b.variants for b in batches]
    assert chosen == [variant_choice(11, e, ids, 4).tolist() for e in range(6)]
    assert len({tuple(c) for c in chosen}) > 1  # varies across epochs
    scale, shift = float(info.scaling_factor or 1.0), float(info.shift_factor or 0.0)
    for batch in batches:
        for j, (sid, v) in enumerate(zip(batch.sample_ids, batch.variants)):
            one = records[sid].variant(v)
            assert tuple(batch.crop_top_left[j].int().tolist()) == one.crop_top_left
            np.testing.assert_allclose(batch.latents[j].numpy(), (one.latent - shift) * scale, rtol=1e-6)
            np.testing.assert_allclose(batch.cond_latents[j].numpy(), (one.cond_latent - shift) * scale, rtol=1e-6)
    # a run resumed at epoch 3 (another loader, another process) picks exactly the same variants
    resumed = list(BatchLoader(CacheReader(cache), steps[3:], info, seed=11))
    assert [b.variants for b in resumed] == chosen[3:]
    assert all(torch.equal(a.latents, b.latents) and torch.equal(a.cond_latents, b.cond_latents)
               for a, b in zip(resumed, batches[3:]))  # fmt: skip


def test_bad_conditioning_option_is_a_usage_error(tmp_path):
    from manifests.errors import UsageError

    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "img_0.jpg").write_bytes(jpeg(64, 64, 0))
    for option, says in ((str(tmp_path / "nowhere"), "no such folder"), (str(ds), "the source root itself")):
        with pytest.raises(UsageError, match=says):
            run(ScanJob(source=str(ds), out=str(tmp_path / "m"), spec=SPEC, conditioning=option, config=QUIET))
    assert not (tmp_path / "m").exists()  # nothing written
