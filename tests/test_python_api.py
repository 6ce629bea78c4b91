"""The Python API as the README shows it: the ``<!-- test: python -->`` block of README.md runs exactly as
written (scan -> embed -> plan on a small folder, the manifest read with polars), in a fresh folder and a fresh
interpreter, as a user would paste it. And ``pipeline.run`` refuses what is not a job."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import README, ROOT

_PYTHON_BLOCK = re.compile(r"<!-- test: python -->\s*\n```python\n(.*?)```", re.DOTALL)


def readme_python() -> str:
    blocks = _PYTHON_BLOCK.findall(README.read_text())
    assert len(blocks) == 1, "README.md has one Python API example, tagged <!-- test: python -->"
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


def test_run_takes_only_jobs() -> None:
    import pipeline

    with pytest.raises(TypeError, match="run\\(\\) takes a bucketeer job"):
        pipeline.run({"source": "x"})
    assert {"ScanJob", "EmbedJob", "PlanJob", "VerifyJob", "ReportJob", "DemoJob"} <= set(pipeline.__all__)
    with pytest.raises(AttributeError):
        pipeline.NoSuchJob  # noqa: B018
