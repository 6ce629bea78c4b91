"""The code stays within its own rules: lines <= 120 characters and pyflakes-clean (``ruff check``).

The rule set lives in ``pyproject.toml`` ([tool.ruff], [tool.ruff.lint]) so that an editor's ruff and
this test agree; this test runs it on every Python folder of the project (~1 s).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("manifests", "pipeline", "train", "tests", "benchmarks")
CONFIG = ROOT / "pyproject.toml"


def ruff_check(*paths: str | Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(CONFIG), *map(str, paths)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_rules_are_line_length_and_pyflakes():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    ruff = tomllib.loads(CONFIG.read_text())["tool"]["ruff"]
    assert ruff["line-length"] == 120
    assert {"E501", "F"} <= set(ruff["lint"]["select"])


def test_ruff_finds_nothing():
    done = ruff_check(*FOLDERS)
    assert done.returncode == 0, f"ruff check {' '.join(FOLDERS)}:\n{done.stdout}{done.stderr}"


def test_ruff_would_find_a_long_line_and_an_unused_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\nx = '" + "a" * 120 + "'\n")
    done = ruff_check(bad)
    assert done.returncode == 1
    assert "E501" in done.stdout and "F401" in done.stdout


HOUSE_CHECK = ROOT.parent / "shared" / "tools" / "house_check.py"


@pytest.mark.skipif(not HOUSE_CHECK.exists(), reason="../shared/tools/house_check.py is beside CI's clone only")
def test_the_house_check_finds_no_structure_problem():
    """No import cycle (lazy imports count), no file over 450 lines or function over 100 in manifests/,
    pipeline/, train/, no `cfg: Any`, and the plan's inputs read in one parser only."""
    done = subprocess.run([sys.executable, str(HOUSE_CHECK), str(ROOT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1].startswith("ok:"), done.stdout
