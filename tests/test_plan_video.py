"""bucketeer plan (and stats, rebucket) on video manifests: ``WxHxF`` buckets, a token budget that counts latent
frames, ``--check``, ``--where`` over the video columns, extend and resume, mixtures with image manifests, and the
per-epoch choice of a video's clip.

The manifests are written here from synthetic rows bucketed by the scan's own code
(:func:`tests.factories.video_manifest_tables`): no video is decoded, planning reads only the manifest.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from manifests.buckets import BucketSpec
from manifests.errors import UsageError
from manifests.frames import parse_video_bucket
from manifests.manifest import read_manifest, write_manifest
from manifests.plan import epoch_part, read_plan_rows, resume_plan
from manifests.plan.rows import PLAN_SCHEMA
from pipeline import PlanJob, run
from pipeline.cli import main
from tests.factories import manifest_tables, video_manifest_tables
from tests.test_plan import _rewrite

FRAMES = (17, 33, 49)
SPEC = BucketSpec(area=256 * 256, step=32)


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> str:
    """A video manifest: 400 videos (some too short) and 60 images as 1-frame samples."""
    url = str(tmp_path_factory.mktemp("video") / "m")
    write_manifest(url, *video_manifest_tables(400, 60, seed=1, frames=FRAMES, spec=SPEC), source="/clips",
                   spec=SPEC, frame_ladder=FRAMES)  # fmt: skip
    return url


def _rows(url: str, epoch: int) -> dict:
    return read_plan_rows(url, [epoch]).table().to_pydict()


def _tokens(name: str, t: int = 4) -> int:
    w, h, f = parse_video_bucket(name)
    return (w // 16) * (h // 16) * ((f - 1) // t + 1)


def test_token_budget_gives_long_clips_smaller_batches_and_the_plan_checks(video, tmp_path, capsys):
    out = str(tmp_path / "plan")
    result = run(PlanJob(manifests=(video,), out=out, world_size=2, max_tokens=4096, epochs=2, seed=1,
                         leftover="pad", progress=False))  # fmt: skip
    meta = result.meta
    assert meta.inputs.temporal_factor == 4 and json.loads(Path(out, "_plan.json").read_text())["inputs"][
        "temporal_factor"] == 4  # fmt: skip
    assert "4 frames per latent frame" in capsys.readouterr().out
    frames = {parse_video_bucket(n)[2] for n in meta.buckets}
    assert {1, 17, 33, 49} <= frames  # clips of every rung and 1-frame images
    for name, info in meta.buckets.items():
        assert info.latent_tokens == _tokens(name) and info.batch_size == 4096 // _tokens(name)
    assert meta.buckets["256x256x49"].batch_size < meta.buckets["256x256x17"].batch_size < meta.buckets[
        "256x256x1"].batch_size  # fmt: skip
    samples = read_manifest(video).samples
    bucket_of = dict(zip(samples.column("sample_id").to_pylist(), samples.column("bucket").to_pylist()))
    for epoch in (0, 1):
        rows = _rows(out, epoch)
        for bucket, ids in zip(rows["bucket"], rows["sample_ids"]):
            assert {bucket_of[i] for i in ids} == {bucket} and len(ids) * _tokens(bucket) <= 4096
        assert {bucket_of[i] for ids in rows["sample_ids"] for i in ids} == set(bucket_of.values())  # pad: all
    assert run(PlanJob(check=out, manifests=(video,), progress=False)).exit_code == 0


def test_check_catches_a_tampered_video_plan(video, tmp_path):
    out = tmp_path / "plan"
    run(PlanJob(manifests=(video,), out=str(out), world_size=2, max_tokens=4096, epochs=1, seed=2, progress=False))
    meta_file = out / "_plan.json"
    original = meta_file.read_text()
    tampered = json.loads(original)
    tampered["inputs"]["temporal_factor"] = 8  # another VAE's frames: other tokens, other batch sizes
    meta_file.write_text(json.dumps(tampered))
    problems = run(PlanJob(check=str(out), manifests=(video,), progress=False)).violations
    assert any("batch size or latent tokens" in p and "x49" in p for p in problems)
    meta_file.write_text(original)

    def swap(table: pa.Table) -> pa.Table:  # a clip moved into a batch of another frame count
        rows = table.to_pydict()
        other = next(i for i, b in enumerate(rows["bucket"]) if b != rows["bucket"][0])
        rows["sample_ids"][0] = [rows["sample_ids"][other][0], *rows["sample_ids"][0][1:]]
        return pa.Table.from_pydict(rows, schema=PLAN_SCHEMA)

    _rewrite(out / epoch_part(0), 1, swap)
    problems = run(PlanJob(check=str(out), manifests=(video,), progress=False)).violations
    assert any("sha256" in p for p in problems) and len(problems) >= 2


def test_budget_and_temporal_factor_errors_are_one_line(video, tmp_path, capsys):
    image = str(tmp_path / "images")
    write_manifest(image, *manifest_tables(40, seed=4, spec=SPEC), source="/d", spec=SPEC)
    base = ["--out", str(tmp_path / "p"), "--world-size", "1"]
    assert main(["plan", video, *base, "--max-tokens", "1000"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "x49 has" in err and "above --max-tokens 1000" in err
    assert main(["plan", image, *base, "--batch-size", "2", "--temporal-factor", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--temporal-factor" in err
    assert main(["plan", video, *base, "--max-tokens", "4096", "--temporal-factor", "8", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["inputs"]["temporal_factor"] == 8
    assert printed["buckets"]["256x256x49"] == {"samples": printed["buckets"]["256x256x49"]["samples"],
                                                "batch_size": 4096 // _tokens("256x256x49", 8),
                                                "latent_tokens": _tokens("256x256x49", 8)}  # fmt: skip
    assert main(["plan", "--check", str(tmp_path / "p"), video]) == 0


def test_where_selects_over_the_video_columns(video, tmp_path, capsys):
    out = str(tmp_path / "plan")
    run(PlanJob(manifests=(video,), out=out, world_size=1, batch_size=2, leftover="pad", where="frames >= 33",
                progress=False))  # fmt: skip
    samples = read_manifest(video).samples
    frames = dict(zip(samples.column("sample_id").to_pylist(), samples.column("frames").to_pylist()))
    planned = {i for ids in _rows(out, 0)["sample_ids"] for i in ids}
    assert planned == {i for i, f in frames.items() if f >= 33}
    assert {parse_video_bucket(b)[2] for b in _rows(out, 0)["bucket"]} == {33, 49}
    assert main(["plan", "--check", out, video]) == 0
    assert main(["stats", video, "--where", "frames >= 33"]) == 0
    assert f"kept {len(planned)}" in capsys.readouterr().out.replace(",", "")


def test_mixture_of_video_and_image_manifests_extend_and_resume(video, tmp_path):
    """Images of an image manifest (``WxH``) and of a video one (``WxHx1``) are both one latent frame; a mixture
    keeps their buckets apart, checks, extends and resumes on fewer ranks like any plan."""
    image = str(tmp_path / "images")
    write_manifest(image, *manifest_tables(120, seed=5, spec=SPEC), source="/d", spec=SPEC)
    out = str(tmp_path / "mix")
    meta = run(PlanJob(manifests=(video, image), out=out, world_size=2, max_tokens=4096, repeats="1,2", epochs=3,
                       window=1, seed=3, progress=False)).meta  # fmt: skip
    names = set(meta.buckets)
    assert any(n.count("x") == 1 for n in names) and any(n.endswith("x1") for n in names)
    assert all(meta.buckets[n].latent_tokens == _tokens(n if n.count("x") == 2 else n + "x1") for n in names)
    with pytest.raises(UsageError, match="--temporal-factor 8 differs from the plan's 4"):
        run(PlanJob(manifests=(video, image), extend=out, temporal_factor=8, progress=False))
    run(PlanJob(manifests=(video, image), extend=out, progress=False))
    assert run(PlanJob(check=out, manifests=(video, image), progress=False)).exit_code == 0
    resumed = str(tmp_path / "resumed")
    resume_plan(out, resumed, epoch=1, step=3, world_size=1)
    assert run(PlanJob(check=resumed, manifests=(video, image), progress=False)).exit_code == 0
    rows = _rows(out, 1)
    whole = Counter(i for step, ids in zip(rows["step"], rows["sample_ids"]) if step >= 3 for i in ids)
    rest = Counter(i for ids in _rows(resumed, 1)["sample_ids"] for i in ids)
    assert rest == whole


def test_stats_shows_frame_buckets_and_rebucket_gives_what_a_scan_would(video, tmp_path, capsys):
    assert main(["stats", video]) == 0
    out = capsys.readouterr().out
    assert "256x256x49" in out and "256x256x1" in out
    small = BucketSpec(area=128 * 128, step=32, min_side=96)  # smaller buckets, and some too_small rows now
    again = str(tmp_path / "re")
    assert main(["rebucket", video, "--out", again, "--resolution", "128", "--bucket-step", "32",
                 "--min-side", "96"]) == 0  # fmt: skip
    scanned = str(tmp_path / "scanned")  # the same rows as a video scan with those options buckets them
    write_manifest(scanned, *video_manifest_tables(400, 60, seed=1, frames=FRAMES, spec=small), source="/clips",
                   spec=small, frame_ladder=FRAMES)  # fmt: skip
    got, want = read_manifest(again), read_manifest(scanned)
    assert got.meta.frame_ladder == FRAMES and got.meta.bucket_spec == want.meta.bucket_spec
    assert got.samples.to_pylist() == want.samples.to_pylist() and got.errors.to_pylist() == want.errors.to_pylist()
    kinds = Counter(got.errors.column("error").to_pylist())
    assert kinds["too_small"] > 0 and kinds["too_short"] > 0
    assert {b.split("x")[2] for b in got.samples.column("bucket").to_pylist()} == {"1", "17", "33", "49"}


def test_a_videos_clip_is_drawn_per_epoch():
    """A video of several clips trains on one clip per epoch (the variant draw of train/data/draws.py): a pure
    function of (seed, epoch, sample), over the epochs every clip, and a 1-clip sample always clip 0."""
    from train.data import variant_choice

    ids = np.arange(1, 401, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    clips = np.where(np.arange(400) % 4 == 0, 1, 2 + np.arange(400) % 3)  # 1, 2, 3 or 4 clips
    draws = np.stack([variant_choice(7, e, ids, clips) for e in range(12)])  # (epochs, samples)
    assert np.array_equal(draws, np.stack([variant_choice(7, e, ids, clips) for e in range(12)]))
    assert np.array_equal(variant_choice(7, 3, ids[::-1], clips[::-1]), draws[3][::-1])  # not of the batch
    assert np.all(draws[:, clips == 1] == 0) and np.all(draws < clips)
    several = clips > 1
    assert np.mean((draws[0] != draws[1])[several]) > 0.4  # epochs differ
    seen = np.array([len(set(draws[:, s].tolist())) for s in range(400)])
    assert np.mean(seen[several] == clips[several]) > 0.8  # 12 epochs visit (nearly) every clip
    assert not np.array_equal(draws[0], variant_choice(8, 0, ids, clips))  # another seed, another draw



def _video_cache(url: str, manifest_url: str, temporal_factor: int) -> None:
    """A committed cache whose ``_cache.json`` says its VAE's temporal factor, with a fresh record per sample (tiny
    stand-in latents: the plan reads the index and ``_cache.json``, never a latent)."""
    from manifests.cache import CacheWriter
    from manifests.cache.freshness import source_key
    from manifests.cache.records import SampleRecord, caption_key, encode_sample

    info = {"latent": {"kind": "posterior_mean", "dtype": "F32", "channels": 4, "factor": 8,
                       "temporal_factor": temporal_factor}}  # fmt: skip
    writer = CacheWriter(url, {"dtype": "F32", "vae": {"id": "wan-like", "weights_sha256": "aa"}}, info=info)
    manifest = read_manifest(manifest_url)
    samples = manifest.samples
    for sid, bucket, caption, key in zip(samples.column("sample_id").to_pylist(), samples.column("bucket").to_pylist(),
                                         samples.column("caption").to_pylist(), source_key(samples).tolist()):
        record = SampleRecord(sample_id=sid, bucket=bucket, latent=np.zeros((4, 1, 2, 2), np.float32), dtype="F32",
                              original_size=(8, 8), resized_size=(8, 8), crop_top_left=(0, 0), target_size=(8, 8),
                              caption_key=caption_key(caption))  # fmt: skip
        writer.add_sample(sid, encode_sample(record), record.caption_key, bucket, source_key=key)
    writer.finish(manifest.fingerprint)


def test_the_caches_temporal_factor_counts_the_latent_frames(video, tmp_path, capsys):
    cache = str(tmp_path / "cache")
    _video_cache(cache, video, temporal_factor=8)
    out = str(tmp_path / "plan")
    meta = run(PlanJob(manifests=(video,), out=out, cache=(cache,), world_size=1, max_tokens=4096, leftover="pad",
                       progress=False)).meta  # fmt: skip
    assert meta.inputs.temporal_factor == 8 and meta.samples.planned == read_manifest(video).samples.num_rows
    assert meta.buckets["256x256x49"].latent_tokens == _tokens("256x256x49", 8)
    assert main(["plan", "--check", out, video, "--cache", cache]) == 0
    capsys.readouterr()
    assert main(["plan", video, "--out", str(tmp_path / "p2"), "--cache", cache, "--world-size", "1",
                 "--batch-size", "1", "--temporal-factor", "4"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--temporal-factor 4 differs from the 8" in err
