"""One pixel limit: the scan judges images by it, the manifest records it, rebucket keeps it, embed decodes up to it."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from manifests.buckets import BucketSpec
from manifests.cache import read_index
from manifests.manifest import read_manifest, write_manifest
from manifests.schema import MAX_PIXELS, sample_id
from pipeline import RebucketJob, ScanJob, run
from pipeline.cli import main
from pipeline.scan import ScanConfig
from tests.corpus import png_declaring
from tests.embed_data import embed_args, embed_cache
from tests.factories import manifest_tables

OLD_EMBED_LIMIT = 100_000_000  # what embed refused above before the limit was the manifest's


def solid_jpeg(width: int, height: int) -> bytes:
    """A one-colour greyscale JPEG: ~0.3 s to encode 10^8 pixels, and it decodes at 1/8 scale."""
    buf = io.BytesIO()
    Image.new("L", (width, height), 128).save(buf, "JPEG", quality=50)
    return buf.getvalue()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("bucketeer_home")
@pytest.mark.full
def test_the_manifests_limit_governs_scan_and_embed(tmp_path, ray_local):
    data, manifest, cache = tmp_path / "data", str(tmp_path / "manifest"), str(tmp_path / "cache")
    data.mkdir()
    limit = 120_000_000  # above the old embed limit, below MAX_PIXELS: not the default
    (data / "big.jpg").write_bytes(solid_jpeg(11_000, 10_000))  # 110 MP: within the limit
    (data / "small.jpg").write_bytes(solid_jpeg(64, 48))
    (data / "grows.png").write_bytes(png_declaring(64, 64))
    run(ScanJob(source=str(data), out=manifest, spec=BucketSpec(area=64 * 64),
                config=ScanConfig(max_pixels=limit, progress=False)))
    m = read_manifest(manifest)
    assert m.max_pixels == limit == json.loads((tmp_path / "manifest" / "_manifest.json").read_text())["max_pixels"]
    assert sorted(m.samples.column("filename").to_pylist()) == ["big.jpg", "grows.png", "small.jpg"]

    # after the scan the file grows past the manifest's limit (but not past MAX_PIXELS): embed refuses it
    (data / "grows.png").write_bytes(png_declaring(11_000, 11_000))
    embed_cache(manifest, cache)
    index = read_index(cache)
    embedded = set(index["samples"].column("sample_id").to_pylist())
    assert {sample_id("big.jpg"), sample_id("small.jpg")} <= embedded and 11_000 * 10_000 > OLD_EMBED_LIMIT
    errors = index["errors"].to_pylist()
    assert [(e["filename"], e["error"]) for e in errors] == [("grows.png", "too_many_pixels")]
    assert f"{limit:,}-pixel limit" in errors[0]["message"]


def test_scan_records_the_limit_and_rebucket_keeps_it(tmp_path, capsys):
    url, rebucketed = str(tmp_path / "m"), str(tmp_path / "r")
    write_manifest(url, *manifest_tables(20, seed=3), source="/d", spec=BucketSpec(), max_pixels=4_000_000)
    run(RebucketJob(manifest=url, out=rebucketed, spec=BucketSpec(area=512 * 512)))
    assert read_manifest(rebucketed).max_pixels == 4_000_000
    # one option, on the scan, that can only lower the limit; embed has none of its own
    assert main(["scan", str(tmp_path), "--out", url, "--max-pixels", str(MAX_PIXELS + 1)]) == 2
    assert "can only lower the limit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        embed_args(url, str(tmp_path / "c"), "--max-pixels", "1000")
    # a manifest written before the field existed: its scan summary's figure, else the default
    meta_path = tmp_path / "m" / "_manifest.json"
    meta = json.loads(meta_path.read_text())
    del meta["max_pixels"]
    meta_path.write_text(json.dumps(dict(meta, summary={"max_pixels": 5_000_000})))
    assert read_manifest(url).max_pixels == 5_000_000
    meta_path.write_text(json.dumps(dict(meta, summary={})))
    assert read_manifest(url).max_pixels == MAX_PIXELS
