"""README.md and docs/*.md are the manual, and this keeps them true.

Every fenced ``bash`` block of README.md and of every page of docs/ is preceded by a tag saying which test
runs it:

    <!-- test: e2e -->       tests/test_e2e.py runs it against a local S3-compatible server and Ray head
                             (real-cloud placeholders substituted, see tests/test_e2e.py: SUBSTITUTIONS);
                             README.md only: the cluster flow
    <!-- test: demo -->      tests/test_demo.py runs it in the folder where `bucketeer demo` just ran
    <!-- test: local -->     this file runs it, from the repository root
    <!-- test: skip: WHY --> not run, for the stated reason (e.g. `make demo`: test_demo.py runs the demo)

This file checks that every block is tagged, runs the ``local`` ones, checks that the option reference of
docs/configuration.md lists exactly the options every command's parser has (print it with
``.venv/bin/python -m tests.test_readme``, write it into the page with ``... -m tests.test_readme --write``),
that the benchmark table agrees with benchmarks/README.md, that every page is one click from the README,
that links and their anchors resolve, and that no paragraph is on two pages.
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
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
REFERENCE = "## Every option of every command"  # the generated part of CONFIGURATION: from here to its end
TAGS = ("e2e", "demo", "local", "skip")
# the tag line, then (blank lines allowed) the fenced block
_BLOCK = re.compile(r"<!-- test: (\w+)(?::\s*(.*?))? -->\s*\n```bash\n(.*?)```", re.DOTALL)
_ANY_BASH = re.compile(r"^```bash$", re.MULTILINE)
_FENCE = re.compile(r"^```.*?^```$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def documents() -> list[Path]:
    """README.md, then the pages of docs/ by name: the order their blocks run in."""
    return [README, *sorted(DOCS.glob("*.md"))]


@dataclass(frozen=True)
class Block:
    doc: Path
    tag: str
    reason: str
    code: str
    line: int  # 1-based line of the opening fence, for messages

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)} line {self.line}"


def doc_blocks(tag: str | None = None, docs: list[Path] | None = None) -> list[Block]:
    """The tagged bash blocks (all, or those with ``tag``) of ``docs`` (default: every document), in order."""
    blocks = []
    for doc in documents() if docs is None else docs:
        text = doc.read_text()
        blocks += [Block(doc, m.group(1), (m.group(2) or "").strip(), m.group(3), text.count("\n", 0, m.start(3)))
                   for m in _BLOCK.finditer(text)]  # fmt: skip
    return [b for b in blocks if tag is None or b.tag == tag]


def bash_env(**extra: str) -> dict[str, str]:
    """The environment a documented command runs in: this checkout's venv first on PATH (as after `make`)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def run_bash(code: str, cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    """Run documented commands as a user's shell would, stopping at the first failure; returns the output."""
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    output = proc.stdout + proc.stderr
    failed = f"documented commands failed (exit {proc.returncode}):\n{code}\n--- output ---\n{output[-6000:]}"
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
    """The option reference's tables (the end of docs/configuration.md), generated from the parsers."""
    out, first = [], {}  # an option another command shares (estimate takes embed's) points to where it is explained
    for command, parser in command_parsers().items():
        out += [f"### `{command}`", "", "| option | default | meaning |", "|---|---|---|"]
        for action in _options(parser):
            n, d, t = _cell(action)
            t = f"as in `{first[n, d, t]}`" if first.setdefault((n, d, t), command) != command else t
            out.append(f"| {n} | {d} | {t} |")
        out.append("")
    return "\n".join(out)


def _reference_part(text: str) -> tuple[int, int]:
    """Where the generated tables of docs/configuration.md are: from the first command's heading to the end."""
    return text.index("\n### `", text.index(REFERENCE)) + 1, len(text)


def write_reference() -> None:
    """Replace the tables of docs/configuration.md with :func:`reference_markdown` (the prose above them stays)."""
    text = CONFIGURATION.read_text()
    start, end = _reference_part(text)
    CONFIGURATION.write_text(text[:start] + reference_markdown())


def _reference_sections(text: str) -> dict[str, str]:
    """``command -> its table in the option reference``."""
    start, end = _reference_part(text)
    parts = re.split(r"^### `([^`]+)`\s*$", text[start:end], flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


# ---------------------------------------------------------------- links


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """The anchors of ``doc``'s headings (outside code blocks); a repeated heading's get -1, -2, ..."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", doc.read_text()), re.MULTILINE):
        base = slug(heading)
        found.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return found


def links(doc: Path) -> list[str]:
    """``doc``'s Markdown links (outside code blocks), as written."""
    return _LINK.findall(_FENCE.sub("", doc.read_text()))


def paragraphs(doc: Path) -> list[str]:
    """``doc``'s prose outside code blocks, a paragraph or a table row each, whitespace normalised."""
    units = []
    for para in re.split(r"\n\s*\n", _FENCE.sub("", doc.read_text())):
        rows = [line for line in para.splitlines() if line.startswith("|")]
        units += [" ".join(u.split()) for u in (rows or [para])]
    return units


# ---------------------------------------------------------------- tests


def test_every_bash_block_is_tagged_with_the_test_that_runs_it():
    for doc in documents():
        text = doc.read_text()
        blocks = doc_blocks(docs=[doc])
        assert len(blocks) == len(_ANY_BASH.findall(text)), f"{doc.name}: a ```bash block without a test tag"
        assert not re.search(r"^```(sh|shell|console|zsh)$", text, re.MULTILINE), "commands go in ```bash blocks"
        for b in blocks:
            assert b.tag in TAGS, f"{b.where}: unknown test tag {b.tag!r} (one of {TAGS})"
            if b.tag == "skip":
                assert len(b.reason) > 10, f"{b.where}: a skipped block must say why"
            assert b.tag != "e2e" or doc == README, f"{b.where}: the cluster flow (e2e) is the README's"
    # the flows the documents promise are all there, and run
    assert {"e2e", "demo", "local"} <= {b.tag for b in doc_blocks()}
    e2e = "\n".join(b.code for b in doc_blocks("e2e"))
    job = "ray job submit --runtime-env infra/ray/runtime_env.yaml --working-dir . -- python -m pipeline."
    for command in (f"{job}scan s3://", f"{job}embed s3://", "bucketeer plan s3://", "bucketeer verify s3://",
                    "bucketeer report s3://", "accelerate launch --config_file infra/accelerate/"):  # fmt: skip
        assert command in re.sub(r"\s*\\\n\s*", " ", e2e), f"the cluster flow lacks `{command}`"
    skipped = " ".join(b.code for b in doc_blocks("skip", docs=[README]))
    assert "make demo" in skipped and "make test" in skipped


def test_configuration_reference_lists_exactly_every_option_of_every_command():
    sections = _reference_sections(CONFIGURATION.read_text())
    parsers = command_parsers()
    regenerate = "regenerate with: .venv/bin/python -m tests.test_readme --write"
    assert set(sections) == set(parsers), f"reference sections {sorted(sections)} != commands {sorted(parsers)}; " \
                                          f"{regenerate}"
    for command, parser in parsers.items():
        documented = set(re.findall(r"^\| `(--?[\w-]+)`", sections[command], re.MULTILINE))
        documented |= set(re.findall(r"^\| `--?[\w-]+`, `(--?[\w-]+)`", sections[command], re.MULTILINE))
        actual = {s for a in _options(parser) for s in a.option_strings}
        assert documented == actual, (
            f"{command}: docs/configuration.md documents {sorted(documented - actual)} that do not exist and lacks "
            f"{sorted(actual - documented)}; {regenerate}"
        )
        positionals = {(a.metavar or a.dest.upper()) for a in _options(parser) if not a.option_strings}
        for name in positionals:
            assert f"| `{name}` |" in sections[command], f"{command}: docs/configuration.md lacks the argument {name}"


def test_every_command_is_in_the_readme_and_explained_on_a_page():
    from pipeline.cli import COMMANDS

    readme = README.read_text()
    pages = "".join(doc.read_text() for doc in documents()[1:] if doc != CONFIGURATION)
    for name in COMMANDS:
        assert f"bucketeer {name}" in readme, f"`bucketeer {name}` is not in the README's list of commands"
        assert f"bucketeer {name}" in pages, f"`bucketeer {name}` is explained on no page of docs/"


def test_every_page_is_one_click_from_the_readme_and_listed_in_the_index():
    readme_links = {re.sub(r"#.*", "", link) for link in links(README)}
    index_links = {re.sub(r"#.*", "", link) for link in links(DOCS / "README.md")}
    for page in DOCS.glob("*.md"):
        assert f"docs/{page.name}" in readme_links, f"README.md does not link docs/{page.name}"
        assert page.name == "README.md" or page.name in index_links, f"docs/README.md does not list {page.name}"
    assert len(README.read_text().splitlines()) <= 400, "README.md is the front door: the reference goes in docs/"


def test_links_and_their_anchors_resolve():
    for doc in [*documents(), ROOT / "benchmarks" / "README.md", ROOT / "infra" / "README.md"]:
        for link in links(doc):
            if re.match(r"[a-z]+:", link):  # https:, mailto:
                continue
            path, _, anchor = link.partition("#")
            target = (doc.parent / path).resolve() if path else doc
            assert target.exists(), f"{doc.relative_to(ROOT)}: {link} leads nowhere"
            if anchor and target.suffix == ".md":
                assert anchor in anchors(target), f"{doc.relative_to(ROOT)}: {link}: no such heading in {path or doc}"


def test_no_paragraph_is_on_two_pages():
    seen: dict[str, str] = {}
    for doc in documents():
        for unit in paragraphs(doc):
            if len(unit) < 120:  # a heading, a short line introducing a block: may well recur
                continue
            assert unit not in seen, f"{doc.name} repeats a paragraph of {seen[unit]}: {unit[:100]}..."
            seen[unit] = doc.name


def test_benchmark_headlines_are_copied_from_benchmarks_readme():
    table = (DOCS / "benchmarks.md").read_text() + (DOCS / "gpu.md").read_text()
    bench = (ROOT / "benchmarks" / "README.md").read_text()
    assert "benchmarks/README.md" in table
    figures = re.findall(r"\*\*([^*]*\d[^*]*)\*\*", table)
    assert len(figures) >= 4, "the benchmark table marks its headline figures in bold"
    for figure in figures:
        assert figure in bench, f"benchmark figure {figure!r} is not in benchmarks/README.md"


def test_status_table_says_what_is_untested():
    text = (DOCS / "testing.md").read_text()
    status = text[text.index("## What is tested, and what is not") :]
    status = status[: status.index("\n## ")]
    assert "planned" not in status and "in progress" not in status
    for untested in ("GPU", "real cloud"):
        assert untested in status, f"the status table must say that {untested} paths are not tested here"
    assert "GPU measures" in status


def test_local_blocks_run(tmp_path):
    blocks = doc_blocks("local")
    assert blocks
    for block in blocks:
        run_bash(block.code, ROOT, bash_env(), timeout=300)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_reference()
        print(f"wrote the option reference into {CONFIGURATION.relative_to(ROOT)}")
    else:
        print(reference_markdown())
