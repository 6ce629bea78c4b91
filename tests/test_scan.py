"""The scan job on local folders with real Ray: ground truth, captions, incremental, kill and resume."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from manifests.buckets import BucketSpec
from manifests.manifest import ManifestError, read_manifest
from manifests.schema import sample_id
from pipeline.cli import main
from pipeline.scan import ScanConfig, scan_dataset
from tests.corpus import _pixels, _save, make_corpus

pytestmark = pytest.mark.ray
REPO = Path(__file__).resolve().parents[1]
QUIET = ScanConfig(progress=False, files_per_task=8)


def scan(src, out, **kw):
    return scan_dataset(str(src), str(out), spec=kw.pop("spec", BucketSpec()), config=kw.pop("config", QUIET), **kw)


def test_corpus_matches_ground_truth(tmp_path, ray_local, capsys):
    corpus = make_corpus(tmp_path / "ds")
    out = tmp_path / "m"
    assert main(["scan", str(corpus.root), "--out", str(out), "--no-progress", "--files-per-task", "8"]) == 0
    line = capsys.readouterr().out
    assert "scanned 41 images" in line and "files/s" in line
    m = read_manifest(str(out))
    samples = m.samples.to_pylist()
    errors = {r["filename"]: r for r in m.errors.to_pylist()}
    assert {r["filename"]: (r["width"], r["height"]) for r in samples} == corpus.sizes
    assert {k: r["error"] for k, r in errors.items()} == corpus.errors
    assert {r["filename"]: r["caption"] for r in samples} == corpus.captions
    for r in samples:
        assert r["sample_id"] == sample_id(r["filename"])
        assert r["bucket"] and r["size"] == (corpus.root / r["filename"]).stat().st_size
        assert r["mtime"] == pytest.approx((corpus.root / r["filename"]).stat().st_mtime)
        assert 0 < r["bytes_read"] <= max(r["size"], 64 * 1024) or r["filename"] == "jpeg/far_header.jpg"
    assert errors["bad/bomb.png"]["width"] == 60000 and errors["bad/bomb.png"]["bytes_read"] < 1000
    counts = m.meta["counts"]
    assert counts == {"listed": 41, "ignored": len(corpus.ignored), "samples": 35, "errors": 6}
    summary = m.meta["summary"]
    assert summary["files_read"] == 41 and summary["new"] == 41 and summary["reused"] == 0
    assert summary["errors_by_kind"] == {"empty": 1, "not_an_image": 2, "too_many_pixels": 1, "truncated": 2}
    assert "credential" not in str(m.meta).lower()


def test_incremental_rescan_reads_only_changed_files(tmp_path, ray_local):
    corpus = make_corpus(tmp_path / "ds")
    out = tmp_path / "m"
    first = scan(corpus.root, out)
    assert first["summary"]["files_read"] == 41

    (corpus.root / "orient/jpeg_o1.jpg").write_bytes(_save(_pixels(w=90, h=30), "JPEG"))  # changed
    (corpus.root / "new/added.png").parent.mkdir()
    (corpus.root / "new/added.png").write_bytes(_save(_pixels(w=20, h=60), "PNG"))  # new
    (corpus.root / "bmp/plain.bmp").unlink()  # deleted
    (corpus.root / "cap/crlf.txt").write_text("an edited caption")  # sidecar edited, image not
    meta = scan(corpus.root, out)
    s = meta["summary"]
    assert (s["files_read"], s["new"], s["changed"], s["deleted"], s["reused"]) == (2, 1, 1, 1, 39)
    m = read_manifest(str(out))
    rows = {r["filename"]: r for r in m.samples.to_pylist()}
    assert (rows["orient/jpeg_o1.jpg"]["width"], rows["orient/jpeg_o1.jpg"]["height"]) == (90, 30)
    assert rows["cap/crlf.jpg"]["caption"] == "an edited caption"
    assert "bmp/plain.bmp" not in rows and "new/added.png" in rows
    assert len(m.errors) == 6  # broken files were reused as error rows, not re-read

    clean = scan(corpus.root, tmp_path / "clean")
    assert clean["fingerprint"] == meta["fingerprint"]
    assert m.samples.equals(read_manifest(str(tmp_path / "clean")).samples)

    again = scan(corpus.root, out)  # nothing changed: nothing read, same manifest
    assert again["summary"]["files_read"] == 0 and again["fingerprint"] == meta["fingerprint"]


def test_previous_manifest_and_bucket_options(tmp_path, ray_local):
    corpus = make_corpus(tmp_path / "ds")
    scan(corpus.root, tmp_path / "a")
    meta = scan(corpus.root, tmp_path / "b", previous=str(tmp_path / "a"), spec=BucketSpec(area=512 * 512, min_side=30))
    assert meta["summary"]["files_read"] == 0 and meta["summary"]["reused"] == 41
    m = read_manifest(str(tmp_path / "b"))
    small = [r for r in m.errors.to_pylist() if r["error"] == "too_small"]
    assert small and all(min(r["width"], r["height"]) < 30 for r in small)
    assert m.samples.num_rows + m.errors.num_rows == 41


def test_caption_table_wins_over_sidecars(tmp_path, ray_local):
    corpus = make_corpus(tmp_path / "ds")
    table = tmp_path / "captions.jsonl"
    table.write_text('{"filename": "cap/bom.jpg", "caption": "from the table"}\n{"filename": "UPPER.JPEG", "caption": " x "}\n')
    scan(corpus.root, tmp_path / "m", captions=str(table))
    rows = {r["filename"]: r["caption"] for r in read_manifest(str(tmp_path / "m")).samples.to_pylist()}
    assert rows["cap/bom.jpg"] == "from the table" and rows["UPPER.JPEG"] == "x"
    assert rows["cap/crlf.jpg"] == "first line second line"  # not in the table: its sidecar


def test_user_errors_exit_2_and_commit_nothing(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["scan", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "cannot list" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("x")
    assert main(["scan", str(tmp_path / "empty"), "--out", str(out)]) == 2
    assert "no image files" in capsys.readouterr().err
    (tmp_path / "empty" / "one.jpg").write_bytes(_save(_pixels(), "JPEG"))
    assert main(["scan", str(tmp_path / "empty"), "--out", str(out), "--previous", str(tmp_path / "nope")]) == 2
    assert "_manifest.json" in capsys.readouterr().err
    assert not (out / "_manifest.json").exists()


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the scan and every process of its session (its in-process Ray)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == proc.pid:  # field 6 of /proc/PID/stat: the session id
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _start_slow_scan(src: Path, out: Path, log: Path) -> subprocess.Popen:
    """``python -m pipeline.scan`` in its own session, its Ray tasks sleeping 30 s; returns once they run."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own in-process Ray
    env["_BUCKETEER_TEST_TASK_DELAY_S"] = "30"
    cmd = [sys.executable, "-m", "pipeline.scan", str(src), "--out", str(out), "--files-per-task", "8", "--no-progress"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 60
    while "listed " not in log.read_text() and time.time() < deadline:
        assert proc.poll() is None, log.read_text()
        time.sleep(0.2)
    time.sleep(3)  # Ray is up and the tasks are sleeping mid-scan
    assert proc.poll() is None, log.read_text()
    return proc


@pytest.mark.slow
def test_kill_and_resume_equals_a_clean_run(tmp_path, ray_local):
    corpus = make_corpus(tmp_path / "ds")
    out = tmp_path / "m"
    before = scan(corpus.root, out)
    for i in range(40):  # a new batch of files, so the killed scan has real work in flight
        (corpus.root / f"more/{i:03d}.jpg").parent.mkdir(exist_ok=True)
        (corpus.root / f"more/{i:03d}.jpg").write_bytes(_save(_pixels(w=30 + i, h=20, seed=i), "JPEG"))
    proc = _start_slow_scan(corpus.root, out, tmp_path / "scan.log")
    _kill_session(proc)
    # a reader still sees the previous manifest, whole
    assert read_manifest(str(out)).fingerprint == before["fingerprint"]
    for part in before["parts"]["samples"]:
        assert pq.read_table(out / part["path"]).num_rows == part["rows"]

    resumed = scan(corpus.root, out)
    clean = scan(corpus.root, tmp_path / "clean")
    assert resumed["fingerprint"] == clean["fingerprint"]
    assert resumed["summary"]["files_read"] == 40 and resumed["counts"]["samples"] == clean["counts"]["samples"] == 75
    a, b = read_manifest(str(out)), read_manifest(str(tmp_path / "clean"))
    assert a.samples.equals(b.samples) and a.errors.equals(b.errors)


@pytest.mark.slow
def test_killed_first_scan_leaves_nothing_readable(tmp_path, ray_local):
    corpus = make_corpus(tmp_path / "ds")
    out = tmp_path / "m"
    _kill_session(_start_slow_scan(corpus.root, out, tmp_path / "scan.log"))
    with pytest.raises(ManifestError, match="never committed"):
        read_manifest(str(out))
    rerun = scan(corpus.root, out)
    assert rerun["fingerprint"] == scan(corpus.root, tmp_path / "clean")["fingerprint"]
