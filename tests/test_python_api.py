"""The Python API as the documents show it: the ``<!-- test: python -->`` block of README.md runs exactly as
written (scan -> embed -> plan on a small folder, the manifest read with polars), in a fresh folder and a fresh
interpreter, as a user would paste it; so does the ``<!-- test: tables -->`` block of docs/artifacts.md (a
manifest's parquet parts read with DuckDB and polars). And ``pipeline.run`` refuses what is not a job."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import ROOT, documents

_PYTHON_BLOCK = re.compile(r"<!-- test: (\w+) -->\s*\n```python\n(.*?)```", re.DOTALL)


def readme_python(tag: str = "python") -> str:
    """The one Python block of README.md and docs/ tagged ``tag``."""
    blocks = [code for doc in documents() for found, code in _PYTHON_BLOCK.findall(doc.read_text()) if found == tag]
    assert len(blocks) == 1, f"README.md and docs/ have one Python block tagged <!-- test: {tag} -->"
    return blocks[0]


@pytest.mark.slow
@pytest.mark.ray
def test_the_readme_python_example_runs_as_written(tmp_path: Path, bucketeer_home) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BUCKETEER_HOME": bucketeer_home}
    done = subprocess.run([sys.executable, "-c", readme_python()], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # what the example prints: the scan's figures, the plan's steps, the bucket histogram from polars
    assert re.search(r"^40 samples, 3 errors -> my-manifest \(fingerprint [0-9a-f]{12}\)$", done.stdout, re.M)
    assert re.search(r"^\d+ steps per epoch on 2 ranks, \d+ samples planned$", done.stdout, re.M)
    assert "bucket" in done.stdout and "256x256" in done.stdout
    for folder in ("my-manifest/_manifest.json", "my-cache/_cache.json", "my-plan/_plan.json"):
        assert (tmp_path / folder).exists()


def test_the_readme_reads_a_manifest_with_duckdb_and_polars_as_written(tmp_path: Path) -> None:
    from manifests.buckets import BucketSpec
    from manifests.manifest import write_manifest
    from tests.factories import manifest_tables

    spec = BucketSpec(area=256 * 256, step=32)
    samples, errors = manifest_tables(40, spec=spec)
    write_manifest(str(tmp_path / "my-manifest"), samples, errors, source="my-images", spec=spec, rows_per_part=16)
    done = subprocess.run([sys.executable, "-c", readme_python("tables")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for row in samples.group_by("bucket").aggregate([("sample_id", "count")]).to_pylist():  # 3 parts, one table
        assert re.search(rf"│ {row['bucket']}\s*│\s*{row['sample_id_count']}\s*│", done.stdout), done.stdout
    assert re.search(rf"truncated\s*│\s*{sum(e == 'truncated' for e in errors.column('error').to_pylist())}\s*│",
                     done.stdout), done.stdout  # fmt: skip
    missing = samples.column("caption").null_count
    assert f"{missing} images without a caption, e.g. ['" in done.stdout


def test_run_takes_only_jobs() -> None:
    import pipeline

    with pytest.raises(TypeError, match="run\\(\\) takes a bucketeer job"):
        pipeline.run({"source": "x"})
    assert {"ScanJob", "EmbedJob", "PlanJob", "VerifyJob", "ReportJob", "DemoJob"} <= set(pipeline.__all__)
    with pytest.raises(AttributeError):
        pipeline.NoSuchJob  # noqa: B018
