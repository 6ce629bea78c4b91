"""`.ci/floors.py`: the pins `make test-floors` installs are pyproject.toml's floors, one per core dependency.

`make test-floors` itself (a venv with every core dependency at its floor, then the fast tests) runs in CI
after `make test`; this checks only that its pins cannot drift from pyproject.toml or miss a dependency.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def _load_floors():
    spec = importlib.util.spec_from_file_location("ci_floors", ROOT / ".ci" / "floors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


floors = _load_floors()


def test_every_core_dependency_but_torch_is_pinned_to_its_floor():
    dependencies = [Requirement(d) for d in floors.core_dependencies()]
    pins = {Requirement(p).name: Requirement(p) for p in floors.floor_pins(floors.core_dependencies())}
    assert set(pins) == {d.name for d in dependencies} - {"torch"}
    for dep in dependencies:
        if dep.name == "torch":
            continue
        (floor,) = [s.version for s in dep.specifier if s.operator == ">="]
        (pin,) = pins[dep.name].specifier
        assert (pin.operator, pin.version) == ("==", floor), dep
        assert not pins[dep.name].extras  # pip refuses extras in a constraints file
        assert pin.version in dep.specifier  # the pin satisfies the whole range it was read from


def test_the_script_prints_a_constraints_file_pip_can_read():
    out = subprocess.run([sys.executable, str(ROOT / ".ci" / "floors.py")], capture_output=True, text=True, check=True)
    lines = [line for line in out.stdout.splitlines() if line and not line.startswith("#")]
    pins = floors.floor_pins(floors.core_dependencies())
    assert lines == pins + floors.tool_ceilings(pins)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+(==|<)[0-9][0-9.]*", line) for line in lines), lines


def test_tools_that_do_not_import_beside_a_floor_get_a_ceiling():
    assert floors.tool_ceilings(["numpy==1.26", "ray==2.52"]) == ["faiss-cpu<1.12"]
    assert floors.tool_ceilings(["numpy==2.0"]) == []


def test_extras_markers_and_ceilings_are_read():
    deps = ['ray[default] >= 2.52 ; python_version >= "3.10"', "numpy>=1.26,<3", "Torch>=2.4"]
    assert floors.floor_pins(deps) == ["ray==2.52", "numpy==1.26"]


@pytest.mark.parametrize("dependency", ["numpy", "numpy<3", "numpy==1.26", "numpy>=1.26,>=1.27", "numpy~=1.26"])
def test_a_dependency_without_one_floor_is_refused_by_name(dependency):
    with pytest.raises(ValueError, match=re.escape(repr(dependency))):
        floors.floor_pins([dependency])
