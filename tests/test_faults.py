"""The test-only fault points: one variable, parsed once, clear errors, and what each action does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from manifests import faults
from manifests.faults import FAULTS_ENV, Fault, parse_faults, pause_marker

REPO = Path(__file__).resolve().parents[1]


def test_a_spec_names_points_and_actions():
    assert parse_faults("") == {} and parse_faults(" ; ") == {}
    assert parse_faults("scan.task=exit-once:/tmp/x; train.checkpoint=pause:300;") == {
        "scan.task": Fault("exit-once", "/tmp/x"),
        "train.checkpoint": Fault("pause", "300"),
    }
    assert parse_faults("cache.samples_committed=sleep:0.5")["cache.samples_committed"].seconds() == 0.5


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("scan.tasks=sleep:1", "unknown fault point 'scan.tasks'"),
        ("scan.task", "unknown fault point 'scan.task'"),  # no "="
        ("scan.task=crash:1", "'crash:1' is not ACTION:ARG"),
        ("scan.task=sleep", "'sleep' is not ACTION:ARG"),
        ("scan.task=pause:soon", "'soon' is not a number of seconds"),
        ("scan.task=sleep:-1", "'-1' is not a number of seconds >= 0"),
        ("scan.task=sleep:1;scan.task=sleep:2", "point 'scan.task' is given twice"),
    ],
)
def test_a_bad_spec_is_a_clear_error_naming_the_variable(spec, problem):
    with pytest.raises(ValueError) as e:
        parse_faults(spec)
    message = str(e.value)
    assert message.startswith(f"{FAULTS_ENV}={spec!r}: entry ") and problem in message
    assert "train.checkpoint" in message and "exit-once:PATH" in message  # says what is allowed


def test_hits_are_parsed_once_and_a_noop_without_the_variable(monkeypatch):
    monkeypatch.setattr(faults, "_faults", None)
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    faults.hit("scan.task")
    assert faults._faults == {}
    monkeypatch.setenv(FAULTS_ENV, "nonsense")  # read once per process: too late now
    faults.hit("scan.task")
    monkeypatch.setattr(faults, "_faults", None)
    with pytest.raises(ValueError, match=FAULTS_ENV):
        faults.hit("scan.task")


def test_pause_prints_its_marker_once_and_a_sigterm_ends_it(monkeypatch, capsys):
    monkeypatch.setattr(faults, "_faults", {"train.checkpoint": Fault("pause", "60")})
    monkeypatch.setattr(faults, "_paused", set())
    seen: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        started = time.monotonic()
        faults.hit("train.checkpoint")
        assert time.monotonic() - started < 10 and seen == [signal.SIGTERM]  # the own handler still ran
        faults.hit("train.checkpoint")  # once per process: no second pause
        assert capsys.readouterr().out == pause_marker("train.checkpoint") + "\n"
    finally:
        signal.signal(signal.SIGTERM, before)


def test_exit_once_ends_only_the_first_process(tmp_path):
    marker = tmp_path / "died"
    env = {**os.environ, FAULTS_ENV: f"scan.task=exit-once:{marker}"}
    code = "from manifests import faults; faults.hit('scan.task'); print('survived')"
    first = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    second = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert first.returncode == 1 and first.stdout == "" and int(marker.read_text()) > 0
    assert second.returncode == 0 and second.stdout == "survived\n"
