"""The scan against a real S3-compatible server (moto, 127.0.0.1): listing, reads, faults, secrets."""

import errno
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import s3fs
from fsspec import AbstractFileSystem

from manifests.manifest import read_manifest
from manifests.storage import StorageError, open_url
from pipeline.sources.listing import list_source
from pipeline import ScanJob, run
from pipeline.scan import ScanConfig
from tests.corpus import make_corpus

pytestmark = [pytest.mark.s3, pytest.mark.ray]
SECRET = "testing-secret-key"  # the fixture's fake secret: must never show up anywhere


class FlakyS3(AbstractFileSystem):
    """s3fs behind a wrapper whose first ``failures`` reads (per process) fail like S3 under load."""

    protocol = "flaky"
    cachable = False

    def __init__(self, endpoint: str, failures: int, error: str = "slowdown", **kwargs):
        super().__init__(endpoint=endpoint, failures=failures, error=error)
        self.inner = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, use_listings_cache=False)
        self.remaining = failures
        self.error = error
        self.lock = threading.Lock()
        self.reads: list[str] = []  # paths read through this instance (in this process)

    def find(self, path, **kwargs):
        return self.inner.find(path, **kwargs)

    def cat_file(self, path, start=None, end=None, **kwargs):
        with self.lock:
            self.reads.append(path)
            fail, self.remaining = self.remaining > 0, self.remaining - 1
        if fail and self.error == "slowdown":
            # what s3fs raises for S3's SlowDown (s3fs/errors.py): throttling, retried for a time
            raise OSError(errno.EBUSY, "An error occurred (SlowDown) when calling the GetObject operation: "
                          "Please reduce your request rate.")
        if fail and self.error == "internal":  # S3's 500 InternalError: a failure, retried a number of times
            raise OSError(errno.EIO, "An error occurred (InternalError) when calling the GetObject operation: "
                          "We encountered an internal error. Please try again.")
        if fail:
            raise PermissionError(f"Access Denied for {path} (secret={SECRET})")
        return self.inner.cat_file(path, start=start, end=end)


@pytest.fixture(scope="module")
def dataset(s3_server, tmp_path_factory):
    corpus = make_corpus(tmp_path_factory.mktemp("corpus"))
    url = s3_server.fresh_url("ds")
    s3_server.fs.put(str(corpus.root) + "/", url + "/", recursive=True)
    return corpus, url


def test_scan_s3_into_s3_matches_ground_truth(s3, dataset, ray_local, capsys, s3_client):
    corpus, url = dataset
    out = s3.fresh_url("manifest")
    options = {**s3.storage_options, "key": "testing-key-id", "secret": SECRET, "bucketeer_client": s3_client}
    run(ScanJob(source=url, out=out, storage_options=options, config=ScanConfig(progress=False, files_per_task=8)))
    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err
    m = read_manifest(out, s3.storage_options)
    assert {r["filename"]: (r["width"], r["height"]) for r in m.samples.to_pylist()} == corpus.sizes
    assert {r["filename"]: r["error"] for r in m.errors.to_pylist()} == corpus.errors
    assert {r["filename"]: r["caption"] for r in m.samples.to_pylist()} == corpus.captions
    assert all(r["etag"] for r in m.samples.to_pylist())
    assert m.meta.counts.ignored == len(corpus.ignored)
    assert SECRET not in s3.fs.cat_file(out + "/_manifest.json").decode()

    quiet = ScanConfig(progress=False)
    again = run(ScanJob(source=url, out=out, storage_options=s3.storage_options, config=quiet)).meta
    assert again.summary.files_read == 0 and again.fingerprint == m.fingerprint


def test_rescan_rereads_exactly_the_changed_sidecars_by_etag(s3, ray_local, tmp_path, s3_client):
    corpus = make_corpus(tmp_path / "c")
    url = s3.fresh_url("caps")
    s3.fs.put(str(corpus.root) + "/", url + "/", recursive=True)
    out = s3.fresh_url("manifest")
    cfg = ScanConfig(progress=False, files_per_task=8)
    so = {**s3.storage_options, "bucketeer_client": s3_client}  # the first scan's client; the rescan reads by s3fs
    run(ScanJob(source=url, out=out, storage_options=so, config=cfg))
    size = s3.fs.size(f"{url}/cap/crlf.txt")
    s3.fs.pipe_file(f"{url}/cap/crlf.txt", b"y" * size)  # same size, new content: a new ETag
    s3.fs.rm_file(f"{url}/cap/bom.txt")
    s3.fs.pipe_file(f"{url}/cap/missing.caption", b"now captioned")
    # no image changed, so nothing goes to Ray and every read passes through this instance
    counting = FlakyS3(s3.endpoint, failures=0)
    meta = run(ScanJob(source=url.removeprefix("s3://"), out=out, storage_options=s3.storage_options,
                        fs=counting, config=cfg)).meta  # fmt: skip
    prefix = url.removeprefix("s3://") + "/"
    assert sorted(p.removeprefix(prefix) for p in counting.reads) == ["cap/crlf.txt", "cap/missing.caption"]
    assert meta.summary.captions_read == 2 and meta.summary.files_read == 0
    rows = {r["filename"]: r for r in read_manifest(out, s3.storage_options).samples.to_pylist()}
    etag = s3.fs.info(f"{url}/cap/crlf.txt")["ETag"].strip('"')
    assert rows["cap/crlf.jpg"]["caption"] == "y" * size
    assert rows["cap/crlf.jpg"]["caption_source"] == f"sidecar:{size}:{etag}:cap/crlf.txt"
    assert rows["cap/bom.jpg"]["caption"] is None and rows["cap/missing.jpg"]["caption"] == "now captioned"
    clean_url = s3.fresh_url("clean")
    run(ScanJob(source=url, out=clean_url, storage_options=s3.storage_options, config=cfg))
    a, b = read_manifest(out, s3.storage_options), read_manifest(clean_url, s3.storage_options)
    assert a.samples.equals(b.samples) and a.errors.equals(b.errors)


def test_key_range_listing_is_parallel_and_exact(s3, s3_client):
    url = s3.fresh_url("many")
    names = [f"{d}/img_{i:04d}.jpg" for d in ("a", "b/c", "zz") for i in range(60)] + ["top.png", "x.txt", ".DS_Store"]
    s3.fs.pipe({f"{url}/{n}": b"x" for n in names})
    fs, _ = open_url(url, s3.storage_options)
    assert type(fs).__name__ == {"obstore": "ObstoreS3FileSystem", "fsspec": "SingleAttemptS3FileSystem"}[s3_client]
    listing = list_source(fs, url.removeprefix("s3://"), page_size=10, workers=8)
    assert [e.name for e in listing.images] == sorted(n for n in names if n.endswith((".jpg", ".png")))
    assert listing.ignored == 1 and list(listing.sidecars) == ["x"]
    # 183 keys at 10 per page need >= 19 requests; the cuts add some that find little or nothing
    assert listing.requests >= 19


def test_transient_errors_are_retried(s3, dataset, ray_local, tmp_path):
    corpus, url = dataset
    flaky = FlakyS3(s3.endpoint, failures=5)  # fewer than the 6 attempts: no file can run out
    meta = run(ScanJob(source=url.removeprefix("s3://"), out=str(tmp_path / "m"), fs=flaky,
                        config=ScanConfig(progress=False, files_per_task=8))).meta  # fmt: skip
    errors = read_manifest(str(tmp_path / "m")).errors.to_pylist()
    failures = [r["message"] for r in errors if r["error"] == "read_failed"]
    assert "read_failed" not in meta.summary.errors_by_kind, failures
    m = read_manifest(str(tmp_path / "m"))
    assert {r["filename"]: (r["width"], r["height"]) for r in m.samples.to_pylist()} == corpus.sizes


def test_retries_that_run_out_become_read_failed_rows_and_are_reread(s3, ray_local, tmp_path):
    url = s3.fresh_url("few")
    png = make_corpus(tmp_path / "c").root.joinpath("png/palette.png").read_bytes()
    s3.fs.pipe({f"{url}/{i}.png": png for i in range(3)})
    out = str(tmp_path / "m")
    cfg = ScanConfig(progress=False)
    path = url.removeprefix("s3://")
    # failing for good, not throttled (a throttled read is retried for BUCKETEER_STORAGE_THROTTLE_SECONDS, 300 s:
    # tests/test_storage_faults.py), so the attempts run out
    flaky = FlakyS3(s3.endpoint, failures=10**6, error="internal")
    meta = run(ScanJob(source=path, out=out, fs=flaky, config=cfg)).meta
    assert meta.summary.errors_by_kind == {"read_failed": 3}
    assert "InternalError" in read_manifest(out).errors.column("message")[0].as_py()
    healed = run(ScanJob(source=path, out=out, fs=FlakyS3(s3.endpoint, failures=0), config=cfg)).meta
    assert healed.summary.files_read == 3 and healed.counts.samples == 3


def test_access_denied_stops_the_job_and_commits_nothing(s3, dataset, ray_local, tmp_path):
    _, url = dataset
    out = tmp_path / "m"
    with pytest.raises(StorageError) as e:
        run(ScanJob(source=url.removeprefix("s3://"), out=str(out), fs=FlakyS3(s3.endpoint, 10**6, "denied"),
                     config=ScanConfig(progress=False)))  # fmt: skip
    assert "Access Denied" in str(e.value) and SECRET not in str(e.value)
    assert not (out / "_manifest.json").exists()


def test_missing_bucket_is_one_clear_line(s3, tmp_path, s3_client):
    out = tmp_path / "m"
    options = json.dumps({**s3.storage_options, "key": "testing-key-id", "secret": SECRET,
                          "bucketeer_client": s3_client})  # fmt: skip
    cmd = [sys.executable, "-m", "pipeline.scan", "s3://no-such-bucket-here/ds", "--out", str(out),
           "--storage-options", options]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert done.returncode == 2
    assert "cannot list s3://no-such-bucket-here/ds" in done.stderr and "bucket does not exist" in done.stderr
    assert SECRET not in done.stdout + done.stderr and "Traceback" not in done.stderr
    assert not out.exists()
