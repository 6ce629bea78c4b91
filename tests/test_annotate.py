"""``bucketeer annotate --task caption`` on real Ray with the tiny default VLM (real transformers
Llava, saved and loaded locally): a mixed dataset (loose files, a tar shard, a parquet source), every
sample once; a rescan captions only the new images; SIGKILL and re-run completes with nothing twice;
other settings refused; the generated captions merged into caption lists by ``scan --captions``; embed,
plan and 2 training steps from the recaptioned manifest."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq
import pytest

from manifests.annotations import ANNOTATIONS_FILE, read_annotations, read_annotations_meta, read_parts
from manifests.errors import UsageError
from manifests.faults import FAULTS_ENV
from manifests.manifest import read_manifest
from pipeline import AnnotateJob, PlanJob, ScanJob, run
from pipeline.cli import main
from pipeline.scan import ScanConfig
from tests.embed_data import SPEC, embed_cache, jpeg
from tests.shards import tar_bytes
from tests.train_dataset import train_here

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("bucketeer_home")]

QUIET = ScanConfig(progress=False)
FAST = {"max_new_tokens": 6, "batch_size": 4, "unit_rows": 4}  # the tiny model, a few tokens, small units


@dataclass(frozen=True)
class Captioned:
    root: Path
    manifest: str
    out: str
    ids: set[int]  # the manifest's sample ids
    broken: int  # the broken image's sample id


def _loose_and_tar(root: Path, first: int = 0, n: int = 6) -> None:
    """``n`` loose JPEGs (sidecar captions on the even ones; the first stored sideways, EXIF 6) and, the first
    time, a tar shard of 4 images and a JPEG cut short (its header reads, its pixels do not decode)."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(first, first + n):
        (root / f"img_{i:03d}.jpg").write_bytes(jpeg(96, 64, seed=i, orientation=6 if i == 0 else 1))
        if i % 2 == 0:
            (root / f"img_{i:03d}.txt").write_text(f"original caption {i}")
    if first == 0:
        members = [(f"s{i}.jpg", jpeg(64, 96, seed=100 + i)) for i in range(4)] + [("s0.txt", b"tar caption")]
        (root / "shard-000.tar").write_bytes(tar_bytes(members))
        (root / "zz_cut.jpg").write_bytes(jpeg(400, 300, seed=99)[:20_000])


def _annotate(manifest: str, out: str, **options):
    return run(AnnotateJob(manifest=manifest, out=out, **{**FAST, **options}))


def _check_once(out: str, manifest: str, so: dict | None = None, changed: int = 0) -> tuple[pa.Table, pa.Table]:
    """Every manifest sample in exactly one of parts and errors, once, also in the raw files (where
    ``changed`` images were captioned again, their old rows stay in the files; the newest counts)."""
    ids = set(read_manifest(manifest, so).samples.column("sample_id").to_pylist())
    meta, rows, errors = read_annotations(out, so)
    raw = [t.column("sample_id").to_pylist() for t in (read_parts(out, so, "parts"), read_parts(out, so, "errors"))]
    flat = raw[0] + raw[1]
    assert len(flat) == len(set(flat)) + changed, "a sample was written twice"
    assert set(flat) == ids and not set(raw[0]) & set(raw[1])
    assert set(rows.column("sample_id").to_pylist()) | set(errors.column("sample_id").to_pylist()) == ids
    assert meta.counts.samples == len(ids) == meta.counts.annotated + meta.counts.errors
    return rows, errors


@pytest.fixture(scope="module")
def captioned(tmp_path_factory, ray_local) -> Captioned:
    base = tmp_path_factory.mktemp("annotate")
    root, manifest, out = base / "images", str(base / "manifest"), str(base / "captions")
    _loose_and_tar(root)
    run(ScanJob(source=str(root), out=manifest, spec=SPEC, config=QUIET))
    result = _annotate(manifest, out)
    samples = read_manifest(manifest).samples
    ids = set(samples.column("sample_id").to_pylist())
    cut = samples.filter(pa.compute.equal(samples.column("filename"), "zz_cut.jpg")).column("sample_id")[0].as_py()
    assert (result.captioned, result.errors, result.engine) == (10, 1, "transformers")
    # the units' times: on the actors, within the run (the actor's start and model load left out)
    assert 0 < result.units_seconds < result.seconds and result.worker_cpu_seconds > 0
    return Captioned(root, manifest, out, ids, cut)


def test_every_sample_once_errors_for_what_does_not_decode(captioned):
    rows, errors = _check_once(captioned.out, captioned.manifest)
    assert errors.column("sample_id").to_pylist() == [captioned.broken]
    assert errors.column("error").to_pylist() == ["truncated"]
    assert {f for f in rows.column("filename").to_pylist() if f.startswith("shard-000.tar")} == \
        {f"shard-000.tar/s{i}.jpg" for i in range(4)}  # fmt: skip
    assert all(isinstance(c, str) for c in rows.column("caption").to_pylist())
    assert all(0 < n <= 6 for n in rows.column("generated_tokens").to_pylist())
    meta = read_annotations_meta(captioned.out)
    task = meta.task("caption")
    assert task.model == "default" and task.max_new_tokens == 6 and len(task.weight_sha256) == 64
    assert meta.manifest_fingerprint == read_manifest(captioned.manifest).meta.fingerprint


def test_a_rerun_does_nothing_other_settings_are_refused(captioned, capsys):
    again = _annotate(captioned.manifest, captioned.out)
    assert again.up_to_date and again.captioned == 0 and again.skipped == len(captioned.ids)
    parts = sorted(os.listdir(Path(captioned.out) / "parts"))
    with pytest.raises(UsageError, match="other settings .*prompt"):
        _annotate(captioned.manifest, captioned.out, prompt="Name the colours.")
    assert sorted(os.listdir(Path(captioned.out) / "parts")) == parts
    capsys.readouterr()
    bad = str(Path(captioned.out).parent / "no-such-model")
    assert main(["annotate", captioned.manifest, "--out", str(Path(captioned.out).parent / "x"), "--model", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("bucketeer annotate: error: --model") and "cannot load" in err[-1]
    assert not (Path(captioned.out).parent / "x" / "parts").exists()


def test_parquet_source(tmp_path, ray_local):
    root = tmp_path / "pq"
    root.mkdir()
    images = [jpeg(64 + 8 * i, 64, seed=200 + i) for i in range(5)]
    pq.write_table(pa.table({"image": images, "text": [f"row {i}" for i in range(5)]}), root / "data.parquet",
                   row_group_size=2)  # fmt: skip
    manifest, out = str(tmp_path / "manifest"), str(tmp_path / "captions")
    run(ScanJob(source=str(root), out=manifest, spec=SPEC, config=ScanConfig(
        progress=False, format="parquet", image_column="image", caption_column="text")))  # fmt: skip
    result = _annotate(manifest, out)
    assert result.captioned == 5 and result.errors == 0
    _check_once(out, manifest)


@pytest.mark.slow
def test_rescan_captions_only_the_new_images_and_merges_into_caption_lists(captioned, tmp_path):
    root, manifest, out = tmp_path / "images", str(tmp_path / "manifest"), str(tmp_path / "captions")
    shutil.copytree(captioned.root, root)
    shutil.copytree(captioned.manifest, manifest)
    shutil.copytree(captioned.out, out)
    _loose_and_tar(root, first=6, n=5)  # 5 new images
    (root / "img_005.jpg").write_bytes(jpeg(64, 96, seed=55))  # and a changed one
    (root / "img_004.txt").write_text("an edited caption")  # a caption edit changes no image
    run(ScanJob(source=str(root), out=manifest, spec=SPEC, config=QUIET))
    result = _annotate(manifest, out)
    assert result.captioned == 6 and result.skipped == len(captioned.ids) - 1
    rows, _ = _check_once(out, manifest, changed=1)

    merged = str(tmp_path / "merged")
    run(ScanJob(source=str(root), out=merged, spec=SPEC, captions=out, config=QUIET))
    generated = dict(zip(rows.column("filename").to_pylist(), rows.column("caption").to_pylist()))
    samples = {r["filename"]: r for r in read_manifest(merged).samples.to_pylist()}
    assert samples["img_002.jpg"]["captions"] == ["original caption 2", " ".join(generated["img_002.jpg"].split())]
    assert samples["img_002.jpg"]["caption"] == "original caption 2"  # the original stays first
    assert samples["img_004.jpg"]["captions"][0] == "an edited caption"
    assert samples["shard-000.tar/s0.jpg"]["captions"][0] == "tar caption"
    if generated["img_003.jpg"].strip():  # no original: the generated caption alone
        assert samples["img_003.jpg"]["caption"] == " ".join(generated["img_003.jpg"].split())
    assert samples["zz_cut.jpg"]["captions"] is None  # no generated caption: what it had
    # a rescan merging the same annotations again adds nothing twice; annotating it again captions nothing
    run(ScanJob(source=str(root), out=merged, spec=SPEC, captions=out, config=QUIET))
    assert {r["filename"]: r["captions"] for r in read_manifest(merged).samples.to_pylist()} == \
        {n: r["captions"] for n, r in samples.items()}  # fmt: skip
    assert _annotate(merged, out).captioned == 0  # the caption lists changed, no image did

    # into training, unchanged: embed, plan, 2 steps
    cache, plan = str(tmp_path / "cache"), str(tmp_path / "plan")
    embed_cache(merged, cache)
    run(PlanJob(manifests=(merged,), out=plan, world_size=1, batch_size=2, epochs=1, seed=0, cache=(cache,)))
    assert train_here("--plan", plan, "--cache", cache, "--output-dir", tmp_path / "train", "--max-steps", 2).steps == 2


MULTI = ("caption", "embedding", "aesthetic", "phash", "sha256", "stats")  # one pass: a VLM, CLIP, a head, numpy


@pytest.mark.slow  # a subprocess driver
@pytest.mark.full
def test_kill_and_rerun_completes_with_nothing_twice(captioned, tmp_path, ray_local):
    """Several tasks in one pass (captions as the caption-only run's), killed with SIGKILL and run again."""
    out = str(tmp_path / "captions")
    address = ray_local.get_runtime_context().gcs_address
    env = {**os.environ, FAULTS_ENV: "annotate.unit=sleep:3"}  # slow units: the kill lands mid-job
    cmd = [sys.executable, "-m", "pipeline.annotate", captioned.manifest, "--out", out, "--task", ",".join(MULTI),
           "--max-new-tokens", "6",
           "--batch-size", "1", "--unit-rows", "1", "--ray-address", address]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    parts = Path(out) / "parts"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(list(parts.glob("*.parquet")) if parts.exists() else []) < 2:
            time.sleep(0.2)
        assert proc.poll() is None, "annotate finished before it was killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (Path(out) / ANNOTATIONS_FILE).exists()
    done = len(read_parts(out, None, "parts")) + len(read_parts(out, None, "errors"))
    assert 2 <= done < len(captioned.ids)
    result = _annotate(captioned.manifest, out, unit_rows=1, batch_size=1, tasks=MULTI)
    # the killed run's actors may finish their in-flight units after its driver died (Ray stops them when it
    # notices): the rerun adopts every part on storage when it starts, at least the `done` counted above, and
    # captions only the rest; _check_once: no sample written twice
    assert result.skipped >= done and result.captioned + result.errors + result.skipped == len(captioned.ids)
    rows, _ = _check_once(out, captioned.manifest)
    first = read_annotations(captioned.out)[1]
    assert sorted(rows.column("sample_id").to_pylist()) == sorted(first.column("sample_id").to_pylist())
    np.testing.assert_array_equal(rows.sort_by("sample_id").column("caption").to_numpy(zero_copy_only=False),
                                  first.sort_by("sample_id").column("caption").to_numpy(zero_copy_only=False))
    assert [t.task for t in read_annotations_meta(out).tasks] == list(MULTI)
    assert rows.column("embedding").null_count == 0 and len(set(rows.column("sha256").to_pylist())) == rows.num_rows


@pytest.mark.s3
def test_annotate_on_s3(s3, ray_local):
    from tests.embed_data import make_dataset

    root, manifest, out, so = s3.fresh_url("data"), s3.fresh_url("manifest"), s3.fresh_url("captions"), \
        s3.storage_options  # fmt: skip
    make_dataset(root, manifest, 6, storage_options=so, broken=["zz_broken.jpg"])
    result = _annotate(manifest, out, storage_options=so, unit_rows=2)
    assert (result.captioned, result.errors) == (6, 1)  # the broken file: an error row, read and refused
    _check_once(out, manifest, so)
    assert _annotate(manifest, out, storage_options=so, unit_rows=2).up_to_date


def test_report_grid_of_original_and_generated_captions(captioned, tmp_path):
    from pipeline import ReportJob

    page = tmp_path / "report.html"
    run(ReportJob(manifest=captioned.manifest, out=str(page), annotations=captioned.out, progress=False))
    text = page.read_text()
    assert "Annotations: " in text and "settings fingerprint" in text
    assert text.count('id="fig-caption-') == 10  # every captioned sample (the cut one has none), as a thumbnail
    assert "img_002.jpg | original: original caption 2 | generated: " in text
    assert "img_001.jpg | original: (none) | generated: " in text
