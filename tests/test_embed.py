"""The embed job end to end on real Ray: local folder and S3, resume after SIGKILL, reruns, refusals."""

from __future__ import annotations

import argparse
import io
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from manifests.buckets import BucketSpec
from manifests.cache import CacheError, CacheReader, available_sample_ids, read_cache_meta, read_index
from manifests.cache_format import caption_key, to_float32
from manifests.cache_verify import verify_cache
from manifests.manifest import apply_buckets, write_manifest
from manifests.schema import ERRORS_SCHEMA, sample_id, sample_ids
from manifests.storage import join, open_url

pytestmark = [pytest.mark.ray]

SPEC = BucketSpec(area=64 * 64, step=32)
SIZES = [(96, 64), (64, 96), (80, 80), (150, 70), (70, 150)]  # (w, h): 64x64, 128x32 and 32x128 buckets


@pytest.fixture(scope="session", autouse=True)
def bucketeer_home(tmp_path_factory):
    """Default encoders built once per session into a temp home (Ray workers get it via the driver)."""
    home = str(tmp_path_factory.mktemp("bucketeer-home"))
    old = os.environ.get("BUCKETEER_HOME")
    os.environ["BUCKETEER_HOME"] = home
    yield home
    if old is None:
        os.environ.pop("BUCKETEER_HOME", None)
    else:
        os.environ["BUCKETEER_HOME"] = old


def _jpeg(w: int, h: int, seed: int, orientation: int = 1) -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    img.save(buf, "JPEG", quality=85, exif=exif.tobytes())
    return buf.getvalue()


def make_dataset(root: str, manifest: str, n: int = 12, *, storage_options=None, broken=(), start: int = 0) -> list[str]:
    """``n`` tiny images under ``root`` (+ ``broken`` names with undecodable bytes) and their manifest.

    Image 1 is stored sideways with EXIF orientation 6 (display 64x96); captions repeat; every
    5th image has none. Returns the filenames in the manifest.
    """
    fs, base = open_url(root, storage_options)
    fs.makedirs(base, exist_ok=True)
    rows = []
    for i in range(start, start + n):
        w, h = SIZES[i % len(SIZES)]
        name = f"img_{i:03d}.jpg"
        if i == 1:  # stored 96x64 landscape, displayed as 64x96 portrait
            data, (w, h) = _jpeg(96, 64, i, orientation=6), (64, 96)
        else:
            data = _jpeg(w, h, i)
        rows.append((name, w, h, None if i % 5 == 0 else f"a photo of thing {i % 3}", data))
    for name in broken:
        rows.append((name, 80, 80, "broken", b"<html>not an image</html>"))
    for name, *_, data in rows:
        fs.pipe_file(join(base, name), data)
    names = [r[0] for r in rows]
    table = pa.table({
        "sample_id": pa.array(sample_ids(names), pa.uint64()), "filename": names,
        "width": pa.array([r[1] for r in rows], pa.int32()), "height": pa.array([r[2] for r in rows], pa.int32()),
        "caption": pa.array([r[3] for r in rows], pa.string()), "size": pa.array([len(r[4]) for r in rows], pa.int64()),
    })  # fmt: skip
    samples, rejects = apply_buckets(table, SPEC)
    assert rejects.num_rows == 0
    write_manifest(manifest, samples, ERRORS_SCHEMA.empty_table(), source=root, spec=SPEC,
                   storage_options=storage_options)  # fmt: skip
    return names


def embed_args(manifest: str, out: str, *extra: str) -> argparse.Namespace:
    from pipeline import embed

    parser = argparse.ArgumentParser()
    embed.add_arguments(parser)
    return parser.parse_args([manifest, "--out", out, "--batch-size", "4", "--shard-records", "4", *extra])


def run_embed(manifest: str, out: str, *extra: str) -> int:
    from pipeline import embed

    return embed.run(embed_args(manifest, out, *extra))


def records_by_id(url: str, storage_options=None) -> dict[int, object]:
    reader = CacheReader(url, storage_options)
    return {r.sample_id: r for r in reader.read(reader.sample_ids.tolist())}


def test_embed_local_round_trip_errors_and_rerun(tmp_path, ray_local):
    root, manifest, out = str(tmp_path / "data"), str(tmp_path / "manifest"), str(tmp_path / "cache")
    names = make_dataset(root, manifest, 12, broken=["zz_broken.jpg"])
    assert run_embed(manifest, out) == 0  # the undecodable image does not fail the job

    meta = read_cache_meta(out)
    assert meta["complete"] and meta["latent"]["kind"] == "posterior_mean" and meta["latent"]["factor"] == 8
    assert meta["latent"]["scaling_factor"] == pytest.approx(0.18215)
    errors = read_index(out)["errors"].to_pylist()
    assert [(e["filename"], e["error"]) for e in errors] == [("zz_broken.jpg", "not_an_image")]
    good = sorted(sample_id(n) for n in names if n != "zz_broken.jpg")
    assert available_sample_ids(out).tolist() == good
    assert meta["counts"]["texts"] == 5  # 3 captions + "broken" + the null caption (empty string), each once

    records = records_by_id(out)
    for sid, r in records.items():
        bw, bh = map(int, r.bucket.split("x"))
        assert r.latent.shape == (4, bh // 8, bw // 8) and r.dtype == "BF16"
        assert r.target_size == (bh, bw)
        top, left, bottom, right = r.crop_box
        assert 0 <= top and bottom <= r.resized_size[0] and 0 <= left and right <= r.resized_size[1]
        assert np.isfinite(to_float32(r.latent, r.dtype)).all()
        assert r.text is not None and r.text.tokens[0].shape[1] == 32 and r.text.pooled.shape == (32,)
    rotated = records[sample_id("img_001.jpg")]
    assert rotated.original_size == (96, 64) and rotated.bucket == "64x64"  # EXIF orientation 6 applied
    assert rotated.resized_size == (96, 64) and rotated.crop_top_left == (16, 0)  # center crop of the long side
    uncaptioned = records[sample_id("img_000.jpg")]
    assert uncaptioned.caption_key == caption_key(None) == caption_key("")
    assert uncaptioned.text.lengths == (2,)  # BOS + EOS, unpadded
    assert verify_cache(out).ok

    # new manifest rows: only they are embedded; committed shards stay as they were
    shards_before = {s["path"] for s in meta["shards"]}
    make_dataset(root, manifest, 15, broken=["zz_broken.jpg"])
    assert run_embed(manifest, out) == 0
    meta2 = read_cache_meta(out)
    assert meta2["summary"]["embedded"] == 3 and meta2["summary"]["errors"] == 0  # the error row is not retried
    assert shards_before <= {s["path"] for s in meta2["shards"]}
    ids = read_index(out)["samples"].column("sample_id").to_numpy()
    assert len(ids) == len(np.unique(ids)) == 15


def test_changed_settings_are_refused(tmp_path, ray_local, capsys):
    root, manifest, out = str(tmp_path / "data"), str(tmp_path / "manifest"), str(tmp_path / "cache")
    make_dataset(root, manifest, 4)
    assert run_embed(manifest, out) == 0
    with pytest.raises(CacheError, match=r"(?s)crop: 'center' -> 'random'.*new --out"):
        run_embed(manifest, out, "--crop", "random", "--seed", "3")
    with pytest.raises(CacheError, match=r"dtype: 'BF16' -> 'F32'"):
        run_embed(manifest, out, "--dtype", "fp32")
    # the same settings are accepted; with nothing missing no encoder is even loaded
    assert run_embed(manifest, out) == 0
    assert "nothing to embed" in capsys.readouterr().out


@pytest.mark.slow
def test_kill_and_resume_equals_clean_run(tmp_path, ray_local):
    root, manifest = str(tmp_path / "data"), str(tmp_path / "manifest")
    clean, resumed = str(tmp_path / "clean"), str(tmp_path / "resumed")
    make_dataset(root, manifest, 14)
    address = ray_local.get_runtime_context().gcs_address
    env = {**os.environ, "BUCKETEER_TEST_PAUSE_AFTER_COMMIT": "120"}
    cmd = [sys.executable, "-m", "pipeline.embed", manifest, "--out", resumed, "--batch-size", "4",
           "--shard-records", "4", "--ray-address", address]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 120
        for line in proc.stdout:
            if "paused after shard commit" in line or time.time() > deadline:
                break
        assert proc.poll() is None, "embed exited before its first commit"
        partial = read_cache_meta(resumed)
        assert not partial["complete"] and partial["counts"]["samples"] == 4
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert run_embed(manifest, resumed) == 0
    assert run_embed(manifest, clean) == 0

    a, b = records_by_id(clean), records_by_id(resumed)
    assert sorted(a) == sorted(b) and len(a) == 14
    ids = read_index(resumed)["samples"].column("sample_id").to_numpy()
    assert len(ids) == len(np.unique(ids)) == 14  # nothing duplicated
    for sid in a:
        x, y = a[sid], b[sid]
        assert (x.bucket, x.original_size, x.crop_box, x.caption_key) == (y.bucket, y.original_size, y.crop_box, y.caption_key)
        np.testing.assert_allclose(to_float32(x.latent, x.dtype), to_float32(y.latent, y.dtype), atol=2e-2)
        np.testing.assert_array_equal(x.text.tokens[0], y.text.tokens[0])
    assert read_cache_meta(resumed)["fingerprint"] == read_cache_meta(clean)["fingerprint"]
    assert verify_cache(resumed).ok


@pytest.mark.s3
def test_embed_on_s3(s3, ray_local):
    root, manifest, out = s3.fresh_url("data"), s3.fresh_url("manifest"), s3.fresh_url("cache")
    so = s3.storage_options
    names = make_dataset(root, manifest, 6, storage_options=so, broken=["zz_broken.jpg"])
    import json

    assert run_embed(manifest, out, "--storage-options", json.dumps(so)) == 0
    s3.fs.invalidate_cache()
    assert available_sample_ids(out, so).tolist() == sorted(sample_id(n) for n in names[:-1])
    records = records_by_id(out, so)
    assert all(r.text is not None for r in records.values())
    assert "testing-secret-key" not in json.dumps(read_cache_meta(out, so))
    assert verify_cache(out, so).ok
