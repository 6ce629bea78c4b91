"""The embed job end to end on real Ray: local folder and S3, resume after SIGKILL, reruns, refusals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pytest

from manifests.cache import CacheError, available_sample_ids, read_cache_meta, read_index
from manifests.cache.records import caption_key, to_float32
from manifests.cache.verify import verify_cache
from manifests.faults import FAULTS_ENV, pause_marker
from manifests.manifest import apply_buckets, read_manifest, write_manifest
from manifests.plan import read_plan_meta, read_plan_rows
from manifests.schema import ERRORS_SCHEMA, SAMPLES_SCHEMA, sample_id
from manifests.storage import join, open_url
from pipeline.cli import main
from manifests.progress import INTERVAL_ENV
from tests.embed_data import SPEC, embed_cache, jpeg, make_dataset, record_bytes, records_by_id
from tests.test_progress import assert_progress

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("bucketeer_home")]


@pytest.mark.slow
def test_embed_local_round_trip_errors_and_rerun(tmp_path, ray_local, monkeypatch, capsys):
    root, manifest, out = str(tmp_path / "data"), str(tmp_path / "manifest"), str(tmp_path / "cache")
    names = make_dataset(root, manifest, 12, broken=["zz_broken.jpg"])
    monkeypatch.setenv(INTERVAL_ENV, "0")  # a progress line per result (stderr is not a terminal here)
    result = embed_cache(manifest, out)  # the undecodable image does not fail the job
    err = capsys.readouterr().err
    assert_progress(err, "embed captions", "captions", 4)  # "broken" is its image's alone: encoded with it
    images = assert_progress(err, "embed images", "images", 13)  # the broken one is an error row, counted
    assert re.fullmatch(r"written [\d.]+ MB, errors 1", images[-1]["extra"])

    meta = read_cache_meta(out)
    assert result.meta == meta and result.fingerprint == meta.fingerprint and result.embedded == 12
    assert meta.complete and meta.latent.kind == "posterior_mean" and meta.latent.factor == 8
    assert meta.latent.scaling_factor == pytest.approx(0.18215)
    errors = read_index(out)["errors"].to_pylist()
    assert [(e["filename"], e["error"]) for e in errors] == [("zz_broken.jpg", "not_an_image")]
    good = sorted(sample_id(n) for n in names if n != "zz_broken.jpg")
    assert available_sample_ids(out).tolist() == good
    # 3 captions + the null caption (empty string), each once; "broken", a caption only the undecodable image
    # has, would have gone into that image's record
    assert meta.counts.texts == 4
    assert meta.records.layouts == ("planar",) and meta.records.text == "inline_when_unique"

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
    shards_before = set(read_index(out)["samples"].column("shard").to_pylist())
    make_dataset(root, manifest, 15, broken=["zz_broken.jpg"], unique_from=13)
    embed_cache(manifest, out)
    meta2 = read_cache_meta(out)
    assert meta2.summary.embedded == 3 and meta2.summary.errors == 0  # the error row is not retried
    assert shards_before <= set(read_index(out)["samples"].column("shard").to_pylist())
    index = read_index(out)
    ids = index["samples"].column("sample_id").to_numpy()
    assert len(ids) == len(np.unique(ids)) == 15
    assert_inline_texts(out, index, manifest, {"img_013.jpg": "only image 13", "img_014.jpg": "only image 14"})


def assert_inline_texts(out: str, index, manifest: str, unique: dict[str, str]) -> None:
    """The captions of ``unique`` (filename -> its caption, no other sample's) live in their sample's record:
    the index says so, their text rows name that record, the reader joins them from it with one read, and
    they are what the text encoders give for the caption."""
    from manifests.cache import CacheReader
    from pipeline.embed.loading import to_storage
    from pipeline.embed.job import EmbedJob, _factories

    samples = {r["sample_id"]: r for r in index["samples"].to_pylist()}
    texts = {r["caption_key"]: r for r in index["texts"].to_pylist()}
    for sid, row in samples.items():
        inline = sid in {sample_id(n) for n in unique}
        assert bool(row["text_inline"]) == inline
        if inline:
            assert {k: texts[row["caption_key"]][k] for k in ("shard", "offset", "length")} == \
                {k: row[k] for k in ("shard", "offset", "length")}  # fmt: skip
    reader = CacheReader(out)
    fetched = []
    fetch = reader._fetch
    reader._fetch = lambda items: fetched.append(len(items)) or fetch(items)  # count the ranged reads
    ids = [sample_id(n) for n in unique]
    records = reader.read(ids)
    assert fetched == [len(ids)]  # one record each, no text record
    encoder = _factories(EmbedJob(manifest=manifest, out=out), "BF16")[1](use_gpu=False)
    for caption, record, (tokens, _) in zip(unique.values(), records, encoder.encode(list(unique.values()))):
        assert record.caption_key == caption_key(caption)
        for got, want in zip(record.text.tokens, tokens):
            np.testing.assert_allclose(to_float32(got, "BF16"), to_float32(to_storage(want, "BF16"), "BF16"),
                                       atol=2e-2, rtol=2e-2)  # fmt: skip
    assert verify_cache(out).ok


def _planned_ids(plan: str) -> set[int]:
    return {i for batch in read_plan_rows(plan, [0]).table().column("sample_ids").to_pylist() for i in batch}


@pytest.mark.slow
@pytest.mark.full
def test_changed_image_and_caption_are_reembedded(tmp_path, ray_local, capsys):
    root, old_manifest, out = str(tmp_path / "data"), str(tmp_path / "m1"), str(tmp_path / "cache")
    make_dataset(root, old_manifest, 8)
    embed_cache(old_manifest, out)
    before, bytes_before = records_by_id(out), record_bytes(out)

    # same paths, new content: img_002 gets other bytes (a 112x112 image), img_003 another caption.
    # The manifest a rescan would give is written directly (only size/etag/caption change).
    image, captioned = sample_id("img_002.jpg"), sample_id("img_003.jpg")
    new_bytes = jpeg(112, 112, seed=99)
    fs, base = open_url(root)
    fs.pipe_file(join(base, "img_002.jpg"), new_bytes)
    rows = read_manifest(old_manifest).samples.to_pylist()
    for row in rows:
        if row["sample_id"] == image:
            row.update(width=112, height=112, size=len(new_bytes), etag='"new-etag"')
        if row["sample_id"] == captioned:
            row["caption"] = "a caption written later"
    samples, _ = apply_buckets(pa.Table.from_pylist(rows, SAMPLES_SCHEMA), SPEC)
    new_manifest = str(tmp_path / "m2")
    write_manifest(new_manifest, samples, ERRORS_SCHEMA.empty_table(), source=root, spec=SPEC)
    manifest = read_manifest(new_manifest)
    all_ids = sorted(before)
    fresh = sorted(set(all_ids) - {image, captioned})

    # before the re-embed the two are stale: left out of plans, and the user is told what to run
    assert available_sample_ids(out).tolist() == all_ids  # without a manifest: every record
    assert available_sample_ids(out, manifest=manifest).tolist() == fresh
    assert available_sample_ids(out, manifest=manifest.samples).tolist() == fresh
    plan = str(tmp_path / "plan")
    capsys.readouterr()
    assert main(["plan", new_manifest, "--out", plan, "--world-size", "1", "--batch-size", "1", "--cache", out]) == 0
    printed = capsys.readouterr().out
    assert "2 stale in the cache (left out)" in printed and f"bucketeer embed {new_manifest} --out {out}" in printed
    assert read_plan_meta(plan).samples.to_json() == {"planned": 6, "not_in_cache": 0, "stale": 2}
    assert _planned_ids(plan) == set(fresh)

    result = embed_cache(new_manifest, out)
    assert "2 changed" in capsys.readouterr().out
    meta = read_cache_meta(out)
    summary = meta.summary
    assert (summary.embedded, summary.changed, summary.skipped, summary.new_captions) == (2, 2, 6, 1)
    assert (result.embedded, result.changed, result.skipped, result.new_captions) == (2, 2, 6, 1)
    after, bytes_after = records_by_id(out), record_bytes(out)
    assert sorted(after) == all_ids
    assert after[image].original_size == (112, 112) and before[image].original_size == (80, 80)
    assert after[captioned].caption_key == caption_key("a caption written later") != before[captioned].caption_key
    assert after[captioned].text.lengths != before[captioned].text.lengths
    assert {i: bytes_after[i] for i in fresh} == {i: bytes_before[i] for i in fresh}  # untouched, byte for byte
    ids = read_index(out)["samples"].column("sample_id").to_numpy()
    assert len(ids) == len(np.unique(ids)) == 8  # the merged index holds only the newest record of each
    assert meta.counts.samples == 8 and meta.superseded_records == 2
    assert available_sample_ids(out, manifest=manifest).tolist() == all_ids
    assert verify_cache(out).ok
    assert embed_cache(new_manifest, out).up_to_date and "nothing to embed" in capsys.readouterr().out
    # the old manifest is now the changed one: its two rows are stale against the new records
    assert available_sample_ids(out, manifest=read_manifest(old_manifest)).tolist() == fresh


@pytest.mark.slow
def test_changed_settings_are_refused(tmp_path, ray_local, capsys):
    root, manifest, out = str(tmp_path / "data"), str(tmp_path / "manifest"), str(tmp_path / "cache")
    make_dataset(root, manifest, 4)
    embed_cache(manifest, out)
    with pytest.raises(CacheError, match=r"(?s)crop: 'center' -> 'random'.*new --out"):
        embed_cache(manifest, out, crop="random", seed=3)
    with pytest.raises(CacheError, match=r"dtype: 'BF16' -> 'F32'"):
        embed_cache(manifest, out, dtype="fp32")
    # the same settings are accepted; with nothing missing no encoder is even loaded
    assert embed_cache(manifest, out).up_to_date
    assert "nothing to embed" in capsys.readouterr().out
    # the command line: a bad combination is one line and exit code 2, before any work
    assert main(["embed", manifest, "--out", out, "--crops", "2", "--latents", "posterior"]) == 2
    assert "bucketeer embed: error: --latents posterior stores one posterior std" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.full
def test_kill_and_resume_equals_clean_run(tmp_path, ray_local):
    root, manifest = str(tmp_path / "data"), str(tmp_path / "manifest")
    clean, resumed = str(tmp_path / "clean"), str(tmp_path / "resumed")
    make_dataset(root, manifest, 14)
    address = ray_local.get_runtime_context().gcs_address
    env = {**os.environ, FAULTS_ENV: "cache.samples_committed=pause:120"}
    cmd = [sys.executable, "-m", "pipeline.embed", manifest, "--out", resumed, "--batch-size", "4",
           "--shard-records", "4", "--commit-seconds", "0", "--ray-address", address]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 120
        for line in proc.stdout:
            if pause_marker("cache.samples_committed") in line or time.time() > deadline:
                break
        assert proc.poll() is None, "embed exited before its first commit"
        partial = read_cache_meta(resumed)
        assert not partial.complete and 0 < partial.counts.samples < 14  # one unit or a few
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    embed_cache(manifest, resumed)
    embed_cache(manifest, clean)

    a, b = records_by_id(clean), records_by_id(resumed)
    assert sorted(a) == sorted(b) and len(a) == 14
    ids = read_index(resumed)["samples"].column("sample_id").to_numpy()
    assert len(ids) == len(np.unique(ids)) == 14  # nothing duplicated
    for sid in a:
        x, y = a[sid], b[sid]
        same = ("bucket", "original_size", "crop_box", "caption_key")
        assert [getattr(x, a) for a in same] == [getattr(y, a) for a in same]
        np.testing.assert_allclose(to_float32(x.latent, x.dtype), to_float32(y.latent, y.dtype), atol=2e-2)
        np.testing.assert_array_equal(x.text.tokens[0], y.text.tokens[0])
    assert read_cache_meta(resumed).fingerprint == read_cache_meta(clean).fingerprint
    assert verify_cache(resumed).ok


@pytest.mark.s3
@pytest.mark.slow
def test_embed_on_s3(s3, ray_local, s3_client):
    root, manifest, out = s3.fresh_url("data"), s3.fresh_url("manifest"), s3.fresh_url("cache")
    so = {**s3.storage_options, "bucketeer_client": s3_client}  # Ray's workers open their storage with it too
    names = make_dataset(root, manifest, 6, storage_options=so, broken=["zz_broken.jpg"])
    embed_cache(manifest, out, storage_options=so)
    s3.fs.invalidate_cache()
    assert available_sample_ids(out, so).tolist() == sorted(sample_id(n) for n in names[:-1])
    records = records_by_id(out, so)
    assert all(r.text is not None for r in records.values())
    assert "testing-secret-key" not in json.dumps(read_cache_meta(out, so).to_json())
    assert verify_cache(out, so).ok
