"""``_manifest.json`` is parsed once into :class:`ManifestMeta` and written back byte for byte, and the
scan, rebucket and stats jobs are typed objects that ``job_from_args`` builds and ``run(job)`` runs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from manifests.buckets import BucketSpec
from manifests.manifest import ManifestError, read_manifest, read_manifest_meta, write_manifest
from manifests.manifest_meta import ManifestMeta
from pipeline import RebucketJob, ScanJob, StatsJob, run
from pipeline.cli import build_parser
from pipeline.scan import ScanConfig
from tests.corpus import _pixels, _save
from tests.factories import manifest_tables

FIXTURES = Path(__file__).parent / "fixtures" / "v0_2"


def _job(argv: list[str]):
    args = build_parser(argv[0]).parse_args(argv)
    return args._module.job_from_args(args)


@pytest.mark.parametrize("name", ["manifest", "manifest-512"])
def test_fixtures_read_into_typed_meta_and_back_exactly(name):
    text = (FIXTURES / name / "_manifest.json").read_text()
    meta = read_manifest_meta(str(FIXTURES / name))
    assert meta.to_json() == json.loads(text)
    assert json.dumps(meta.to_json(), indent=2, sort_keys=True) + "\n" == text  # the bytes written
    assert meta.counts.samples == 24 and meta.counts.listed == 27 and meta.parts.samples[0].rows == 24
    assert meta.summary.errors_by_kind == {"empty": 1, "not_an_image": 1, "truncated": 1}
    assert meta.summary.other["plugins"] == ["pillow_heif", "pillow_jxl"]  # a key no code reads stays as it was
    want = BucketSpec(area=512 * 512) if name == "manifest-512" else BucketSpec(area=256 * 256, step=32)
    assert meta.bucket_spec == want
    assert meta.conditioning is None and read_manifest(str(FIXTURES / name)).meta == meta
    if name == "manifest-512":
        assert meta.summary.rebucketed_from == read_manifest_meta(str(FIXTURES / "manifest")).fingerprint


@pytest.mark.parametrize("change, says", [({"format_version": 99}, "format version 99; this bucketeer reads version 1"),
                                          ({"kind": "bucketeer.plan"}, "is not a bucketeer.manifest")])
def test_another_version_or_kind_is_one_line(tmp_path, change, says):
    raw = json.loads((FIXTURES / "manifest" / "_manifest.json").read_text())
    with pytest.raises(ManifestError, match=says) as direct:
        ManifestMeta.from_json({**raw, **change}, "s3://k:secret@b/m")
    assert "\n" not in str(direct.value) and "secret" not in str(direct.value)
    url = str(tmp_path / "m")
    write_manifest(url, *manifest_tables(10), source="/d", spec=BucketSpec())
    path = tmp_path / "m" / "_manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ManifestError, match=says) as read:
        read_manifest_meta(url)
    assert "\n" not in str(read.value)


def test_unknown_and_missing_keys_are_refused():
    raw = json.loads((FIXTURES / "manifest" / "_manifest.json").read_text())
    with pytest.raises(ManifestError, match=r"unknown top-level keys \['extra'\]"):
        ManifestMeta.from_json({**raw, "extra": 1}, "m")
    with pytest.raises(ManifestError, match="fingerprint"):
        ManifestMeta.from_json({k: v for k, v in raw.items() if k != "fingerprint"}, "m")
    older = {k: v for k, v in raw.items() if k != "max_pixels"}  # written before the field existed
    meta = ManifestMeta.from_json(older, "m")
    assert meta.max_pixels is None and meta.to_json() == older


def _images(root: Path) -> Path:
    root.mkdir()
    for name, (w, h) in {"square.png": (512, 512), "wide.png": (600, 400), "tall.png": (400, 600)}.items():
        (root / name).write_bytes(_save(_pixels(w=w, h=h), "PNG"))
    return root


@pytest.mark.ray
def test_resolution_reaches_the_bucket_column_through_typed_objects(tmp_path, ray_local):
    src, out = str(_images(tmp_path / "ds")), str(tmp_path / "m")
    job = ScanJob(source=src, out=out, spec=BucketSpec(area=512 * 512), config=ScanConfig(progress=False))
    assert _job(["scan", src, "--out", out, "--resolution", "512", "--no-progress"]) == job
    result = run(job)
    buckets = {r["filename"]: r["bucket"] for r in read_manifest(out).samples.to_pylist()}
    assert buckets == {"square.png": "512x512", "wide.png": "640x384", "tall.png": "384x640"}
    written = json.loads((tmp_path / "m" / "_manifest.json").read_text())
    assert result.fingerprint == written["fingerprint"] and result.meta.to_json() == written
    assert (result.listed, result.samples, result.errors, result.ignored) == (3, 3, 0, 0)
    assert result.meta.bucket_spec.area == 512 * 512 and result.errors_by_kind == {}

    # rebucket: the same option, the same way; stats reads the result
    assert _job(["rebucket", out, "--out", str(tmp_path / "r"), "--resolution", "1024"]) == RebucketJob(
        manifest=out, out=str(tmp_path / "r"))
    again = run(RebucketJob(manifest=out, out=str(tmp_path / "r"), spec=BucketSpec(area=1024 * 1024)))
    assert again.meta.summary == replace(result.meta.summary, rebucketed_from=result.fingerprint)
    assert again.buckets == 3 and again.fingerprint != result.fingerprint
    stats = run(StatsJob(manifest=str(tmp_path / "r")))
    assert stats.counts == again.meta.counts and sum(stats.buckets.values()) == 3 and stats.errors == {}


def test_job_from_args_parses_each_option_once():
    job = _job(["scan", "s3://b/ds", "--out", "m", "--storage-options", '{"endpoint_url": "http://x"}',
                "--buckets", "sdxl", "--min-side", "300", "--format", "parquet", "--caption-column", "text"])
    assert job.storage_options == {"endpoint_url": "http://x"} and job.spec == BucketSpec.from_preset("sdxl",
                                                                                                      min_side=300)
    assert (job.config.format, job.config.caption_column, job.config.progress) == ("parquet", "text", True)
    assert _job(["stats", "m", "--json"]) == StatsJob(manifest="m", json=True)
