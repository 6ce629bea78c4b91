"""README.md is the manual, and this keeps it true.

Every fenced ``bash`` block in the README is preceded by a tag saying which test runs it:

    <!-- test: e2e -->       tests/test_e2e.py runs it against a local S3-compatible server and Ray head
                             (real-cloud placeholders substituted, see tests/test_e2e.py: SUBSTITUTIONS)
    <!-- test: demo -->      tests/test_demo.py runs it in the folder where `bucketeer demo` just ran
    <!-- test: local -->     this file runs it, from the repository root
    <!-- test: skip: WHY --> not run, for the stated reason (e.g. `make demo`: test_demo.py runs the demo)

This file checks that every block is tagged, runs the ``local`` ones, and checks that the
configuration reference lists exactly the options every subcommand's parser has (regenerate it
with ``.venv/bin/python -m tests.test_readme``), and that the benchmark table agrees with
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TAGS = ("e2e", "demo", "local", "skip")
# the tag line, then (blank lines allowed) the fenced block
_BLOCK = re.compile(r"<!-- test: (\w+)(?::\s*(.*?))? -->\s*\n```bash\n(.*?)```", re.DOTALL)
_ANY_BASH = re.compile(r"^```bash$", re.MULTILINE)


@dataclass(frozen=True)
class Block:
    tag: str
    reason: str
    code: str
    line: int  # 1-based line of the opening fence, for messages


def readme_blocks(tag: str | None = None, text: str | None = None) -> list[Block]:
    """The README's tagged bash blocks (all, or those with ``tag``), in document order."""
    text = README.read_text() if text is None else text
    blocks = [Block(m.group(1), (m.group(2) or "").strip(), m.group(3), text.count("\n", 0, m.start(3)))
              for m in _BLOCK.finditer(text)]  # fmt: skip
    return [b for b in blocks if tag is None or b.tag == tag]


def bash_env(**extra: str) -> dict[str, str]:
    """The environment a README command runs in: this checkout's venv first on PATH (as after `make`)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def run_bash(code: str, cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    """Run README commands as a user's shell would, stopping at the first failure; returns the output."""
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    output = proc.stdout + proc.stderr
    failed = f"README commands failed (exit {proc.returncode}):\n{code}\n--- output ---\n{output[-6000:]}"
    assert proc.returncode == 0, failed
    return output


# ---------------------------------------------------------------- the configuration reference


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """``"bucketeer scan"`` ... and ``"python -m train"`` -> the argparse parser each really uses."""
    from pipeline.cli import COMMANDS, build_parser

    top = build_parser()
    choices = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    parsers = {f"bucketeer {name}": choices[name] for name in COMMANDS}

    import train.__main__ as trainer

    class Captured(Exception):
        pass

    def capture(self, args=None, namespace=None):  # the trainer builds its parser inside parse_args()
        parsers["python -m train"] = self
        raise Captured

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), pytest.raises(Captured):
        trainer.parse_args([])
    return parsers


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def _cell(action: argparse.Action) -> tuple[str, str, str]:
    name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest.upper()}`"
    if action.option_strings and action.metavar:  # a named value (the dest's upper case adds nothing)
        name += f" `{action.metavar}`"
    name = name.replace("|", "\\|")
    if action.required or (not action.option_strings and action.nargs is None):
        default = "required"
    elif isinstance(action, argparse._StoreTrueAction) or action.default in (None, argparse.SUPPRESS):
        default = ""
    else:
        default = f"`{action.default}`"
    text = (action.help or "").replace("%(default)s", str(action.default)).replace("|", "\\|")
    if action.choices:
        text += f" (one of {', '.join(map(str, action.choices))})"
    return name, default, text


def reference_markdown() -> str:
    """The configuration reference section's tables, generated from the parsers."""
    out = []
    for command, parser in command_parsers().items():
        out += [f"#### `{command}`", "", "| option | default | meaning |", "|---|---|---|"]
        out += [f"| {n} | {d} | {t} |" for n, d, t in map(_cell, _options(parser))]
        out.append("")
    return "\n".join(out)


def _reference_sections(text: str) -> dict[str, str]:
    """``command -> its part of the README's configuration reference``."""
    start = text.index("## Configuration reference")
    end = text.index("\n## ", start + 1)
    parts = re.split(r"^#### `([^`]+)`\s*$", text[start:end], flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


# ---------------------------------------------------------------- tests


def test_every_bash_block_is_tagged_with_the_test_that_runs_it():
    text = README.read_text()
    blocks = readme_blocks(text=text)
    assert len(blocks) == len(_ANY_BASH.findall(text)), "a ```bash block without a <!-- test: ... --> tag before it"
    assert not re.search(r"^```(sh|shell|console|zsh)$", text, re.MULTILINE), "commands go in ```bash blocks"
    for b in blocks:
        assert b.tag in TAGS, f"README line {b.line}: unknown test tag {b.tag!r} (one of {TAGS})"
        if b.tag == "skip":
            assert len(b.reason) > 10, f"README line {b.line}: a skipped block must say why"
    # the flows the README promises are all there, and run
    tags = {b.tag for b in blocks}
    assert {"e2e", "demo", "local"} <= tags
    e2e = "\n".join(b.code for b in readme_blocks("e2e", text))
    job = "ray job submit --runtime-env infra/ray/runtime_env.yaml --working-dir . -- python -m pipeline."
    for command in (f"{job}scan s3://", f"{job}embed s3://", "bucketeer plan s3://", "bucketeer verify s3://",
                    "bucketeer report s3://", "accelerate launch --config_file infra/accelerate/"):  # fmt: skip
        assert command in re.sub(r"\s*\\\n\s*", " ", e2e), f"the cluster flow lacks `{command}`"
    skipped = " ".join(b.code for b in readme_blocks("skip", text))
    assert "make demo" in skipped and "make test" in skipped


def test_configuration_reference_lists_exactly_every_option_of_every_command():
    sections = _reference_sections(README.read_text())
    parsers = command_parsers()
    assert set(sections) == set(parsers), (
        f"reference sections {sorted(sections)} != commands {sorted(parsers)}; "
        "regenerate with: .venv/bin/python -m tests.test_readme"
    )
    for command, parser in parsers.items():
        documented = set(re.findall(r"^\| `(--?[\w-]+)`", sections[command], re.MULTILINE))
        documented |= set(re.findall(r"^\| `--?[\w-]+`, `(--?[\w-]+)`", sections[command], re.MULTILINE))
        actual = {s for a in _options(parser) for s in a.option_strings}
        assert documented == actual, (
            f"{command}: README documents {sorted(documented - actual)} that do not exist and lacks "
            f"{sorted(actual - documented)}; regenerate with: .venv/bin/python -m tests.test_readme"
        )
        positionals = {(a.metavar or a.dest.upper()) for a in _options(parser) if not a.option_strings}
        for name in positionals:
            assert f"| `{name}` |" in sections[command], f"{command}: README lacks the argument {name}"


def test_every_subcommand_is_documented_outside_the_reference_too():
    from pipeline.cli import COMMANDS

    text = README.read_text()
    manual = text[: text.index("## Configuration reference")]
    for name in COMMANDS:
        assert f"bucketeer {name}" in manual, f"`bucketeer {name}` is not explained before the reference"


def test_benchmark_headlines_are_copied_from_benchmarks_readme():
    text = README.read_text()
    bench = (ROOT / "benchmarks" / "README.md").read_text()
    table = text[text.index("## Benchmarks") :]
    table = table[: table.index("\n## ")] if "\n## " in table else table
    assert "benchmarks/README.md" in table
    figures = re.findall(r"\*\*([^*]*\d[^*]*)\*\*", table)
    assert len(figures) >= 4, "the benchmark table marks its headline figures in bold"
    for figure in figures:
        assert figure in bench, f"benchmark figure {figure!r} is not in benchmarks/README.md"


def test_status_table_says_what_is_untested():
    text = README.read_text()
    status = text[text.index("## Status") :]
    status = status[: status.index("\n## ")]
    assert "planned" not in status and "in progress" not in status
    for untested in ("GPU", "real cloud"):
        assert untested in status, f"the status table must say that {untested} paths are not tested here"


def test_local_blocks_run(tmp_path):
    blocks = readme_blocks("local")
    assert blocks
    for block in blocks:
        run_bash(block.code, ROOT, bash_env(), timeout=300)


if __name__ == "__main__":
    print(reference_markdown())
