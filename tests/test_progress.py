"""Progress of long jobs: the reporter's arithmetic (injected clock), and plain lines off a terminal.

``assert_progress`` is also used by the embed and trainer tests, on runs they make anyway.
"""

from __future__ import annotations

import io
import re

import pytest

from manifests.progress import INTERVAL_ENV, Progress, format_duration, interval_seconds
from pipeline.cli import main

LINE = re.compile(
    r"^(?P<name>[\w -]+): (?P<done>[\d,]+)/(?P<total>[\d,]+) (?P<unit>\w+) \((?P<pct>\d+)%\), "
    r"(?P<rate>[\d,.]+) (?P=unit)/s, (?:ETA (?P<eta>\w+|\?)|done in (?P<took>\w+))(?:, (?P<extra>.+))?$"
)


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def assert_progress(err: str, name: str, unit: str, total: int) -> list[re.Match]:
    """``err`` holds plain progress lines of ``name`` ("JOB PHASE", interval 0): updates with a rate and an ETA,
    counts that only grow, and a final line at ``total`` of ``total``; and no carriage-return bar."""
    assert "\r" not in err, "a terminal bar written to a stream that is not a terminal"
    lines = [m for m in map(LINE.match, err.splitlines()) if m and m["name"] == name]
    assert len(lines) >= 2, f"no progress lines for {name!r} in:\n{err}"
    *updates, final = lines
    assert all(m["eta"] and not m["took"] for m in updates) and final["took"], [m[0] for m in lines]
    assert {m["unit"] for m in lines} == {unit} and {_int(m["total"]) for m in lines} == {total}
    counts = [_int(m["done"]) for m in lines]
    assert counts == sorted(counts) and counts[-1] == total and final["pct"] == "100"
    assert float(final["rate"].replace(",", "")) > 0
    return lines


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rate_eta_and_the_final_line_follow_the_clock():
    clock, out = Clock(), io.StringIO()
    progress = Progress("embed", "images", total=1000, unit="images", stream=out, interval=0, clock=clock)
    clock.now += 10
    progress.update(250, written="1.5 MB", errors=2)
    assert progress.rate() == 25.0 and progress.eta() == 30.0
    clock.now += 5
    progress.update(50, errors=3)  # extras keep their order and latest values
    clock.now += 45
    progress.update(700)
    progress.close()
    progress.update(5)  # after close: ignored
    assert out.getvalue().splitlines() == [
        "embed images: 250/1,000 images (25%), 25.0 images/s, ETA 30s, written 1.5 MB, errors 2",
        "embed images: 300/1,000 images (30%), 20.0 images/s, ETA 35s, written 1.5 MB, errors 3",
        "embed images: 1,000/1,000 images (100%), 16.7 images/s, ETA 0s, written 1.5 MB, errors 3",
        "embed images: 1,000/1,000 images (100%), 16.7 images/s, done in 1m00s, written 1.5 MB, errors 3",
    ]
    assert_progress(out.getvalue(), "embed images", "images", 1000)


def test_lines_come_every_interval_and_once_at_the_end():
    clock, out = Clock(), io.StringIO()
    progress = Progress("scan", "files", total=None, unit="files", stream=out, interval=30, clock=clock)
    for _ in range(29):
        clock.now += 1
        progress.update(100)
    assert out.getvalue() == ""  # 29 s: nothing yet
    clock.now += 1
    progress.update(100)
    clock.now += 29
    progress.update(100)
    assert out.getvalue() == "scan files: 3,000 files, 100 files/s, ETA ?\n"  # no total: no percentage, no ETA
    progress.close()
    assert out.getvalue().splitlines()[-1] == "scan files: 3,100 files, 52.5 files/s, done in 59s"

    failed = io.StringIO()
    with pytest.raises(RuntimeError), Progress("scan", "files", total=9, stream=failed, interval=60) as progress:
        progress.update(3)
        raise RuntimeError("a task failed")
    assert failed.getvalue() == ""  # a failed job never says "done"


def test_disabled_and_terminal_modes():
    out = io.StringIO()
    with Progress("verify", "records", total=3, stream=out, interval=0, enabled=False) as progress:
        progress.update(3)
    assert out.getvalue() == ""
    tty = Terminal()
    with Progress("train", "steps", total=4, unit="steps", stream=tty, interval=0) as progress:
        progress.update(4, loss="0.1234")
    bar = tty.getvalue()
    assert "\r" in bar and "train steps" in bar and "loss 0.1234" in bar and not LINE.match(bar.strip())


def test_interval_variable(monkeypatch):
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    assert interval_seconds() == 30
    monkeypatch.setenv(INTERVAL_ENV, "2.5")
    assert interval_seconds() == 2.5
    for bad in ("soon", "-1", "inf", "nan"):
        monkeypatch.setenv(INTERVAL_ENV, bad)
        with pytest.raises(ValueError, match=f"{INTERVAL_ENV}='{bad}': use seconds between progress lines"):
            Progress("plan", "epochs", total=1)
    assert [format_duration(s) for s in (0.4, 59, 61, 3599, 7500)] == ["0s", "59s", "1m01s", "59m59s", "2h05m"]


def test_plan_check_resume_verify_and_report_print_progress(tmp_path, monkeypatch, capsys):
    from manifests.buckets import BucketSpec
    from manifests.manifest import write_manifest
    from tests.test_cache_format import build_cache
    from tests.factories import manifest_tables

    monkeypatch.setenv(INTERVAL_ENV, "0")
    manifest, plan, resumed, cache = (str(tmp_path / n) for n in ("manifest", "plan", "resumed", "cache"))
    write_manifest(manifest, *manifest_tables(200, seed=3), source="/data", spec=BucketSpec(area=512 * 512))
    assert main(["plan", manifest, "--out", plan, "--world-size", "2", "--batch-size", "2", "--epochs", "3",
                 "--json"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    assert captured.out.startswith("{")  # stdout stays the result
    lines = assert_progress(captured.err, "plan epochs", "epochs", 3)
    assert all(re.fullmatch(r"written [\d.]+ MB", m["extra"]) for m in lines)

    assert main(["plan", "--check", plan, manifest]) == 0
    lines = assert_progress(capsys.readouterr().err, "plan --check epochs", "epochs", 3)
    assert lines[-1]["extra"] == "violations 0"
    assert main(["plan", "--resume", plan, "--at", "1:2", "--world-size", "1", "--out", resumed]) == 0
    assert_progress(capsys.readouterr().err, "plan --resume epochs", "epochs", 2)

    build_cache(cache, n=9, shard_records=4)
    assert main(["verify", cache]) == 0
    lines = assert_progress(capsys.readouterr().err, "verify records", "records", 9 + 3)  # samples + texts
    assert lines[-1]["extra"] == "shards 4, bad 0"

    assert main(["report", manifest, "--plan", plan, "--out", str(tmp_path / "r.html")]) == 0
    lines = assert_progress(capsys.readouterr().err, "report sections", "sections", 2)
    assert [m["extra"] for m in lines] == ["last manifest", "last plan", "last plan"]


@pytest.mark.ray
def test_scan_prints_progress_lines_off_a_terminal(tmp_path, ray_local, monkeypatch, capsys):
    from tests.corpus import make_corpus

    monkeypatch.setenv(INTERVAL_ENV, "0")
    corpus = make_corpus(tmp_path / "ds")
    assert main(["scan", str(corpus.root), "--out", str(tmp_path / "m"), "--files-per-task", "8"]) == 0
    captured = capsys.readouterr()
    assert "scanned 41 images" in captured.out
    lines = assert_progress(captured.err, "scan files", "files", 41)
    assert re.fullmatch(r"read [\d.]+ MB, errors \d+", lines[-1]["extra"])
    assert _int(lines[-1]["extra"].rsplit(" ", 1)[1]) == len(corpus.errors)
