"""The published benchmark tables are generated from benchmarks/results/*.json, and the method they follow holds.

Every ``<!-- results: NAME -->`` block in benchmarks/README.md and docs/benchmarks.md must equal what
``python -m benchmarks.results --write`` makes of results/NAME.json: no hand-copied figure.
"""

import json

import pytest

from benchmarks import results


def test_every_published_table_equals_its_results_file():
    for doc in results.DOCUMENTS:
        text = doc.read_text()
        for name, body in results.blocks(text):
            assert (results.RESULTS / f"{name}.json").exists(), f"{doc.name}: no results/{name}.json for its table"
            assert body == results.render(name), (
                f"{doc.name}: the table of {name} differs from results/{name}.json: "
                "run `python -m benchmarks.results --write`")


def test_a_figure_is_the_median_of_its_rounds_and_a_target_holds_only_in_every_round(tmp_path, monkeypatch):
    loads = iter([0.5, 0.7, 0.6, 3.4, 0.4, 0.5])
    monkeypatch.setattr(results.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    run = results.Run("t", command="python t.py")
    for value, rate in ((1.3, 900.0), (1.1, 1000.0), (1.25, 950.0)):
        with run.round():
            run.add("ours / peer", value, unit="x", target=">= 1.2")
            run.add("ours", rate, unit="samples/s")
    doc = json.loads(run.save(tmp_path).read_text())
    ratio, rate = doc["rows"]
    assert (ratio["median"], ratio["min"], ratio["max"]) == (1.25, 1.1, 1.3)
    assert ratio["met"] is False  # the median meets 1.2, the second round does not
    assert rate["median"] == 950.0 and rate["met"] is None
    assert ratio["max_load"] == 3.4 and doc["rounds"][0] == {"load_before": 0.5, "load_after": 0.7}
    table = results.render("t", tmp_path)
    assert "| ours / peer | 1.25x (load 3.4) | 1.10x - 1.30x | >= 1.2 | **no** |" in table
    assert "not a quiet machine" in table
    text = "a\n<!-- results: t -->\nold figure\n<!-- /results -->\nb\n"
    assert results.regenerate(text, tmp_path) == f"a\n<!-- results: t -->\n{table}<!-- /results -->\nb\n"


def test_add_outside_a_round_and_a_malformed_target_are_refused():
    run = results.Run("t", command="x")
    with pytest.raises(RuntimeError, match="inside"):
        run.add("m", 1.0)
    with run.round():
        with pytest.raises(ValueError, match="'>= X'"):
            run.add("m", 1.0, target="at least 1")


def test_make_bench_runs_the_command_of_every_published_table_as_recorded():
    """``make bench`` re-runs what the tables show: each results block's recorded command, once, of a script
    that exists, every argument surviving the shell (an empty value quoted, not lost)."""
    import shlex
    from pathlib import Path

    root = Path(results.__file__).resolve().parents[1]
    published = [name for doc in results.DOCUMENTS for name, _ in results.blocks(doc.read_text())]
    recorded = {json.loads((results.RESULTS / f"{n}.json").read_text())["command"] for n in published}
    got = results.commands()
    assert sorted(got) == sorted(recorded) and len(got) == len(set(got))
    for command in got:
        argv = shlex.split(command)
        assert argv[0] == "python" and (root / argv[1]).is_file(), command
        assert shlex.join(argv) == command, f"not what the shell would run as shown: {command}"
    bench = (root / "Makefile").read_text().split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert "benchmarks.results --commands" in bench and "benchmarks.results --write" in bench
