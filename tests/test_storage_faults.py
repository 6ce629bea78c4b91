"""Storage as it misbehaves at scale, against the local S3 server (moto) behind a fault proxy
(:mod:`tests.fault_proxy`): a store that throttles (S3's ``503 SlowDown``, R2's ``429`` with
``Retry-After``) for a while, and one that answers a byte at a time. Both storage clients (s3fs, obstore).

Throttling: a read backs off (exponential, full jitter, at least ``Retry-After``) and succeeds once the
store lets it; every throttled answer is counted, in the job's summary and its progress line; a store
that throttles for good stops the call after ``BUCKETEER_STORAGE_THROTTLE_SECONDS`` with one line. A scan,
an embed and the trainer's loader through a throttling store finish with every sample once, send fewer
requests while throttled and as many as before once it stops. Slow drips: an answer below the rate floor
fails as a read timeout, retried, then one line; one just above it is read whole.
"""

from __future__ import annotations

import io
import json
import time

import numpy as np
import pytest

from manifests.errors import StorageError
from manifests.progress import Progress
from manifests.retry import throttled_requests, with_retries
from manifests.throttles import counting_throttles
from manifests.storage import open_url, read_bytes, read_many
from tests.fault_proxy import FaultProxy, reads

pytestmark = pytest.mark.s3

BLOB = bytes(range(256)) * 20  # 5,120 bytes


@pytest.fixture
def proxy(s3):
    """A FaultProxy in front of the session's moto server, healthy until a test says otherwise."""
    p = FaultProxy(s3.endpoint)
    yield p
    p.close()


@pytest.fixture
def blob(s3) -> str:
    """The path (bucket/key) of a 5 KB object."""
    url = s3.fresh_url("faults")
    s3.fs.pipe_file(f"{url}/blob", BLOB)
    return f"{url}/blob".removeprefix("s3://")


def _fs(proxy: FaultProxy, client: str, blob: str):
    """The filesystem of ``client`` through ``proxy``, warmed up by a first read (s3fs builds its client then,
    which can take a second), and the proxy's log cleared."""
    fs, _ = open_url("s3://x", {"endpoint_url": proxy.endpoint, "bucketeer_client": client})
    assert fs.cat_file(blob, start=0, end=1) == BLOB[:1]
    with proxy.lock:
        proxy.log.clear()
    return fs


def _gaps(proxy: FaultProxy, path: str) -> list[float]:
    """Seconds between one object's successive requests, as the proxy saw them."""
    times = [s.at for s in proxy.seen() if path in s.path]
    return [b - a for a, b in zip(times, times[1:])]


# --- throttling, one call at a time ------------------------------------------------------------------


@pytest.mark.parametrize("status", [503, 429])
def test_a_throttled_read_backs_off_succeeds_and_is_counted(proxy, blob, s3_client, status):
    fs = _fs(proxy, s3_client, blob)
    before = throttled_requests()
    proxy.throttle(share=1.0, requests=4, status=status)  # the next 4 requests are throttled, then none
    assert read_bytes(fs, blob, 0, 100) == BLOB[:100]
    assert read_many(fs, [blob] * 3, [0, 10, 20], [5, 15, 25]) == [BLOB[0:5], BLOB[10:15], BLOB[20:25]]
    throttled = [s for s in proxy.seen() if s.throttled]
    assert len(throttled) == 4 and {s.status for s in throttled} == {status}
    assert throttled_requests() - before == 4  # every throttled answer counted, once
    assert all(gap > 0 for gap in _gaps(proxy, blob))


def test_retry_after_is_honoured_where_the_client_hands_it_on(proxy, blob, s3_client):
    fs = _fs(proxy, s3_client, blob)
    start = proxy.throttle(share=1.0, seconds=1.2, status=429, retry_after=1)
    assert read_bytes(fs, blob, 0, 100) == BLOB[:100]
    took, gaps = time.monotonic() - start, _gaps(proxy, blob)
    print(f"{s3_client}: throttled 1.2 s with Retry-After: 1 -> read after {took:.2f} s, {len(gaps)} retries, "
          f"gaps {[round(g, 2) for g in gaps]}")  # fmt: skip
    if s3_client == "fsspec":  # s3fs hands botocore's answer on, header and all: every wait is at least 1 s
        assert len(gaps) == 2 and all(gap >= 1.0 for gap in gaps)
    else:  # obstore's errors carry no headers: exponential backoff alone (manifests/retry.py says so)
        assert len(gaps) >= 2 and took >= 1.2


def test_a_store_that_throttles_for_good_stops_the_call_with_one_line(proxy, blob, s3_client, monkeypatch):
    monkeypatch.setenv("BUCKETEER_STORAGE_THROTTLE_SECONDS", "2")
    monkeypatch.setenv("BUCKETEER_STORAGE_ATTEMPTS", "2")  # throttled answers do not use these up
    fs = _fs(proxy, s3_client, blob)
    start = proxy.throttle(share=1.0, seconds=60)
    with pytest.raises(StorageError) as e:
        read_bytes(fs, blob, 0, 100)
    took, message = time.monotonic() - start, str(e.value)
    print(f"{s3_client}: throttled for good -> StorageError after {took:.2f} s, {len(proxy.seen())} requests")
    assert "\n" not in message and message.startswith(f"reading s3://{blob}")
    assert f"storage at {proxy.endpoint} kept throttling" in message
    assert "$BUCKETEER_STORAGE_THROTTLE_SECONDS" in message
    assert len(proxy.seen()) > 2 and 2.0 <= took <= 2.0 + 1.0  # past the attempts, for the throttle time


def test_the_progress_line_counts_the_jobs_throttled_answers(monkeypatch):
    out = io.StringIO()
    calls = []

    def throttled_twice():
        calls.append(1)
        if len(calls) <= 2:
            raise OSError(16, "SlowDown")  # errno EBUSY: what s3fs raises for 503 SlowDown
        return "ok"

    monkeypatch.setenv("BUCKETEER_STORAGE_RETRY_DELAY", "0.001")
    with counting_throttles() as tally:
        with Progress("scan", "files", total=4, unit="files", stream=out, interval=0) as progress:
            progress.update(1)
            assert with_retries(throttled_twice) == "ok"
            tally.add(json.dumps(["other-host:4242", 10, 13]))  # a worker's 3, from its task's result
            progress.update(3)
    lines = out.getvalue().splitlines()
    assert "storage throttling (EBUSY, 1 throttled answer" in out.getvalue()
    assert lines[-1].startswith("scan files: 4/4 files (100%)") and lines[-1].endswith("throttled 5")
    assert tally.total == 5


# --- slow drips -----------------------------------------------------------------------------------

DRIP = {"BUCKETEER_STORAGE_ATTEMPTS": "2", "BUCKETEER_STORAGE_RETRY_DELAY": "0.01",
        "BUCKETEER_STORAGE_CONNECT_TIMEOUT": "0.5", "BUCKETEER_STORAGE_READ_TIMEOUT": "1",
        "BUCKETEER_STORAGE_MIN_RATE": "200", "BUCKETEER_STORAGE_RATE_WINDOW": "1"}  # fmt: skip
INTERVAL = 0.3  # a byte every 0.3 s: never 1 s without one, so the read timeout alone would never trip


@pytest.mark.parametrize("what", ["body", "whole answer"])
def test_a_dripping_endpoint_fails_like_a_timeout_within_the_floors_bound(proxy, blob, s3_client, monkeypatch, what):
    for name, value in DRIP.items():
        monkeypatch.setenv(name, value)
    fs = _fs(proxy, s3_client, blob)
    start = proxy.trickle(INTERVAL, headers=what == "whole answer")
    with pytest.raises(StorageError) as e:
        read_bytes(fs, blob, 0, 3000)  # 3,000 bytes at 3 a second: 17 minutes
    took, message = time.monotonic() - start, str(e.value)
    bound = 2 * (0.5 + 1 + 1 + INTERVAL) + 0.01  # attempts x (connect + read or window, + a byte's wait) + backoff
    print(f"{s3_client}, dripping {what}: StorageError after {took:.2f} s (bound {bound:.2f} s): {message[:160]}")
    assert "\n" not in message and message.startswith(f"reading s3://{blob}")
    assert f"storage at {proxy.endpoint} did not answer in time after 2 attempts" in message
    assert "_MIN_RATE" in message and took <= bound + 1.5  # scheduling on a loaded machine
    if what == "body":  # the floor's own words: what came in the last window
        assert "below the floor of 200 bytes/s" in message


def test_a_slow_answer_above_the_floor_is_read_whole(proxy, blob, s3_client, monkeypatch):
    for name, value in DRIP.items():
        monkeypatch.setenv(name, value)
    fs = _fs(proxy, s3_client, blob)
    proxy.trickle(0.002)  # ~500 bytes/s, over the floor of 200: 2,000 bytes take 4 windows
    start = time.monotonic()
    assert read_bytes(fs, blob, 0, 2000) == BLOB[:2000]
    assert time.monotonic() - start > 2.0 and len(proxy.seen()) == 1  # slow, not retried


# --- whole jobs through a throttling store --------------------------------------------------------


def _rate(proxy: FaultProxy, start: float, end: float) -> float:
    """Requests per second the proxy answered in ``[start, end)``."""
    return len(proxy.seen(start, end)) / max(end - start, 1e-9)


def _throttled_since(proxy: FaultProxy, start: float) -> int:
    return sum(s.throttled for s in proxy.seen(start))


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.full
def test_a_throttled_store_slows_scan_embed_and_loader_and_each_sample_arrives_once(
    s3, proxy, ray_local, bucketeer_home, tmp_path, s3_client, monkeypatch, capsys
):  # fmt: skip
    from manifests.cache import CacheReader, read_index
    from manifests.cache.verify import verify_cache
    from manifests.manifest import read_manifest
    from pipeline.cli import main
    from pipeline.scan import ScanConfig, ScanJob, run
    from tests.embed_data import SPEC, embed_cache, jpeg
    from train.data import BatchLoader, rank_steps

    monkeypatch.setenv("BUCKETEER_LOCK_HEARTBEAT_SECONDS", "600")  # no lock reads mid-job
    n, url = 48, s3.fresh_url("throttled")
    for i in range(n):
        s3.fs.pipe_file(f"{url}/data/img_{i:03d}.jpg", jpeg(64 + 16 * (i % 3), 64, seed=i))
        if i % 4:
            s3.fs.pipe_file(f"{url}/data/img_{i:03d}.txt", f"a photo of thing {i % 3}".encode())
    so = {"endpoint_url": proxy.endpoint, "bucketeer_client": s3_client}  # Ray workers take the client from here

    # the scan: every 3rd of its first 60 reads throttled (503 SlowDown); not every 2nd: s3fs looks for a missing
    # object with a HEAD then a LIST, and with every LIST throttled that read would be retried for 300 s
    start = proxy.throttle(share=1 / 3, requests=60, match=reads)
    meta = run(ScanJob(source=f"{url}/data", out=f"{url}/manifest", storage_options=so, spec=SPEC,
                       config=ScanConfig(progress=False))).meta  # fmt: skip
    scanned = _throttled_since(proxy, start)
    manifest = read_manifest(f"{url}/manifest", s3.storage_options)
    names = sorted(manifest.samples.column("filename").to_pylist())
    assert names == [f"img_{i:03d}.jpg" for i in range(n)] and manifest.errors.num_rows == 0  # each once
    assert meta.summary.throttled == scanned == 20  # counted in every process: the Ray tasks' and the driver's
    assert f"storage throttled {scanned} requests (retried)" in capsys.readouterr().out

    # the embed: every 3rd of its first 39 reads (manifest row groups, images) throttled (429)
    start = proxy.throttle(share=1 / 3, requests=39, status=429, match=reads)
    result = embed_cache(f"{url}/manifest", f"{url}/cache", storage_options=so)
    embedded = _throttled_since(proxy, start)
    assert result.meta.summary.throttled == embedded == 13
    cache = read_index(f"{url}/cache", s3.storage_options)["samples"].column("sample_id").to_pylist()
    assert sorted(cache) == sorted(manifest.samples.column("sample_id").to_pylist())  # each once
    assert verify_cache(f"{url}/cache", s3.storage_options).ok

    # the trainer's loader: 3 of every 4 reads throttled for 1.5 s, between a clean start and a clean end
    plan = str(tmp_path / "plan")
    assert main(["plan", f"{url}/manifest", "--out", plan, "--world-size", "1", "--batch-size", "2", "--epochs",
                 "40", "--cache", f"{url}/cache", "--storage-options", json.dumps(so)]) == 0  # fmt: skip
    proxy.latency = 0.02  # a store's round trip: the loader waits on storage, not on this loaded machine's CPUs
    reader = CacheReader(f"{url}/cache", {**so, "max_concurrency": 1})
    loader = BatchLoader(reader, rank_steps(plan, 0), reader.meta.latent, prefetch=4, read_threads=2,
                         log=lambda line: None)  # fmt: skip
    seen: list[int] = []
    before = throttled_requests()
    begin = on = off = time.monotonic()
    for i, batch in enumerate(loader):
        if i == 100:
            on = proxy.throttle(share=0.75, seconds=1.5, match=reads)
            off = on + 1.5
        seen.extend(batch.sample_ids)
    end = time.monotonic()
    planned = [s for step in rank_steps(plan, 0) for s in step.sample_ids]
    assert seen == planned and sorted(set(seen)) == sorted(manifest.samples.column("sample_id").to_pylist())
    loaded = _throttled_since(proxy, on)
    assert throttled_requests() - before == loaded > 0
    # a throttled answer is quick, and the first waits are short: by the second half of the throttled time
    # the backoff has grown; after it, the calls still waiting finish their waits, then it is back
    clean, late = _rate(proxy, begin, on), _rate(proxy, on + 0.75, off)
    recovered = next((t for t in np.arange(off, end - 0.5, 0.05) if _rate(proxy, t, t + 0.5) >= 0.7 * clean), None)
    print(f"{s3_client}: scan throttled {scanned}, embed {embedded}, loader {loaded}; loader requests/s: "
          f"{clean:.0f} clean, {late:.0f} in the second half of the throttled 1.5 s, back to 70% of clean "
          f"{recovered - off if recovered is not None else float('nan'):.2f} s after it, {end - off:.1f} s before "
          "the end")  # fmt: skip
    assert late < 0.5 * clean, "the loader did not slow down while throttled"
    assert recovered is not None and recovered - off < 3.0, "the loader did not recover after the throttling"
    assert not any(s.throttled for s in proxy.seen(off + 0.001))
