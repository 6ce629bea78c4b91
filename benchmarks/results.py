"""One method for every published benchmark figure: rounds, load and versions in a JSON file; tables made from it.

A benchmark records each measure's value **per round** (the tools interleaved within a round), with the machine's
1-minute load before and after every round and the version of every tool it compares, and writes
``benchmarks/results/<name>.json``::

    run = Run("loader", command="python benchmarks/loader.py --rounds 3", tools=["litdata", "mosaicml-streaming"])
    for r in range(3):
        with run.round():
            ...                                    # measure every tool once
            run.add("local: ours / litdata", ours / theirs, unit="x", target=">= 1.2")
    run.save()

A figure is the **median** of its rounds, shown with its min and max; a target is met only when **every** round
meets it; a figure whose rounds saw a 1-minute load above :data:`QUIET_LOAD` is marked ``(load L)``: on this
2-core machine another process then shared the cores, and the figure is not a quiet-machine result.

The tables published in benchmarks/README.md, docs/benchmarks.md, docs/review.md and docs/families-mid-2026.md
are generated from these files between ``<!-- results: NAME -->`` and ``<!-- /results -->`` markers (``python -m
benchmarks.results --write``; ``make bench`` runs it last); tests/test_bench_results.py checks that every table
equals its file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROOT = HERE.parent
#: the documents whose ``<!-- results: NAME -->`` blocks are generated from results/NAME.json
DOCUMENTS = (HERE / "README.md", ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "review.md",
             ROOT / "docs" / "families-mid-2026.md")
#: above this 1-minute load (2 cores) a round is not a quiet-machine round
QUIET_LOAD = 2.0
_BLOCK = re.compile(r"(<!-- results: ([\w.-]+) -->\n)(.*?)(<!-- /results -->)", re.S)
_TARGET = re.compile(r"^(>=|<=)\s*([0-9.eE+-]+)$")


def _version(dist: str) -> str:
    """The installed version of ``dist``, or ``-`` where it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def meets(value: float, target: str) -> bool:
    """Whether ``value`` meets a target written ``>= X`` or ``<= X``."""
    m = _TARGET.match(target.strip())
    if not m:
        raise ValueError(f"target {target!r}: write it as '>= X' or '<= X'")
    op, bound = m.group(1), float(m.group(2))
    return value >= bound if op == ">=" else value <= bound


def warm(folder: str | os.PathLike) -> int:
    """Read every file under ``folder`` once (the bytes read): a pass timed after this reads from the page cache.
    This machine evicts files left idle for seconds even with half its memory free (a DAMON reclaim thread runs)
    and its disk reads about 90 MB/s, so a pass over cold files times the disk, in one round and not the next.
    Every side of a comparison is warmed the same way before each of its passes."""
    total = 0
    for where, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(where, name), "rb", buffering=0) as f:
                while chunk := f.read(1 << 24):
                    total += len(chunk)
    return total


class Run:
    """The rounds of one benchmark run, written to ``results/<name>.json`` by :meth:`save`."""

    def __init__(self, name: str, command: str, tools: list[str] = ()) -> None:
        self.name, self.command = name, command
        self.versions = {d: _version(d) for d in ["bucketeer", "numpy", "pyarrow", "torch", *tools]}
        self.rounds: list[dict] = []
        self.measures: dict[str, dict] = {}
        self.started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    @contextlib.contextmanager
    def round(self):
        """One interleaved round: the load before and after it is recorded with the values added inside."""
        entry = {"load_before": round(os.getloadavg()[0], 2)}
        self.rounds.append(entry)
        yield len(self.rounds) - 1
        entry["load_after"] = round(os.getloadavg()[0], 2)

    def add(self, measure: str, value: float, unit: str = "", target: str = "", note: str = "") -> None:
        """Record this round's ``value`` of ``measure`` (a rate, a ratio, ...); ``target`` like ``>= 1.2``."""
        if not self.rounds or "load_after" in self.rounds[-1]:
            raise RuntimeError("Run.add is called inside `with run.round():`")
        if target:
            meets(value, target)  # a malformed target fails here, not when the table is written
        m = self.measures.setdefault(measure, {"unit": unit, "target": target, "note": note, "values": {}})
        m["values"][str(len(self.rounds) - 1)] = float(value)

    def summary(self) -> list[dict]:
        """Each measure's median, min, max over its rounds, the highest load they saw and whether the target held."""
        rows = []
        for measure, m in self.measures.items():
            idx = [int(i) for i in m["values"]]
            values = [m["values"][str(i)] for i in idx]
            loads = [max(self.rounds[i]["load_before"], self.rounds[i].get("load_after", 0.0)) for i in idx]
            rows.append({
                "measure": measure, "unit": m["unit"], "note": m["note"], "rounds": values,
                "median": statistics.median(values), "min": min(values), "max": max(values),
                "target": m["target"], "met": all(meets(v, m["target"]) for v in values) if m["target"] else None,
                "max_load": max(loads),
            })
        return rows

    def save(self, folder: Path = RESULTS) -> Path:
        """Write the run (every round's values and loads, versions, the summary) as ``<folder>/<name>.json``."""
        folder.mkdir(parents=True, exist_ok=True)
        doc = {
            "benchmark": self.name, "command": self.command, "started": self.started,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "system": platform.system()},
            "versions": self.versions, "rounds": self.rounds, "rows": self.summary(),
        }
        path = folder / f"{self.name}.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}", flush=True)
        return path


def _fmt(value: float, unit: str) -> str:
    """A figure as the tables print it: thousands separated, 2 decimals under 100, ``x`` for ratios."""
    text = f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.2f}"
    return f"{text}x" if unit == "x" else f"{text} {unit}".rstrip()


def render(name: str, folder: Path = RESULTS) -> str:
    """The Markdown table of ``results/<name>.json``: median (min-max), target, whether every round met it."""
    doc = json.loads((folder / f"{name}.json").read_text())
    loads = [x for r in doc["rounds"] for x in (r["load_before"], r.get("load_after", 0.0))]
    lines = [
        f"`{doc['command']}` — {len(doc['rounds'])} round{'s' * (len(doc['rounds']) != 1)}, {doc['started'][:10]}, "
        f"1-minute load "
        f"{min(loads):.1f}-{max(loads):.1f} on {doc['machine']['cpus']} cores"
        + ("" if max(loads) <= QUIET_LOAD else " (**not a quiet machine**: figures marked with their load)")
        + "; " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items() if v != "-"),
        "",
        "| measure | median | min - max | target | met in every round |",
        "|---|---|---|---|---|",
    ]
    for row in doc["rows"]:
        load = f" (load {row['max_load']:.1f})" if row["max_load"] > QUIET_LOAD else ""
        met = {None: "", True: "yes", False: "**no**"}[row["met"]]
        label = row["measure"] + (f" ({row['note']})" if row["note"] else "")
        lines.append(f"| {label} | {_fmt(row['median'], row['unit'])}{load} | {_fmt(row['min'], row['unit'])} - "
                     f"{_fmt(row['max'], row['unit'])} | {row['target']} | {met} |")
    return "\n".join(lines) + "\n"


def blocks(text: str) -> list[tuple[str, str]]:
    """The ``(name, generated text)`` of every results block in a document."""
    return [(m.group(2), m.group(3)) for m in _BLOCK.finditer(text)]


def regenerate(text: str, folder: Path = RESULTS) -> str:
    """``text`` with every results block replaced by :func:`render` of its file."""
    return _BLOCK.sub(lambda m: m.group(1) + render(m.group(2), folder) + m.group(4), text)


def commands(folder: Path = RESULTS) -> list[str]:
    """The command each results block of the documents was taken with, each once, in the documents' order:
    what ``make bench`` runs again."""
    names = [name for doc in DOCUMENTS for name, _ in blocks(doc.read_text())]
    return list(dict.fromkeys(json.loads((folder / f"{name}.json").read_text())["command"] for name in names))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite the results blocks of the documents in place")
    p.add_argument("--commands", action="store_true",
                   help="only print the command of every published table, each once (make bench runs them)")
    args = p.parse_args(argv)
    if args.commands:
        print("\n".join(commands()))
        return 0
    stale = []
    for doc in DOCUMENTS:
        text = doc.read_text()
        new = regenerate(text)
        if new != text:
            stale.append(doc.relative_to(ROOT))
            if args.write:
                doc.write_text(new)
    verb = "rewrote" if args.write else "stale (run with --write)"
    print(f"{verb}: {', '.join(map(str, stale))}" if stale else "every results table equals its file")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
