"""Paired conditioning images: ``scan --conditioning`` (a root or a --captions column) -> one manifest row
per pair with error rows for missing, mis-sized and unreadable pairs; rescans re-probe a changed side;
embed encodes the conditioning image with exactly the target's crop (``cond_latent``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from manifests.buckets import BucketSpec
from manifests.manifest import read_manifest
from pipeline.scan import scan_dataset
from pipeline.scan.job import ScanConfig
from tests.embed_data import jpeg

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
    meta = scan_dataset(ds, out, spec=SPEC, conditioning=cond, config=QUIET)
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
    assert meta["conditioning"] == {"root": cond, "column": None}
    assert meta["summary"]["conditioning_probed"] == 5


def test_rescan_reprobes_only_changed_pairs(pairs, tmp_path):
    base, ds, cond, out, _ = pairs
    again = str(tmp_path / "again")
    first = scan_dataset(ds, again, spec=SPEC, conditioning=cond, config=QUIET, previous=out)
    assert first["summary"]["conditioning_probed"] == 2  # the mismatched and unusable pairs again; no sample
    assert first["fingerprint"] == read_manifest(out).fingerprint
    # fix img_1's pair and break img_4's: both re-probed, the pairs' rows follow
    Path(cond, "img_1.jpg").write_bytes(jpeg(96, 64, 7))
    Path(cond, "img_4.jpg").write_bytes(jpeg(80, 96, 7))
    second = scan_dataset(ds, again, spec=SPEC, conditioning=cond, config=QUIET)
    m = read_manifest(again)
    assert {r["filename"] for r in m.samples.to_pylist()} == {"img_1.jpg", "img_2.jpg", "sub/img_5.jpg"}
    assert {r["filename"]: r["error"] for r in m.errors.to_pylist()}["img_4.jpg"] == "conditioning_mismatch"
    assert second["summary"]["reused"] == 6 and second["summary"]["conditioning_probed"] == 3


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
    meta = scan_dataset(str(ds), out, spec=SPEC, captions=str(table), conditioning="control", config=QUIET)
    m = read_manifest(out)
    assert meta["counts"]["listed"] == 3 and meta["summary"]["conditioning_files"] == 2  # maps are no samples
    assert [(r["filename"], r["conditioning"], r["caption"]) for r in m.samples.to_pylist()] == [
        ("img_0.jpg", "maps/m0.png", "zero")]
    assert {r["filename"]: r["error"] for r in m.errors.to_pylist()} == {
        "img_1.jpg": "conditioning_mismatch", "img_2.jpg": "conditioning_missing"}
    assert meta["conditioning"] == {"root": str(ds), "column": "control"}
