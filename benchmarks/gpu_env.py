"""The GPU check's packages on an offline GPU machine: the wheel folder, downloaded here and installed there.

    python3 benchmarks/gpu_env.py download [--dest .gpu-wheels]   # = make gpu-wheels, on a networked machine
    python3 benchmarks/gpu_check.py --wheels .gpu-wheels          # on the GPU machine: installs them, then runs

A GPU machine's own ``python3`` holds CUDA torch and most of what the check imports, and reaches no package
index. What it lacks is listed once, in ``infra/gpu/wheels.txt``; :func:`download` fetches exactly those for
CPython 3.12 manylinux x86_64 (no dependencies: each one the list names) and refuses a folder over
:data:`LIMIT_BYTES` (the working tree that travels to the machine is 64 MiB in all). :func:`install` puts the
ones that fit the running interpreter into a ``--target`` folder (``pip --no-index``: nothing is fetched), which
the check puts first on ``sys.path`` and ``PYTHONPATH`` (the trainer runs in child processes).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "infra" / "gpu" / "wheels.txt"
DEFAULT_DEST = ROOT / ".gpu-wheels"
LIMIT_BYTES = 40 << 20
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")  # fmt: skip

__all__ = ["Requirement", "read_list", "download", "install", "build_sdist"]


@dataclass(frozen=True)
class Requirement:
    """One ``NAME==VERSION`` line of the list; ``sdist`` when the line ends in ``sdist`` (a source archive)."""

    spec: str
    sdist: bool = False


def read_list(path: Path = LIST) -> list[Requirement]:
    """The requirements of ``path``: ``NAME==VERSION [sdist]`` lines; ``#`` comments and blank lines skipped."""
    out = []
    for line in path.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if "==" not in words[0] or words[1:] not in ([], ["sdist"]):
            raise ValueError(f"{path}: {line!r}: write NAME==VERSION, optionally followed by 'sdist'")
        out.append(Requirement(words[0], sdist=words[1:] == ["sdist"]))
    return out


def download(dest: Path = DEFAULT_DEST, path: Path = LIST) -> int:
    """Download every requirement of ``path`` into ``dest`` (emptied first) for CPython 3.12 manylinux x86_64.
    Returns the folder's total bytes; raises SystemExit when pip fails or the folder is over the limit."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.iterdir():
        if old.is_file():
            old.unlink()
    for req in read_list(path):
        kind = ["--no-binary=:all:"] if req.sdist else ["--only-binary=:all:"]
        platforms = [f"--platform={p}" for p in PLATFORMS]
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *kind, "--python-version", "3.12",
               "--implementation", "cp", *platforms, "-d", str(dest), req.spec]  # fmt: skip
        if subprocess.run(cmd).returncode:
            raise SystemExit(f"gpu-wheels: pip could not download {req.spec} (see above)")
    files = sorted(p for p in dest.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    for p in files:
        print(f"  {p.name:80s} {p.stat().st_size / 2**20:6.2f} MiB")
    print(f"gpu-wheels: {len(files)} files, {total / 2**20:.2f} MiB in {dest} (limit {LIMIT_BYTES / 2**20:.0f} MiB)")
    if total > LIMIT_BYTES:
        raise SystemExit(f"gpu-wheels: {total / 2**20:.1f} MiB is over the {LIMIT_BYTES / 2**20:.0f} MiB that may "
                         f"travel with the working tree: trim {path}")  # fmt: skip
    (dest / ".downloaded").write_text(_digest(path) + "\n")
    return total


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _fits(wheel: Path) -> bool:
    """Whether ``wheel``'s tags fit the running interpreter (a cp312 wheel does not fit a 3.11 rehearsal)."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    supported = set(sys_tags())
    return any(tag in supported for tag in parse_wheel_filename(wheel.name)[3])


def install(wheels: Path, target: Path) -> list[str]:
    """Install the wheels of ``wheels`` that fit this interpreter into ``target`` (no index, no dependencies),
    once per content of the folder. Returns the names of the wheels left out as not fitting (said once)."""
    if not wheels.is_dir():
        raise SystemExit(f"gpu-check: --wheels {wheels}: no such folder (make gpu-wheels on a networked machine, "
                         "then bring it beside the working tree)")  # fmt: skip
    found = sorted(wheels.glob("*.whl"))
    fitting = [w for w in found if _fits(w)]
    skipped = [w.name for w in found if w not in fitting]
    stamp = target / ".installed"
    key = ",".join(w.name for w in fitting)
    if stamp.exists() and stamp.read_text() == key:
        return skipped
    target.mkdir(parents=True, exist_ok=True)
    if fitting:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--disable-pip-version-check", "--upgrade", "--target", str(target), *map(str, fitting)]  # fmt: skip
        if subprocess.run(cmd).returncode:
            raise SystemExit(f"gpu-check: pip could not install the wheels of {wheels} into {target} (see above)")
    stamp.write_text(key)
    return skipped


def build_sdist(wheels: Path, name: str, target: Path, timeout: float) -> str | None:
    """Build and install the source archive ``name-*.tar.gz`` of ``wheels`` into ``target`` (no index, no build
    isolation: its build needs only what is installed). Returns None when it installed, else why not (one line)."""
    archives = sorted(wheels.glob(f"{name}-*.tar.gz"))
    if not archives:
        return f"no {name} source archive in {wheels}"
    env = {**os.environ, "DS_BUILD_OPS": "0"}  # DeepSpeed: compile ops at first use, not at install
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
           "--disable-pip-version-check", "--target", str(target), str(archives[-1])]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"building {archives[-1].name} took over {timeout:.0f} s"
    if proc.returncode:
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        return f"{archives[-1].name} did not build offline: {(lines or ['(no output)'])[-1].strip()[:200]}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download", help="download infra/gpu/wheels.txt for CPython 3.12 manylinux x86_64")
    d.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    d.add_argument("--if-changed", action="store_true", help="do nothing when the folder matches the list")
    args = p.parse_args(argv)
    stamp = args.dest / ".downloaded"
    if args.if_changed and stamp.exists() and stamp.read_text().strip() == _digest(LIST):
        print(f"gpu-wheels: {args.dest} matches {LIST.relative_to(ROOT)}")
        return 0
    download(args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
