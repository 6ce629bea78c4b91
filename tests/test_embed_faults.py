"""Embed against flaky and broken storage: retries per file, read failures retried on the next
run while decode errors are not, and a job whose storage is unusable stops before writing."""

from __future__ import annotations

import errno
import json
import threading
import uuid
from collections import Counter
from pathlib import Path

import pytest
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from manifests.cache import available_sample_ids, cache_freshness, read_cache_meta, read_index
from manifests.manifest import read_manifest
from manifests.schema import sample_id
from manifests.storage import StorageError
from pipeline.cli import main
from pipeline.embed.prepare import prepare_batch
from pipeline.embed.workers import check_source
from tests.embed_data import embed_cache, jpeg, make_dataset

SECRET = "testing-secret-key"  # must never show up in an error row or message
SLOWDOWN = "An error occurred (SlowDown) when calling the GetObject operation: Please reduce your request rate."


class FlakyFS(AbstractFileSystem):
    """A local folder whose reads fail like a store under load: ``faults`` maps a file name to
    ``(times, error)``; its first ``times`` reads raise ``error()``. ``calls`` counts reads per name."""

    protocol = "flaky-embed"
    cachable = False

    def __init__(self, faults: dict[str, tuple[int, type | object]]):
        super().__init__()
        self.inner = LocalFileSystem()
        self.remaining = {name: times for name, (times, _) in faults.items()}
        self.errors = {name: error for name, (_, error) in faults.items()}
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()

    def cat_file(self, path, start=None, end=None, **kwargs):
        name = path.rsplit("/", 1)[-1]
        with self.lock:
            self.calls[name] += 1
            fail = self.remaining.get(name, 0) > 0
            if fail:
                self.remaining[name] -= 1
        if fail:
            raise self.errors[name](path)
        return self.inner.cat_file(path, start=start, end=end)


def slowdown(path):
    return OSError(errno.EBUSY, SLOWDOWN)  # what s3fs raises for S3's SlowDown (s3fs/errors.py)


def reset(path):
    return ConnectionResetError(104, "Connection reset by peer")


def denied(path):
    return PermissionError(f"Access Denied for {path} (request signed with {SECRET})")


def _images(root: Path, n: int) -> list[dict]:
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        name = f"img_{i}.jpg"
        (root / name).write_bytes(jpeg(64, 64, seed=i))
        rows.append({"sample_id": sample_id(name), "filename": name, "caption_key": 0})
    return rows


def _prepare(root: Path, rows: list[dict], fs: FlakyFS) -> dict:
    options = {"key": "testing-key-id", "secret": SECRET}
    return prepare_batch(str(root), options, "64x64", rows, "center", 0, 10**8, fs=fs)


def test_transient_read_errors_are_retried_per_file(tmp_path):
    rows = _images(tmp_path / "data", 5)
    fs = FlakyFS({"img_1.jpg": (2, slowdown), "img_3.jpg": (3, reset), "img_4.jpg": (1, TimeoutError)})
    out = _prepare(tmp_path / "data", rows, fs)
    assert out["errors"] == []
    assert [r["filename"] for r in out["rows"]] == [r["filename"] for r in rows]
    assert out["pixels"].shape == (5, 64, 64, 3)
    assert fs.calls == {"img_0.jpg": 1, "img_1.jpg": 3, "img_2.jpg": 1, "img_3.jpg": 4, "img_4.jpg": 2}


def test_permanent_read_errors_are_error_rows_and_not_retried(tmp_path, monkeypatch):
    monkeypatch.setenv("BUCKETEER_STORAGE_THROTTLE_SECONDS", "0.5")  # how long a throttled read is retried
    monkeypatch.setenv("BUCKETEER_STORAGE_RETRY_DELAY", "0.01")
    rows = _images(tmp_path / "data", 4)
    (tmp_path / "data" / "img_2.jpg").unlink()  # NoSuchKey / FileNotFoundError
    fs = FlakyFS({"img_0.jpg": (10, denied), "img_3.jpg": (10**6, slowdown)})  # img_3: throttled for good
    out = _prepare(tmp_path / "data", rows, fs)
    assert [r["filename"] for r in out["rows"]] == ["img_1.jpg"]
    errors = {filename: (kind, message) for _, filename, kind, message in out["errors"]}
    assert sorted(errors) == ["img_0.jpg", "img_2.jpg", "img_3.jpg"]
    assert {kind for kind, _ in errors.values()} == {"read_failed"}
    denied_message = errors["img_0.jpg"][1]
    assert denied_message.startswith("PermissionError: Access Denied") and "retries" not in denied_message
    assert errors["img_2.jpg"][1].startswith("FileNotFoundError")
    assert "SlowDown" in errors["img_3.jpg"][1] and "still failing after retries" in errors["img_3.jpg"][1]
    assert all(SECRET not in m for _, m in errors.values())
    assert fs.calls["img_0.jpg"] == 1 and fs.calls["img_2.jpg"] == 1  # permanent: asked once
    assert fs.calls["img_3.jpg"] > 6  # throttled: past the 6 attempts, for the throttle time, then an error row


def test_check_source_refuses_storage_that_reads_nothing(tmp_path):
    rows = _images(tmp_path / "data", 3)
    names = [r["filename"] for r in rows]
    probed = [{"filename": n} for n in names]  # manifest rows of loose files
    options = {"secret": SECRET}
    everything_denied = FlakyFS({n: (10**6, denied) for n in names})
    with pytest.raises(StorageError) as e:
        check_source(str(tmp_path / "data"), options, probed, fs=everything_denied)
    message = str(e.value)
    assert "all 3 probed files failed" in message and "img_0.jpg" in message and "Access Denied" in message
    assert SECRET not in message
    assert sum(everything_denied.calls.values()) == 3  # permanent: no retries
    # one readable file is enough: the others are that file's problem (error rows), not the job's
    check_source(str(tmp_path / "data"), options, probed, fs=FlakyFS({n: (10**6, denied) for n in names[1:]}))
    check_source(str(tmp_path / "data"), options, [], fs=everything_denied)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("bucketeer_home")
@pytest.mark.full
def test_read_failures_are_retried_on_the_next_run_decode_errors_are_not(tmp_path, ray_local, capsys):
    root, manifest, out = tmp_path / "data", str(tmp_path / "manifest"), str(tmp_path / "cache")
    make_dataset(str(root), manifest, 6)
    lost, cut = root / "img_002.jpg", root / "img_003.jpg"
    lost_bytes = lost.read_bytes()
    lost.unlink()  # storage does not deliver it this time
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])  # the image itself is broken
    embed_cache(manifest, out)
    errors = {e["filename"]: e["error"] for e in read_index(out)["errors"].to_pylist()}
    assert errors == {"img_002.jpg": "read_failed", "img_003.jpg": "truncated"}

    m = read_manifest(manifest)
    status = cache_freshness(out, m)
    names = m.samples.column("filename").to_pylist()
    assert [names[i] for i in status.retry.nonzero()[0]] == ["img_002.jpg"]
    assert [names[i] for i in status.failed.nonzero()[0]] == ["img_003.jpg"]
    assert status.counts() == {"fresh": 4, "failed": 1, "retry": 1, "stale": 0, "missing": 0}

    # still gone: the row is retried and its error row renewed; the job does not stop over it
    capsys.readouterr()
    embed_cache(manifest, out)
    assert "1 read failures (retrying)" in capsys.readouterr().out
    summary = read_cache_meta(out).summary
    assert (summary.retried, summary.embedded, summary.errors, summary.skipped) == (1, 0, 1, 5)

    lost.write_bytes(lost_bytes)  # storage is back: only the read failure is embedded
    embed_cache(manifest, out)
    summary = read_cache_meta(out).summary
    assert (summary.retried, summary.embedded, summary.errors, summary.skipped) == (1, 1, 0, 5)
    errors = {e["filename"]: e["error"] for e in read_index(out)["errors"].to_pylist()}
    assert errors == {"img_003.jpg": "truncated"}
    assert sample_id("img_002.jpg") in available_sample_ids(out, manifest=m).tolist()
    assert cache_freshness(out, m).counts() == {"fresh": 5, "failed": 1, "retry": 0, "stale": 0, "missing": 0}


@pytest.mark.s3
@pytest.mark.ray
@pytest.mark.usefixtures("bucketeer_home")
def test_a_deleted_dataset_bucket_stops_the_job_before_anything_is_written(s3, ray_local, capsys):
    bucket = f"gone-{uuid.uuid4().hex[:8]}"
    s3.fs.mkdir(bucket)
    so = s3.storage_options
    manifest, out = s3.fresh_url("manifest"), s3.fresh_url("cache")
    make_dataset(f"s3://{bucket}/ds", manifest, 4, storage_options=so)
    s3.fs.rm(bucket, recursive=True)  # the scan's manifest exists; the images and their bucket do not
    s3.fs.invalidate_cache()
    options = json.dumps({**so, "key": "testing-key-id", "secret": SECRET})
    capsys.readouterr()
    assert main(["embed", manifest, "--out", out, "--storage-options", options]) == 2
    err = capsys.readouterr().err
    assert f"cannot read the images of s3://{bucket}/ds: all 4 probed files failed" in err
    assert "The specified bucket does not exist" in err and "Nothing was embedded" in err
    assert "Traceback" not in err and SECRET not in err
    assert not s3.fs.exists(out + "/_cache.json") and not s3.fs.exists(out)
