"""The scan job on local folders with real Ray: ground truth, captions, incremental, kill and resume."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem

from manifests.buckets import BucketSpec
from manifests.manifest import ManifestError, read_manifest
from manifests.schema import sample_id
from pipeline.sources.captions import load_caption_table
from pipeline.cli import main
from pipeline import ScanJob, run
from pipeline.scan import ScanConfig
from manifests.faults import FAULTS_ENV
from tests.corpus import _pixels, _save, make_corpus

pytestmark = pytest.mark.ray
REPO = Path(__file__).resolve().parents[1]
QUIET = ScanConfig(progress=False, files_per_task=8)


def scan(src, out, **kw):
    """``_manifest.json`` of a quiet scan of ``src`` into ``out``."""
    return run(ScanJob(source=str(src), out=str(out), config=kw.pop("config", QUIET), **kw)).meta


class CountingLocalFS(LocalFileSystem):
    """The local filesystem, recording every file read (root-relative). Passed as ``fs=`` to a
    rescan that has no image to probe, so every read happens in this process (no Ray task)."""

    cachable = False

    def __init__(self, root: Path):
        super().__init__()
        self.prefix, self.reads = f"{root}/", []

    def cat_file(self, path, start=None, end=None, **kwargs):
        self.reads.append(str(path).removeprefix(self.prefix))
        return super().cat_file(path, start=start, end=end, **kwargs)


def rows_of(out) -> dict[str, dict]:
    m = read_manifest(str(out))
    return {r["filename"]: r for r in m.samples.to_pylist() + m.errors.to_pylist()}


def assert_same_manifest(a, b) -> None:
    ma, mb = read_manifest(str(a)), read_manifest(str(b))
    assert ma.samples.equals(mb.samples) and ma.errors.equals(mb.errors)


def test_corpus_matches_ground_truth(tmp_path, ray_local, capsys):
    corpus = make_corpus(tmp_path / "ds")
    out = tmp_path / "m"
    result = run(ScanJob(source=str(corpus.root), out=str(out), config=QUIET))
    captured = capsys.readouterr()
    line = captured.out
    assert "scanned 41 images" in line and "files/s" in line
    assert "scan files:" not in captured.err  # --no-progress: not even the final progress line
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
    counts = m.meta.counts
    assert result.meta == m.meta and result.fingerprint == m.fingerprint and result.url == str(out)
    assert (result.listed, result.samples, result.errors, result.ignored) == (41, 35, 6, len(corpus.ignored))
    assert counts.to_json() == {"listed": 41, "ignored": len(corpus.ignored), "samples": 35, "errors": 6}
    summary = m.meta.summary
    assert summary.files_read == 41 and summary.new == 41 and summary.reused == 0
    assert summary.errors_by_kind == {"empty": 1, "not_an_image": 2, "too_many_pixels": 1, "truncated": 2}
    assert "credential" not in str(m.meta).lower()


def test_incremental_rescan_reads_only_changed_files(tmp_path, ray_local):
    corpus = make_corpus(tmp_path / "ds")
    out = tmp_path / "m"
    first = scan(corpus.root, out)
    assert first.summary.files_read == 41

    (corpus.root / "orient/jpeg_o1.jpg").write_bytes(_save(_pixels(w=90, h=30), "JPEG"))  # changed
    (corpus.root / "new/added.png").parent.mkdir()
    (corpus.root / "new/added.png").write_bytes(_save(_pixels(w=20, h=60), "PNG"))  # new
    (corpus.root / "bmp/plain.bmp").unlink()  # deleted
    (corpus.root / "cap/crlf.txt").write_text("an edited caption")  # sidecar edited, image not
    meta = scan(corpus.root, out)
    s = meta.summary
    assert (s.files_read, s.new, s.changed, s.deleted, s.reused) == (2, 1, 1, 1, 39)
    m = read_manifest(str(out))
    rows = {r["filename"]: r for r in m.samples.to_pylist()}
    assert (rows["orient/jpeg_o1.jpg"]["width"], rows["orient/jpeg_o1.jpg"]["height"]) == (90, 30)
    assert rows["cap/crlf.jpg"]["caption"] == "an edited caption"
    assert "bmp/plain.bmp" not in rows and "new/added.png" in rows
    assert len(m.errors) == 6  # broken files were reused as error rows, not re-read

    clean = scan(corpus.root, tmp_path / "clean")
    assert clean.fingerprint == meta.fingerprint
    assert m.samples.equals(read_manifest(str(tmp_path / "clean")).samples)

    again = scan(corpus.root, out)  # nothing changed: nothing read, same manifest
    assert again.summary.files_read == 0 and again.fingerprint == meta.fingerprint


def test_previous_manifest_and_bucket_options(tmp_path, ray_local):
    corpus = make_corpus(tmp_path / "ds")
    scan(corpus.root, tmp_path / "a")
    meta = scan(corpus.root, tmp_path / "b", previous=str(tmp_path / "a"), spec=BucketSpec(area=512 * 512, min_side=30))
    assert meta.summary.files_read == 0 and meta.summary.reused == 41
    m = read_manifest(str(tmp_path / "b"))
    small = [r for r in m.errors.to_pylist() if r["error"] == "too_small"]
    assert small and all(min(r["width"], r["height"]) < 30 for r in small)
    assert m.samples.num_rows + m.errors.num_rows == 41


def test_caption_table_wins_over_sidecars(tmp_path, ray_local):
    corpus = make_corpus(tmp_path / "ds")
    table = tmp_path / "captions.jsonl"
    table.write_text('{"filename": "cap/bom.jpg", "caption": "from the table"}\n'
                     '{"filename": "UPPER.JPEG", "caption": " x "}\n')
    scan(corpus.root, tmp_path / "m", captions=str(table))
    rows = {r["filename"]: r["caption"] for r in read_manifest(str(tmp_path / "m")).samples.to_pylist()}
    assert rows["cap/bom.jpg"] == "from the table" and rows["UPPER.JPEG"] == "x"
    assert rows["cap/crlf.jpg"] == "first line second line"  # not in the table: its sidecar


def test_rescan_rereads_exactly_the_sidecars_that_changed(tmp_path, ray_local):
    corpus = make_corpus(tmp_path / "ds")
    root, out = corpus.root, tmp_path / "m"
    scan(root, out)
    before = (root / "cap/crlf.txt").stat()
    (root / "cap/crlf.txt").write_bytes(b"x" * before.st_size)  # same size ...
    os.utime(root / "cap/crlf.txt", (before.st_atime - 86400, before.st_mtime - 86400))  # ... OLDER mtime
    (root / "cap/bom.txt").unlink()  # deleted
    (root / "cap/missing.caption").write_bytes(b"now captioned")  # added to an image that had none
    (root / "cap/other.txt").write_bytes(b"the txt wins")  # next to cap/other.caption
    fs = CountingLocalFS(root)
    meta = scan(root, out, fs=fs)
    # unchanged sidecars (trailing, latin1, blank, unicode, other.caption) are not read
    assert sorted(fs.reads) == ["cap/crlf.txt", "cap/missing.caption", "cap/other.txt"]
    assert (meta.summary.captions_read, meta.summary.files_read, meta.summary.reused) == (3, 0, 41)
    rows = rows_of(out)
    crlf = (root / "cap/crlf.txt").stat()
    assert rows["cap/crlf.jpg"]["caption"] == "x" * before.st_size
    assert rows["cap/crlf.jpg"]["caption_source"] == f"sidecar:{crlf.st_size}:{crlf.st_mtime!r}:cap/crlf.txt"
    assert rows["cap/bom.jpg"]["caption"] is None and rows["cap/bom.jpg"]["caption_source"] is None
    assert rows["cap/missing.jpg"]["caption"] == "now captioned"
    assert rows["cap/other.jpg"]["caption"] == "the txt wins"
    blank = rows["cap/blank.jpg"]
    assert blank["caption"] is None and blank["caption_source"].endswith(":cap/blank.txt")
    scan(root, tmp_path / "clean")
    assert_same_manifest(out, tmp_path / "clean")

    fs = CountingLocalFS(root)
    again = scan(root, out, fs=fs)
    assert fs.reads == [] and again.summary.captions_read == 0 and again.fingerprint == meta.fingerprint


def test_caption_table_edit_applies_to_all_its_rows_without_reads(tmp_path, ray_local):
    corpus = make_corpus(tmp_path / "ds")
    root, out, table = corpus.root, tmp_path / "m", tmp_path / "captions.jsonl"
    lines = {"cap/bom.jpg": "bom v1", "UPPER.JPEG": "upper", "cap/crlf.jpg": "crlf from the table"}
    table.write_text("".join(f'{{"filename": "{k}", "caption": "{v}"}}\n' for k, v in lines.items()))
    scan(root, out, captions=str(table))
    del lines["cap/crlf.jpg"]  # falls back to its sidecar
    lines["cap/bom.jpg"] = "bom v2"
    table.write_text("".join(f'{{"filename": "{k}", "caption": "{v}"}}\n' for k, v in lines.items()))
    fs = CountingLocalFS(root)
    scan(root, out, captions=str(table), fs=fs)
    assert fs.reads == ["cap/crlf.txt"]  # the table itself is read whole, outside the dataset
    rows = rows_of(out)
    captions = [rows[n]["caption"] for n in ("cap/bom.jpg", "UPPER.JPEG", "cap/crlf.jpg")]
    assert captions == ["bom v2", "upper", "first line second line"]
    # every table row records the new table version, the unchanged one included
    version = load_caption_table(str(table)).version
    assert rows["cap/bom.jpg"]["caption_source"] == rows["UPPER.JPEG"]["caption_source"] == f"table:{version}"
    assert rows["cap/crlf.jpg"]["caption_source"].startswith("sidecar:")
    scan(root, tmp_path / "clean", captions=str(table))
    assert_same_manifest(out, tmp_path / "clean")

    fs = CountingLocalFS(root)  # without the table: its rows fall back to their sidecars, or none
    scan(root, out, fs=fs)
    assert fs.reads == ["cap/bom.txt"]
    rows = rows_of(out)
    upper = rows["UPPER.JPEG"]
    assert (rows["cap/bom.jpg"]["caption"], upper["caption"], upper["caption_source"]) == ("a red fox", None, None)


def test_manifest_without_caption_source_rereads_sidecars_once(tmp_path, ray_local):
    corpus = make_corpus(tmp_path / "ds")
    out = tmp_path / "m"
    meta = scan(corpus.root, out)
    for part in meta.parts.samples + meta.parts.errors:  # as written before the column existed
        pq.write_table(pq.read_table(out / part.path).drop_columns(["caption_source"]), out / part.path)
    assert read_manifest(str(out)).samples.column("caption_source").null_count == 35
    fs = CountingLocalFS(corpus.root)
    again = scan(corpus.root, out, fs=fs)
    sidecars = [f"cap/{n}" for n in os.listdir(corpus.root / "cap") if n.endswith((".txt", ".caption"))]
    assert sorted(fs.reads) == sorted(sidecars)
    assert again.summary.files_read == 0 and again.fingerprint == meta.fingerprint
    fs = CountingLocalFS(corpus.root)
    scan(corpus.root, out, fs=fs)
    assert fs.reads == []


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
    """SIGKILL the scan and every process of its session (its in-process Ray), if still there."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
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


def _start_scan(src: Path, out: Path, log: Path, fault: str) -> subprocess.Popen:
    """``python -m pipeline.scan`` in its own session with its own in-process Ray, its tasks
    given ``fault`` (an action of :mod:`manifests.faults` at the ``scan.task`` point)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env[FAULTS_ENV] = f"scan.task={fault}"
    cmd = [sys.executable, "-m", "pipeline.scan", str(src), "--out", str(out), "--files-per-task", "8", "--no-progress"]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _start_slow_scan(src: Path, out: Path, log: Path) -> subprocess.Popen:
    """A scan whose Ray tasks sleep 30 s after their reads; returns once they run."""
    proc = _start_scan(src, out, log, "sleep:30")
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
    assert read_manifest(str(out)).fingerprint == before.fingerprint
    for part in before.parts.samples:
        assert pq.read_table(out / part.path).num_rows == part.rows

    resumed = scan(corpus.root, out)
    clean = scan(corpus.root, tmp_path / "clean")
    assert resumed.fingerprint == clean.fingerprint
    assert resumed.summary.files_read == 40 and resumed.counts.samples == clean.counts.samples == 75
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
    assert rerun.fingerprint == scan(corpus.root, tmp_path / "clean").fingerprint


@pytest.mark.slow
def test_worker_lost_mid_task_is_retried_and_equals_a_clean_run(tmp_path, ray_local):
    corpus = make_corpus(tmp_path / "ds")
    out, marker, log = tmp_path / "m", tmp_path / "worker-died", tmp_path / "scan.log"
    # the first task attempt to finish its reads ends its worker process; Ray retries the task
    proc = _start_scan(corpus.root, out, log, f"exit-once:{marker}")
    try:
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        _kill_session(proc)  # whatever its Ray left behind
    assert marker.exists() and int(marker.read_text()) > 0  # a worker did die mid-task
    assert "scanned 41 images" in log.read_text()
    scan(corpus.root, tmp_path / "clean")
    assert read_manifest(str(out)).fingerprint == read_manifest(str(tmp_path / "clean")).fingerprint
    assert_same_manifest(out, tmp_path / "clean")
