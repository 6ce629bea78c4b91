"""The trainer's ``--output-dir`` is checked before any model loads: a folder it may not write, a path under a
file, or a bucket that is not there stop ``python -m train`` with one line and exit 2 (not TensorBoard's
traceback after the model loaded). The plan and cache are the v0.2 fixtures (tests/fixtures/v0_2)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train_dataset import train_cli

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "v0_2"


def _one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_an_output_dir_under_a_file_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    code = train_cli("--plan", FIXTURES / "plan", "--cache", FIXTURES / "cache", "--output-dir",
                     tmp_path / "notes.txt" / "run")  # fmt: skip
    assert code == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"error: --output-dir {tmp_path / 'notes.txt' / 'run'}: cannot write there")


def test_a_folder_this_user_may_not_write_is_one_line_before_any_model_loads(tmp_path: Path) -> None:
    """A folder without write permission. Root writes anywhere, so as root (CI's user here) the trainer runs
    without the capability that lets it (setpriv drops CAP_DAC_OVERRIDE): permission denied, as for a user."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    drop = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("root without setpriv (util-linux): no way to be denied a write")
        caps = "-dac_override,-dac_read_search"
        drop = ["setpriv", "--bounding-set", caps, "--inh-caps", caps, "--"]
    argv = [*drop, sys.executable, "-m", "train", "--plan", str(FIXTURES / "plan"), "--cache",
            str(FIXTURES / "cache"), "--output-dir", str(locked / "run")]  # fmt: skip
    done = subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    locked.chmod(0o755)
    assert done.returncode == 2, done.stdout + done.stderr
    line = _one_line(done.stderr)
    assert line.startswith(f"error: --output-dir {locked / 'run'}: cannot write there (Permission denied)")
    assert not (locked / "run").exists()


@pytest.mark.s3
def test_a_bucket_that_is_not_there_is_one_line(s3, tmp_path: Path, monkeypatch, capsys) -> None:
    import json

    monkeypatch.setenv("BUCKETEER_SCRATCH", str(tmp_path / "scratch"))
    code = train_cli("--plan", FIXTURES / "plan", "--cache", FIXTURES / "cache", "--output-dir",
                     "s3://no-such-bucket-here/run", "--storage-options", json.dumps(s3.storage_options))  # fmt: skip
    assert code == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: --output-dir s3://no-such-bucket-here/run: cannot write there")
