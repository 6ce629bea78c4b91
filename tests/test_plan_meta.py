"""``_plan.json`` parsed into a typed PlanMeta: every plan of the previous release reads and writes back exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from manifests.buckets import BucketSpec
from manifests.manifest import write_manifest
from manifests.plan import PLAN_FILE, PlanError, PlanMeta, read_plan_meta
from pipeline import PlanJob, PlanResult, run
from tests.factories import manifest_tables

FIXTURES = Path(__file__).parent / "fixtures" / "v0_2"


@pytest.mark.parametrize("name", ["plan", "mix-plan", "packed-plan"])
def test_fixture_plans_read_and_write_back_exactly(name: str) -> None:
    d = json.loads((FIXTURES / name / PLAN_FILE).read_text())
    meta = read_plan_meta(str(FIXTURES / name))
    assert isinstance(meta, PlanMeta)
    assert meta.to_json() == d
    assert meta.inputs.world_size == d["inputs"]["world_size"] and meta.fingerprint == d["fingerprint"]
    assert (meta.mix is None) == (name != "mix-plan") and (meta.inputs.mix is None) == (name != "mix-plan")
    assert set(meta.buckets) == set(d["buckets"]) and meta.epochs[0].sha256 == d["epochs"][0]["sha256"]


@pytest.mark.parametrize("key, value, message", [("format_version", 99, "format version 99"),
                                                 ("kind", "bucketeer.cache", "is not a bucketeer.plan")])  # fmt: skip
def test_another_format_version_or_kind_is_one_line(tmp_path: Path, key: str, value, message: str) -> None:
    folder = Path(shutil.copytree(FIXTURES / "plan", tmp_path / "plan"))
    d = json.loads((folder / PLAN_FILE).read_text())
    (folder / PLAN_FILE).write_text(json.dumps(dict(d, **{key: value})))
    for read in (lambda: read_plan_meta(str(folder)), lambda: PlanMeta.from_json(dict(d, **{key: value}), str(folder))):
        with pytest.raises(PlanError, match=message) as e:
            read()
        assert "\n" not in str(e.value)


def test_a_malformed_plan_json_is_a_plan_error(tmp_path: Path) -> None:
    d = json.loads((FIXTURES / "plan" / PLAN_FILE).read_text())
    del d["epochs"]
    with pytest.raises(PlanError, match="malformed"):
        PlanMeta.from_json(d, str(tmp_path))


def test_run_returns_the_plan_it_wrote(tmp_path: Path) -> None:
    manifest = str(tmp_path / "m")
    write_manifest(manifest, *manifest_tables(120, seed=3), source="/d", spec=BucketSpec(area=256 * 256))
    out = str(tmp_path / "p")
    result = run(PlanJob(manifests=(manifest,), out=out, world_size=2, batch_size=2, epochs=2, progress=False))
    assert isinstance(result, PlanResult) and result.exit_code == 0 and result.url == out
    written = json.loads(Path(out, PLAN_FILE).read_text())
    assert result.fingerprint == written["fingerprint"] and result.meta.to_json() == written
    assert result.planned == written["samples"]["planned"] and result.dropped == written["counts"]["dropped"]
    check = run(PlanJob(check=out, manifests=(manifest,), progress=False))
    assert check.exit_code == 0 and check.fingerprint == result.fingerprint
