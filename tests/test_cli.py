import json
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
