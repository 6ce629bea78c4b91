import argparse
import json
import re
import subprocess
import sys

import pytest

from manifests.buckets import BucketSpec
from manifests.manifest import read_manifest, write_manifest
from pipeline.cli import COMMANDS, main
from tests.factories import manifest_tables


def test_help_lists_every_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    assert "usage: bucketeer" in capsys.readouterr().out


def _command_help(text: str) -> dict[str, str]:
    """``bucketeer --help``'s commands section: command -> its one-line help (argparse wraps it: joined)."""
    section = text[text.index("  COMMAND\n") : text.index("\noptions:")]
    parts = re.split(r"^    (\w+) +", section, flags=re.MULTILINE)
    return {name: _unwrapped(body) for name, body in zip(parts[1::2], parts[2::2])}


def _unwrapped(text: str) -> str:
    """``text`` as one line: argparse's line breaks (also after a hyphen, "CLIP-\\nembed") undone."""
    return re.sub(r"-\s+", "-", " ".join(text.split()))


def test_help_says_what_each_command_does_now():
    from pipeline.annotate.tasks import TASKS
    from pipeline.cli import build_parser

    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "--help"], capture_output=True, text=True, check=True)
    lines = _command_help(done.stdout)
    assert list(lines) == list(COMMANDS)
    # annotate: every task it runs, by name or by what it does
    said = {"embedding": "CLIP-embed", "stats": "measure", "phash": "pHash"}
    for task in TASKS:
        assert said.get(task, task) in lines["annotate"], f"`bucketeer annotate` help does not say it does {task}"
    assert all(kind in lines["dedup"] for kind in ("exact", "perceptual", "semantic"))
    assert all(word in lines["scan"] for word in ("images", "videos", "tar", "parquet", "captions"))
    assert all(word in lines["embed"] for word in ("latents", "text embeddings", "DINOv2", "masks"))
    assert "--where" in lines["stats"] and "annotations" in lines["report"]
    # the demo's line names its stages in the order it runs them
    stages = ("scan", "annotate", "dedup", "embed", "plan", "train", "verify", "report")
    at = [lines["demo"].index(stage) for stage in stages]
    assert at == sorted(at) and "duplicates" in lines["demo"]
    # an option a command's help names is an option of that command
    parsers = dict(next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices)
    for name, line in lines.items():
        options = {s for a in parsers[name]._actions for s in a.option_strings}
        for option in re.findall(r"--[a-z][\w-]*", line):
            assert option in options, f"`bucketeer {name}` help names {option}, which it does not have"
    # `bucketeer COMMAND --help` starts with the same line
    for name in ("annotate", "demo"):
        text = subprocess.run([sys.executable, "-m", "pipeline.cli", name, "--help"], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
        assert COMMANDS[name][1] in _unwrapped(text)


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "--version"], capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.startswith("bucketeer ")


def test_stats_and_rebucket(tmp_path, capsys):
    url = str(tmp_path / "m")
    write_manifest(url, *manifest_tables(300), source="/d", spec=BucketSpec())
    assert main(["stats", url, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert sum(stats["buckets"].values()) == stats["counts"]["samples"] == 300
    assert stats["errors"] == {"truncated": 3}
    assert stats["captioned"] == 240

    new = str(tmp_path / "m512")
    assert main(["rebucket", url, "--out", new, "--resolution", "512", "--min-side", "600"]) == 0
    m = read_manifest(new)
    assert m.spec.area == 512 * 512 and m.spec.min_side == 600
    assert m.samples.num_rows + m.errors.num_rows == 303
    assert m.errors.num_rows > 3  # min side 600 rejected some, recorded as too_small
    assert set(m.errors.column("error").to_pylist()) == {"truncated", "too_small"}
    assert main(["stats", new]) == 0
    out = capsys.readouterr().out
    assert "too_small" in out and "buckets:" in out


def test_user_errors_are_one_line(tmp_path, capsys):
    assert main(["stats", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "no _manifest.json" in err and "Traceback" not in err
    assert main(["stats", str(tmp_path), "--storage-options", "[1]"]) == 2
    assert "JSON object" in capsys.readouterr().err
