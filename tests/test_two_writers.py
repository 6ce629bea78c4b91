"""Two jobs started on one output, as users start them: real processes. The second is refused at its start
with one line naming the first (exit 2) and deletes nothing; a writer killed with -9 leaves its lock,
which the next run takes over with a notice. The lock itself (manifests/lock.py) is tested on its own, on
local disk and S3, in tests/test_writer_lock.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from manifests.faults import FAULTS_ENV, pause_marker
from manifests.lock import LOCK_FILE
from manifests.manifest import read_manifest
from pipeline.cli import main
from tests.embed_data import make_dataset

ROOT = Path(__file__).resolve().parent.parent


def _paused_writer(*argv: str, seconds: float = 120) -> subprocess.Popen:
    """``bucketeer ARGV`` in a subprocess, paused for ``seconds`` right after it took its output's lock."""
    env = {**os.environ, FAULTS_ENV: f"lock.taken=pause:{seconds}", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)  # fmt: skip
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == pause_marker("lock.taken"):
            return proc
    raise AssertionError("the writer never took its lock:\n" + "".join(lines))


def test_a_second_rebucket_into_one_out_is_refused_and_deletes_nothing(tmp_path: Path, capsys) -> None:
    manifest, out = str(tmp_path / "m"), str(tmp_path / "out")
    make_dataset(str(tmp_path / "data"), manifest, n=6)
    assert main(["rebucket", manifest, "--out", out, "--resolution", "256"]) == 0
    parts_before = sorted(p.name for p in (tmp_path / "out").rglob("*.parquet"))
    first = _paused_writer("rebucket", manifest, "--out", out, "--resolution", "512", seconds=8)
    capsys.readouterr()
    assert main(["rebucket", manifest, "--out", out, "--resolution", "128"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is being written by `bucketeer rebucket` on host" in err[0], err
    assert f"pid {first.pid}" in err[0]
    assert sorted(p.name for p in (tmp_path / "out").rglob("*.parquet")) == parts_before
    read_manifest(out)  # the committed manifest still reads: every part it names is there
    assert first.wait(timeout=120) == 0, first.stdout.read()  # the first writer goes on after its pause
    assert read_manifest(out).spec.area == 512 * 512
    assert not (tmp_path / "out" / LOCK_FILE).exists()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.full
def test_a_second_embed_is_refused_and_a_killed_ones_lock_is_taken_over(tmp_path, bucketeer_home, capsys) -> None:
    manifest, cache = str(tmp_path / "m"), str(tmp_path / "cache")
    make_dataset(str(tmp_path / "data"), manifest, n=6)
    first = _paused_writer("embed", manifest, "--out", cache)
    capsys.readouterr()
    assert main(["embed", manifest, "--out", cache]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is being written by `bucketeer embed` on host" in err[0] and f"pid {first.pid}" in \
        err[0], err  # fmt: skip
    os.killpg(first.pid, signal.SIGKILL)  # kill -9: the lock stays behind
    first.wait()
    assert (tmp_path / "cache" / LOCK_FILE).exists()
    assert main(["embed", manifest, "--out", cache]) == 0
    out = capsys.readouterr().out
    assert f"took over the lock of {cache} from `bucketeer embed`" in out and f"pid {first.pid}" in out
    assert main(["verify", cache]) == 0
    assert not (tmp_path / "cache" / LOCK_FILE).exists()
