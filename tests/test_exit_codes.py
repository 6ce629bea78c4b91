"""Exit codes of ``bucketeer``, ``python -m pipeline.<job>`` and ``python -m train``: an error the user
must act on is one line and exit 2; any other exception is a bug and keeps its traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from manifests.errors import BucketeerError, MissingError, StorageError, UsageError
from pipeline.cli import main

ROOT = Path(__file__).resolve().parents[1]
SECRET = "exit-code-secret-value"


def one_error_line(err: str, prefix: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    assert "Traceback" not in err and SECRET not in err
    return lines[0]


def python(code: str, *, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)  # fmt: skip


@pytest.mark.parametrize(
    "error",
    [UsageError("--batch-size must be >= 1"), MissingError("s3://b/m has no _manifest.json: run `bucketeer scan`"),
     StorageError(f"reading s3://b/m/_manifest.json: PermissionError: Access Denied (secret={SECRET})")],
    ids=["usage", "missing", "storage"],
)  # fmt: skip
def test_a_user_error_is_one_redacted_line_and_exit_2(error, monkeypatch, capsys):
    import pipeline.stats

    def run(args):
        raise error

    monkeypatch.setattr(pipeline.stats, "run", run)
    assert main(["stats", "anything"]) == 2
    line = one_error_line(capsys.readouterr().err, "bucketeer stats: error: ")
    assert line.removeprefix("bucketeer stats: error: ").startswith(str(error).split(SECRET)[0])  # redacted


def test_a_user_error_raised_in_a_ray_task_is_the_tasks_own_line(monkeypatch, capsys):
    from ray.exceptions import RayTaskError

    import pipeline.stats

    cause = StorageError("reading s3://b/ds/img.jpg: PermissionError: Access Denied")
    wrapped = RayTaskError("scan_batch", "Traceback (most recent call last):\n  ...\nStorageError: ...", cause)

    def run(args):
        raise wrapped.as_instanceof_cause()

    monkeypatch.setattr(pipeline.stats, "run", run)
    assert main(["stats", "anything"]) == 2
    assert one_error_line(capsys.readouterr().err, "bucketeer stats: error: ").endswith(str(cause))


def test_a_bug_is_not_caught(monkeypatch):
    import pipeline.stats

    def run(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(pipeline.stats, "run", run)
    with pytest.raises(ZeroDivisionError):
        main(["stats", "anything"])
    monkeypatch.setattr(pipeline.stats, "run", lambda args: int("not a number"))  # a ValueError, not a user error
    with pytest.raises(ValueError) as e:
        main(["stats", "anything"])
    assert not isinstance(e.value, BucketeerError)


def test_python_m_job_exit_codes(tmp_path):
    """``python -m pipeline.stats``: exit 2 and one line for a missing manifest; exit 1 and the
    traceback when the code under it fails (a bug injected into the manifest reader; injected
    before any parquet is read: such a process can also abort at exit, a pyarrow/polars teardown
    race that has nothing to do with errors)."""
    done = subprocess.run([sys.executable, "-m", "pipeline.stats", str(tmp_path / "nothing")], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert "has no _manifest.json" in one_error_line(done.stderr, "bucketeer stats: error: ")

    bug = python("""
        import runpy, sys
        import manifests.manifest

        def read_manifest(url, storage_options=None):
            raise ZeroDivisionError("an injected bug")

        manifests.manifest.read_manifest = read_manifest
        sys.argv = ["pipeline.stats", "some-manifest"]
        runpy.run_module("pipeline.stats", run_name="__main__")
    """)
    assert bug.returncode == 1
    assert "Traceback" in bug.stderr and "ZeroDivisionError: an injected bug" in bug.stderr
    assert "bucketeer stats: error:" not in bug.stderr


def test_the_trainer_exit_codes(tmp_path, capsys):
    """``python -m train``: a missing --config is one line and exit 2; a bug keeps its traceback
    and exits 1 (through the ``__main__`` block, which leaves with ``os._exit``)."""
    from train.__main__ import main as train_main

    missing = tmp_path / "none.yaml"
    assert train_main(["--plan", "p", "--cache", "c", "--config", str(missing)]) == 2
    assert str(missing) in one_error_line(capsys.readouterr().err, "error: --config ")

    bug = python("""
        import runpy, sys

        sys.modules["torch"] = None  # the first import of train() fails: ImportError, not a user error
        sys.argv = ["train", "--plan", "p", "--cache", "c"]
        runpy.run_module("train", run_name="__main__", alter_sys=True)
    """)
    assert bug.returncode == 1, bug.stderr[-2000:]
    assert "Traceback" in bug.stderr and "ModuleNotFoundError: import of torch halted" in bug.stderr
