"""``bucketeer demo``: the real default run (what `make demo` does), the commands of README.md and docs/ that
use its output, the ``--s3`` mode (server started and stopped), and the refusal to clear a foreign folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from manifests.manifest import read_manifest
from manifests.plan import read_plan_meta
from pipeline.cli import main
from tests.test_readme import ROOT, bash_env, doc_blocks, run_bash

BUCKETEER = str(Path(sys.executable).parent / "bucketeer")
IMAGES = 200  # the demo's default
STAGES = ("generate", "ray", "scan", "annotate", "dedup", "embed", "plan", "train", "verify", "report")


def run_demo(cwd: Path, *argv: str, timeout: float = 600) -> tuple[str, float]:
    start = time.perf_counter()
    proc = subprocess.run([BUCKETEER, "demo", *argv], cwd=cwd, env=bash_env(), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output, time.perf_counter() - start


@pytest.fixture(scope="module")
def demo(tmp_path_factory, bucketeer_home):
    """`bucketeer demo` with its defaults, from a folder that has the repository's infra/ (as the root has)."""
    cwd = tmp_path_factory.mktemp("demo")
    (cwd / "infra").symlink_to(ROOT / "infra")
    output, seconds = run_demo(cwd)
    print(f"bucketeer demo took {seconds:.1f} s")  # shown with -s; the demo prints its own stage timings
    return cwd, output, seconds


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
def test_demo_runs_every_stage_and_prints_the_summary(demo):
    cwd, output, seconds = demo
    out = cwd / "demo-output"
    for i, stage in enumerate(STAGES, 1):
        assert re.search(rf"^\[{i}/{len(STAGES)}\] {stage}: ", output, re.MULTILINE), f"no progress line for {stage}"
        assert re.search(rf"^ +{stage} done in \d+\.\d s$", output, re.MULTILINE), f"no timing for {stage}"
    figures = json.loads((out / "demo-summary.json").read_text())
    assert set(figures["stage_seconds"]) == set(STAGES)
    assert figures["total_seconds"] < 300, f"the demo must take under 5 minutes, took {figures['total_seconds']} s"

    # the artifacts, each valid by its own reader
    manifest = read_manifest(str(out / "manifest"))
    assert manifest.samples.num_rows == IMAGES and figures["scan"]["samples"] == IMAGES
    assert figures["scan"]["errors_by_kind"] == {"empty": 1, "not_an_image": 1, "truncated": 1}
    assert len(set(manifest.samples.column("bucket").to_pylist())) >= 4, "several aspect-ratio buckets"
    assert read_plan_meta(str(out / "plan")).inputs.world_size == 2
    assert figures["embed"]["samples"] == IMAGES
    assert (out / "train" / "model").is_dir() and (out / "train.log").exists()
    assert "on 2 process(es)" in output and "plan finished" in output
    assert 24 <= figures["train"]["steps"] <= 100, "a few dozen steps"
    assert figures["train"]["loss_last"] < figures["train"]["loss_first"], "the tiny model learns something"
    assert (out / "report.html").exists() and len(list((out / "report_figures").glob("*.png"))) >= 7

    # the summary: where things are, the figures, the commands for a cluster
    summary = output[output.index("bucketeer demo finished") :]
    for text in (str(out / "manifest"), str(out / "annotations"), str(out / "duplicates"), str(out / "report.html"),
                 "files/s", "empty 1, not_an_image 1, truncated 1", "padded", "dropped", "loss ", "samples/s",
                 "ray job submit --runtime-env infra/ray/runtime_env.yaml --working-dir . -- python -m pipeline.scan s3://",
                 "python -m pipeline.annotate s3://", "bucketeer dedup s3://", "python -m pipeline.embed s3://",
                 "bucketeer plan s3://", "--where \"NOT duplicate AND contrast > 0.02\"",
                 "accelerate launch --config_file infra/accelerate/ddp-1x8.yaml -m train"):  # fmt: skip
        assert text in summary, f"the summary lacks {text!r}:\n{summary}"
    # what is on the screen is bucketeer's: no line of Ray's internals (pipeline/ray_output.py)
    assert "core_worker" not in output and "Token authentication" not in output, output[:6000]
    scan_line = next(line for line in summary.splitlines() if line.strip().startswith("scan "))
    assert f"{figures['scan']['files_per_s']:.0f} files/s" in scan_line


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
def test_demo_finds_the_planted_duplicates_and_plans_without_them(demo):
    import polars as pl

    from manifests.annotations import read_annotations
    from pipeline.demo.job import WHERE

    cwd, output, _ = demo
    out = cwd / "demo-output"
    figures = json.loads((out / "demo-summary.json").read_text())
    assert figures["annotate"]["annotated"] == IMAGES and figures["annotate"]["errors"] == 0
    names = pl.read_parquet(out / "manifest" / "samples" / "*.parquet").select("sample_id", "filename")
    dups = pl.from_arrow(read_annotations(str(out / "duplicates"))[1]).join(names, on="sample_id")
    # the clusters are exactly the planted ones: each copy with its original, the blank frames together
    originals = sorted(str(p.relative_to(out / "dataset")) for p in (out / "dataset").glob("part*/*.jpg"))[:6]
    copies = {int(p.stem[-2:]): f"curation/{p.name}" for p in (out / "dataset" / "curation").glob("*.jpg")}
    expected = {frozenset({original, copies[j]}) for j, original in enumerate(originals)}
    expected.add(frozenset(f"curation/blank_0{j}.png" for j in range(3)))
    clusters = {frozenset(group["filename"].to_list())
                for _, group in dups.filter(pl.col("cluster_id").is_not_null()).group_by("cluster_id")
                if group.height > 1}  # fmt: skip
    assert clusters == expected
    assert figures["dedup"]["duplicates"] == dups["duplicate"].sum() == 6 + 2
    # the plan: every sample but the duplicates and the blank frame that kept its cluster (contrast 0)
    blank_keeper = dups.filter(pl.col("filename").str.starts_with("curation/blank") & ~pl.col("duplicate"))
    dropped = set(dups.filter(pl.col("duplicate"))["sample_id"]) | set(blank_keeper["sample_id"])
    assert figures["plan"]["kept"] == IMAGES - len(dropped) and figures["plan"]["dropped_by_where"] == len(dropped)
    planned = set(pl.read_parquet(out / "plan" / "epoch-*.parquet")["sample_ids"].explode())
    assert planned and not planned & dropped
    assert f"select:   {IMAGES - 9} of {IMAGES} samples kept (9 dropped) where {WHERE}" in output


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.dist
def test_documented_commands_on_the_demo_output_run(demo):
    cwd, _, _ = demo
    blocks = doc_blocks("demo")  # README.md's, then docs/'s
    assert {b.doc.name for b in blocks} >= {"README.md", "annotate.md", "scan.md", "training.md"}
    output = "".join(run_bash(b.code, cwd, bash_env(), timeout=300) for b in blocks)
    out = cwd / "demo-output"
    assert "demo-output/cache: OK" in output and "demo-output/plan: ok" in output
    assert f"kept {IMAGES - 9} of {IMAGES} samples" in output  # stats --where: the planted duplicates and blanks out
    assert read_manifest(str(out / "manifest-512")).spec.area == 512 * 512
    # stopped after 20 steps on 2 processes, finished on 1: the whole plan, each step once
    assert "--max-steps 20 reached" in output and "on 1 process(es)" in output
    total = read_plan_meta(str(out / "plan")).steps_per_epoch * 2
    assert f"position {total}" in output and (out / "run" / "model").is_dir()
    assert read_plan_meta(str(out / "plan-from-1-10")).inputs.world_size == 1


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.ray
@pytest.mark.dist
@pytest.mark.full
def test_demo_s3_mode_uses_s3_urls_and_stops_its_server(tmp_path, bucketeer_home):
    output, _ = run_demo(tmp_path, "--s3", "--images", "60", "--out-dir", str(tmp_path / "out"))
    started = re.search(r"local S3-compatible server on http://127\.0\.0\.1:(\d+) \(pid (\d+)\)", output)
    assert started, output[-3000:]
    assert f"local S3-compatible server (pid {started.group(2)}) stopped" in output
    with pytest.raises(ProcessLookupError):
        os.kill(int(started.group(2)), 0)
    figures = json.loads((tmp_path / "out" / "demo-summary.json").read_text())
    assert figures["mode"] == "s3" and set(figures["stage_seconds"]) >= {"s3 server", "s3 upload", "train"}
    for name in ("dataset", "manifest", "cache", "plan"):
        assert figures["artifacts"][name] == f"s3://bucketeer-demo/{name}"
    assert figures["scan"]["samples"] == 60 and figures["embed"]["samples"] == 60
    assert "--storage-options" in output and "plan finished" in output
    assert (tmp_path / "out" / "report.html").exists()
    assert "local-demo-secret" not in output  # the placeholder credentials are not printed either
    assert "core_worker" not in output and figures["dedup"]["duplicates"] == 8  # 51 images + the 9 planted


def test_demo_refuses_to_clear_a_folder_it_did_not_make(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    assert main(["demo", "--out-dir", str(tmp_path)]) == 2
    assert "was not made by `bucketeer demo`" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_demo_rejects_too_few_images(tmp_path, capsys):
    assert main(["demo", "--images", "3", "--out-dir", str(tmp_path / "x")]) == 2
    assert "--images must be >= 8" in capsys.readouterr().err
