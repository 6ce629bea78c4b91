import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from manifests.buckets import BucketSpec
from manifests.manifest import MANIFEST_FILE, ManifestError, read_manifest, rebucket, write_manifest
from manifests.schema import SAMPLES_SCHEMA, sample_id
from manifests.storage import redact
from tests.factories import manifest_tables


def _roundtrip(url, storage_options=None):
    samples, errors = manifest_tables(500, spec=BucketSpec(min_side=100))
    meta = write_manifest(
        url, samples, errors, source="s3://data/set", spec=BucketSpec(min_side=100),
        counts={"listed": 500 + 3, "ignored": 2}, storage_options=storage_options, rows_per_part=128,
    )
    m = read_manifest(url, storage_options)
    assert m.samples.schema == SAMPLES_SCHEMA
    assert m.samples.num_rows == samples.num_rows and m.errors.num_rows == errors.num_rows
    assert sorted(m.samples.column("filename").to_pylist()) == sorted(samples.column("filename").to_pylist())
    assert m.samples.column("filename").to_pylist() == sorted(m.samples.column("filename").to_pylist())
    assert m.fingerprint == meta.fingerprint
    counts = {"listed": 503, "ignored": 2, "samples": samples.num_rows, "errors": errors.num_rows}
    assert m.meta.counts.to_json() == counts
    assert m.spec == BucketSpec(min_side=100)
    assert len(m.meta.parts.samples) == -(-samples.num_rows // 128)
    # every listed image is in exactly one of the two tables
    assert samples.num_rows + errors.num_rows == 503
    return m


def test_roundtrip_local(tmp_path):
    _roundtrip(str(tmp_path / "m"))


def test_roundtrip_memory():
    _roundtrip("memory://bucketeer/roundtrip")


@pytest.mark.s3
def test_roundtrip_s3(s3):
    url = s3.fresh_url("manifest")
    m = _roundtrip(url, s3.storage_options)
    assert s3.fs.exists(f"{url}/{MANIFEST_FILE}".removeprefix("s3://"))
    assert m.samples.num_rows > 0


def test_same_content_same_fingerprint_and_bytes(tmp_path):
    samples, errors = manifest_tables(300)
    a = write_manifest(str(tmp_path / "a"), samples, errors, source="/data", spec=BucketSpec())
    # shuffled input rows give the same manifest
    reversed_samples = samples.take(list(range(299, -1, -1)))
    b = write_manifest(str(tmp_path / "b"), reversed_samples, errors, source="/data", spec=BucketSpec())
    assert a.fingerprint == b.fingerprint
    assert a.parts == b.parts
    c = write_manifest(str(tmp_path / "c"), samples, errors, source="/data", spec=BucketSpec(area=512 * 512))
    assert c.fingerprint != a.fingerprint


def test_refuses_uncommitted_folder(tmp_path):
    url = str(tmp_path / "m")
    samples, errors = manifest_tables(50)
    write_manifest(url, samples, errors, source="/d", spec=BucketSpec())
    (tmp_path / "m" / MANIFEST_FILE).unlink()  # as if the job died before committing
    with pytest.raises(ManifestError, match="no _manifest.json"):
        read_manifest(url)


def test_refuses_wrong_version(tmp_path):
    url = str(tmp_path / "m")
    write_manifest(url, *manifest_tables(50), source="/d", spec=BucketSpec())
    meta_path = tmp_path / "m" / MANIFEST_FILE
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = 99
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ManifestError, match="format version 99"):
        read_manifest(url)


def test_refuses_missing_columns(tmp_path):
    url = str(tmp_path / "m")
    meta = write_manifest(url, *manifest_tables(50), source="/d", spec=BucketSpec())
    part = tmp_path / "m" / meta.parts.samples[0].path
    pq.write_table(pq.read_table(part).drop_columns(["bucket", "height"]), part)
    with pytest.raises(ManifestError, match=r"lacks columns \['height', 'bucket'\]"):
        read_manifest(url)


def test_refuses_missing_part(tmp_path):
    url = str(tmp_path / "m")
    meta = write_manifest(url, *manifest_tables(50), source="/d", spec=BucketSpec())
    (tmp_path / "m" / meta.parts.errors[0].path).unlink()
    with pytest.raises(ManifestError, match="is missing"):
        read_manifest(url)


def test_recommit_removes_stale_parts_and_keeps_old_until_commit(tmp_path):
    url = str(tmp_path / "m")
    first = write_manifest(url, *manifest_tables(50, seed=1), source="/d", spec=BucketSpec())
    second = write_manifest(url, *manifest_tables(60, seed=2), source="/d", spec=BucketSpec())
    files = {p.relative_to(tmp_path / "m").as_posix() for p in (tmp_path / "m").rglob("*.parquet")}
    assert files == {p.path for p in second.parts.samples + second.parts.errors}
    assert first.fingerprint != second.fingerprint
    again = read_manifest(url)
    assert again.fingerprint == second.fingerprint
    assert again.samples.num_rows + again.errors.num_rows == 60 + 3


def test_duplicate_ids_refused(tmp_path):
    samples, errors = manifest_tables(10)
    twice = pa.concat_tables([samples, samples])
    with pytest.raises(ManifestError, match="duplicate sample_id"):
        write_manifest(str(tmp_path / "m"), twice, errors, source="/d", spec=BucketSpec())


def test_no_credentials_in_manifest(tmp_path):
    url = str(tmp_path / "m")
    source = "s3://AKIAABCDEFGHIJKLMNOP:hunter2secret@bucket/ds"
    write_manifest(url, *manifest_tables(10), source=source, spec=BucketSpec())
    text = (tmp_path / "m" / MANIFEST_FILE).read_text()
    assert "hunter2secret" not in text and "AKIAABCDEFGHIJKLMNOP" not in text
    assert json.loads(text)["source"] == "s3://***@bucket/ds"


def test_redact_messages(monkeypatch):
    assert "abc123" not in redact("failed: aws_secret_access_key=abc123 for bucket")
    assert "abc123" not in redact("failed: secret=abc123 for bucket")
    assert redact("s3://k:s@b/x") == "s3://***@b/x"
    # literal secret values are removed wherever a library echoes them
    options = {"key": "plainkeyvalue", "secret": "plainsecretvalue", "client_kwargs": {"endpoint_url": "http://h"}}
    text = redact("denied for plainkeyvalue/plainsecretvalue at http://h", options)
    assert "plainkeyvalue" not in text and "plainsecretvalue" not in text and "http://h" in text
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envsecretvalue123")
    assert "envsecretvalue123" not in redact("signature mismatch envsecretvalue123")


def test_sample_id_is_stable():
    # pinned: changing the id function would orphan every cache built so far
    assert sample_id("a/b.jpg") == sample_id("a/b.jpg")
    assert sample_id("a/b.jpg") != sample_id("a/c.jpg")
    assert sample_id("dir/ünï cødé %&+.jpg") < 2**64
    assert sample_id("a/b.jpg") == 0x67ED673B4D9FCCAE


def test_rebucket_changes_buckets_without_losing_rows(tmp_path):
    url = str(tmp_path / "m")
    spec = BucketSpec(min_side=1000)
    write_manifest(url, *manifest_tables(400, spec=spec), source="/d", spec=spec)
    old = read_manifest(url)
    samples, errors = rebucket(old, BucketSpec(area=512 * 512, step=32))
    assert samples.num_rows + errors.num_rows == old.samples.num_rows + old.errors.num_rows
    assert errors.num_rows == 3  # the too_small rejects came back; the truncated files stay errors
    assert set(samples.column("filename").to_pylist()) | set(errors.column("filename").to_pylist()) == set(
        old.samples.column("filename").to_pylist()
    ) | set(old.errors.column("filename").to_pylist())
    for name in samples.column("bucket").to_pylist():
        w, h = map(int, name.split("x"))
        assert w % 32 == 0 and h % 32 == 0 and w * h <= 512 * 512
