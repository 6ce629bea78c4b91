"""Artifacts written by bucketeer 0.2 (tests/fixtures/v0_2, made by that release's own commands) still read,
check and verify, and the same inputs still give the same bytes: each fixture plan is planned again from its
recorded inputs and must come out with the same fingerprint and the same epoch files (sha256). Parquet bytes
carry the writer's version, so with another pyarrow than the one that wrote the fixtures (``make
test-floors``) the same inputs must give the same rows instead.

How the fixtures were made (bucketeer 0.2, before the typed metadata):
    bucketeer demo --images 24 --out-dir D            # manifest, cache, plan (2 ranks x 4, 2 epochs, seed 0)
    bucketeer rebucket D/manifest --out manifest-512 --resolution 512
    bucketeer plan manifest manifest-512 --out mix-plan --repeats 1,2 --world-size 2 --batch-size 2 --epochs 2 --seed 3
    bucketeer plan manifest --out packed-plan --cache cache --max-tokens 1024 --leftover pad --world-size 2 --epochs 1
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "v0_2"


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _same_writer(folder: Path) -> bool:
    """Whether this pyarrow wrote the parquet files of ``folder`` (then their bytes can be compared)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = next(folder.rglob("*.parquet"))
    return pq.ParquetFile(first).metadata.created_by == f"parquet-cpp-arrow version {pa.__version__}"


def _rows(folder: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return [row for f in sorted(folder.rglob("*.parquet")) for row in pq.read_table(f).to_pylist()]


@pytest.fixture()
def fixtures(tmp_path: Path) -> Path:
    """A writable copy: checks and rebuilds must never touch the committed fixtures."""
    return Path(shutil.copytree(FIXTURES, tmp_path / "v0_2"))


def test_fixtures_check_and_verify(fixtures: Path) -> None:
    assert main(["stats", str(fixtures / "manifest")]) == 0
    assert main(["verify", str(fixtures / "cache")]) == 0
    assert main(["plan", "--check", str(fixtures / "plan"), str(fixtures / "manifest"),
                 "--cache", str(fixtures / "cache")]) == 0  # fmt: skip
    assert main(["plan", "--check", str(fixtures / "mix-plan"), str(fixtures / "manifest"),
                 str(fixtures / "manifest-512")]) == 0  # fmt: skip
    assert main(["plan", "--check", str(fixtures / "packed-plan"), str(fixtures / "manifest"),
                 "--cache", str(fixtures / "cache")]) == 0  # fmt: skip


def test_rebucket_gives_the_same_manifest(fixtures: Path, tmp_path: Path) -> None:
    out = tmp_path / "m512"
    assert main(["rebucket", str(fixtures / "manifest"), "--out", str(out), "--resolution", "512"]) == 0
    want = _json(FIXTURES / "manifest-512" / "_manifest.json")
    got = _json(out / "_manifest.json")
    assert got["bucket_spec"] == want["bucket_spec"] and got["counts"] == want["counts"]
    if _same_writer(FIXTURES / "manifest-512"):
        assert got["fingerprint"] == want["fingerprint"]
        assert [p["sha256"] for p in got["parts"]["samples"]] == [p["sha256"] for p in want["parts"]["samples"]]
    assert _rows(out / "samples") == _rows(FIXTURES / "manifest-512" / "samples")


@pytest.mark.parametrize(
    "name, argv",
    [
        ("plan", ["{m}", "--cache", "{c}", "--world-size", "2", "--batch-size", "4", "--epochs", "2", "--seed", "0"]),
        ("mix-plan", ["{m}", "{m512}", "--repeats", "1,2", "--world-size", "2", "--batch-size", "2", "--epochs", "2",
                      "--seed", "3"]),
        ("packed-plan", ["{m}", "--cache", "{c}", "--max-tokens", "1024", "--leftover", "pad", "--world-size", "2",
                         "--epochs", "1"]),
    ],
)  # fmt: skip
def test_same_inputs_same_plan_bytes(fixtures: Path, tmp_path: Path, name: str, argv: list[str]) -> None:
    paths = {"m": fixtures / "manifest", "m512": fixtures / "manifest-512", "c": fixtures / "cache"}
    out = tmp_path / name
    assert main(["plan", *[a.format(**{k: str(v) for k, v in paths.items()}) for a in argv], "--out", str(out)]) == 0
    want, got = _json(FIXTURES / name / "_plan.json"), _json(out / "_plan.json")
    if _same_writer(FIXTURES / name):
        assert got["fingerprint"] == want["fingerprint"]
        assert [e["sha256"] for e in got["epochs"]] == [e["sha256"] for e in want["epochs"]]
    assert _rows(out) == _rows(FIXTURES / name)
    for key in ("inputs", "buckets", "counts", "steps_per_epoch"):
        assert got[key] == want[key], key


ROW_COLUMNS = ["sample_id", "filename", "width", "height", "caption", "bucket", "format", "orientation", "size"]


@pytest.mark.ray
def test_scan_of_the_same_dataset_gives_the_same_rows(tmp_path: Path, ray_local) -> None:
    """The demo's dataset (24 images, seed 0, its bucket options) scans to the fixture's rows (audit columns
    such as mtime aside)."""
    import polars as pl

    from pipeline.sample_data import make_sample_dataset

    make_sample_dataset(tmp_path / "dataset", n=24, seed=0)
    out = tmp_path / "manifest"
    assert main(["scan", str(tmp_path / "dataset"), "--out", str(out), "--no-progress", "--resolution", "256",
                 "--bucket-step", "32"]) == 0
    want = pl.read_parquet(FIXTURES / "manifest" / "samples" / "*.parquet").select(ROW_COLUMNS).sort("sample_id")
    got = pl.read_parquet(out / "samples" / "*.parquet").select(ROW_COLUMNS).sort("sample_id")
    assert got.equals(want)
    errors = pl.read_parquet(out / "errors" / "*.parquet").select("filename", "error").sort("filename")
    assert errors.equals(pl.read_parquet(FIXTURES / "manifest" / "errors" / "*.parquet")
                         .select("filename", "error").sort("filename"))  # fmt: skip
