"""Selection in the plan: ``--annotations A --where SQL --weight-by EXPR``, its records, ``--check``, and
``bucketeer stats --where``. Annotations are written here with the annotations writer (float and bool columns).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from manifests.annotations import (
    AnnotationsCounts,
    AnnotationsMeta,
    TaskSettings,
    part_name,
    write_annotations_meta,
    write_part,
)
from manifests.buckets import BucketSpec
from manifests.manifest import read_manifest, write_manifest
from manifests.plan import epoch_part, read_plan_meta, read_plan_rows, resume_plan
from manifests.plan.check import check_plan
from manifests.select import evaluate
from manifests.storage import open_url
from pipeline import PlanJob, run
from pipeline.cli import main
from tests.factories import manifest_tables
from tests.test_plan import _rewrite
from tests.test_plan_properties import SHUFFLES

N = 400


def write_annotations(url: str, manifest, task: str, columns: dict[str, pa.Array], ids: np.ndarray,
                      errors: np.ndarray | None = None, model: str = "default") -> AnnotationsMeta:  # fmt: skip
    """An annotations folder of ``task`` with ``columns`` for samples ``ids`` (and error rows for ``errors``)."""
    fs, root = open_url(url, None)
    fs.makedirs(root, exist_ok=True)
    settings = f"test-{task}-{model}"
    n = len(ids)
    keys = {"sample_id": pa.array(ids, pa.uint64()), "filename": pa.array([f"f{i}" for i in ids]),
            "source_key": pa.array(np.zeros(n, np.uint64)), "written_at": pa.array(np.ones(n))}  # fmt: skip
    name = part_name(settings, ids, np.zeros(n, np.uint64))
    write_part(fs, root, "parts", name, pa.table({**keys, **columns}), settings)
    error_names: tuple[str, ...] = ()
    if errors is not None and len(errors):
        m = len(errors)
        table = pa.table({"sample_id": pa.array(errors, pa.uint64()), "filename": [f"f{i}" for i in errors],
                          "source_key": pa.array(np.zeros(m, np.uint64)), "written_at": pa.array(np.full(m, 2.0)),
                          "error": ["decode"] * m, "message": ["broken"] * m})  # fmt: skip
        error_names = (part_name(settings, errors, np.ones(m, np.uint64)),)
        write_part(fs, root, "errors", error_names[0], table, settings)
    meta = AnnotationsMeta(manifest=manifest.url, manifest_fingerprint=manifest.fingerprint,
                           tasks=(TaskSettings(task=task, model=model, weight_sha256="0" * 64),),
                           settings_fingerprint=settings, engine="transformers",
                           counts=AnnotationsCounts(samples=manifest.samples.num_rows, annotated=n,
                                                    errors=0 if errors is None else len(errors)),
                           parts=(name,), errors=error_names, fingerprint="")  # fmt: skip
    return write_annotations_meta(url, None, meta)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """A manifest of N images; scores (``aesthetic`` float32 for all but 10 samples, 5 of them annotation errors)
    and duplicates (``duplicate`` bool, every 7th sample)."""
    base = tmp_path_factory.mktemp("select")
    samples, errors = manifest_tables(N, seed=3)
    url = str(base / "manifest")
    write_manifest(url, samples, errors, source="/data", spec=BucketSpec(area=512 * 512))
    manifest = read_manifest(url)
    ids = manifest.samples.column("sample_id").to_numpy()
    rng = np.random.default_rng(0)
    aesthetic = rng.uniform(0, 10, N).astype(np.float32)
    scored = np.ones(N, bool)
    scored[:10] = False
    write_annotations(str(base / "scores"), manifest, "aesthetic", {"aesthetic": pa.array(aesthetic[scored])},
                      ids[scored], errors=ids[:5])  # fmt: skip
    duplicate = np.arange(N) % 7 == 3
    write_annotations(str(base / "dups"), manifest, "dedup", {"duplicate": pa.array(duplicate)}, ids)
    return {"manifest": url, "scores": str(base / "scores"), "dups": str(base / "dups"), "ids": ids,
            "aesthetic": aesthetic, "scored": scored, "duplicate": duplicate,
            "width": manifest.samples.column("width").to_numpy()}  # fmt: skip


def expected_keep(data) -> np.ndarray:
    return data["scored"] & (data["aesthetic"] > 5.0) & ~data["duplicate"] & (data["width"] >= 300)


WHERE = "aesthetic > 5.0 AND NOT duplicate AND width >= 300"


def planned(url: str, epoch: int) -> Counter:
    rows = read_plan_rows(url, [epoch]).table().to_pydict()
    return Counter(i for ids in rows["sample_ids"] for i in ids)


def test_evaluate_joins_manifest_and_annotations_columns(data):
    ev = evaluate([read_manifest(data["manifest"])], [data["scores"], data["dups"]], WHERE, "aesthetic")
    sel = ev.selections[0]
    assert ev.columns == ("aesthetic", "duplicate", "width")
    assert np.array_equal(sel.keep, expected_keep(data))  # no annotations row (error or none): NULL, dropped
    assert np.allclose(sel.weights[sel.keep], data["aesthetic"][sel.keep])
    assert sel.table().column_names == ["sample_id", "bucket", "keep", "weight"]
    assert sum(k for k, _ in sel.per_bucket().values()) == sel.kept
    # NULL is not false: say what a missing row means in the expression
    ev = evaluate([read_manifest(data["manifest"])], [data["scores"]], "aesthetic IS NULL OR aesthetic > 9")
    assert ev.selections[0].kept == int((~data["scored"] | (data["aesthetic"] > 9)).sum())


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_plan_where_keeps_only_selected_samples_and_checks(shuffle, data, tmp_path, capsys):
    url = str(tmp_path / "plan")
    keep = expected_keep(data)
    result = run(PlanJob(manifests=(data["manifest"],), out=url, world_size=2, batch_size=2, epochs=2,
                         leftover="pad", annotations=(data["scores"], data["dups"]), where=WHERE, shuffle=shuffle,
                         progress=False))
    meta = result.meta
    assert meta.samples.planned == int(keep.sum())
    assert set(planned(url, 0)) == set(data["ids"][keep].tolist())  # pad: every kept sample, no other
    assert meta.inputs.selection.where == WHERE and meta.inputs.selection.weight_by is None
    assert len(meta.inputs.selection.annotations_fingerprints) == 2
    counted = meta.selection.datasets[0]
    assert (counted.kept, counted.dropped) == (int(keep.sum()), int((~keep).sum()))
    assert sum(c.kept for c in meta.selection.buckets.values()) == int(keep.sum())
    assert meta.mix is None  # a one-manifest plan of the kept samples: the plan of before selection
    assert run(PlanJob(manifests=(data["manifest"],), check=url, progress=False)).exit_code == 0
    assert main(["plan", "--check", url, data["manifest"], "--annotations", f"{data['scores']},{data['dups']}"]) == 0

    # a plan part edited to hold an excluded sample: --check names it
    excluded = int(data["ids"][~keep][0])

    def smuggle(table: pa.Table) -> pa.Table:
        rows = table.to_pydict()
        rows["sample_ids"][0][0] = excluded
        return pa.Table.from_pydict(rows, schema=table.schema)

    tampered = tmp_path / "tampered"
    run(PlanJob(manifests=(data["manifest"],), out=str(tampered), world_size=2, batch_size=2, epochs=2,
                annotations=(data["scores"], data["dups"]), where=WHERE, shuffle=shuffle, progress=False))  # fmt: skip
    _rewrite(tampered / epoch_part(1), 1, smuggle)
    problems = check_plan(str(tampered), manifests=[read_manifest(data["manifest"])],
                          selections=evaluate([read_manifest(data["manifest"])], [data["scores"], data["dups"]],
                                              WHERE).selections)  # fmt: skip
    assert any("excluded by the plan's --where" in p and str(excluded) in p for p in problems), problems
    assert main(["plan", "--check", str(tampered), data["manifest"]]) == 1


def test_check_catches_changed_annotations(data, tmp_path):
    url = str(tmp_path / "plan")
    scores = str(tmp_path / "scores")
    manifest = read_manifest(data["manifest"])
    ids = data["ids"]
    write_annotations(scores, manifest, "aesthetic", {"aesthetic": pa.array(data["aesthetic"])}, ids)
    run(PlanJob(manifests=(data["manifest"],), out=url, world_size=2, batch_size=2, annotations=(scores,),
                where="aesthetic > 5", progress=False))  # fmt: skip
    assert run(PlanJob(manifests=(data["manifest"],), check=url, progress=False)).exit_code == 0
    write_annotations(scores, manifest, "aesthetic", {"aesthetic": pa.array(10 - data["aesthetic"])}, ids,
                      model="another")  # another model scored them
    result = run(PlanJob(manifests=(data["manifest"],), check=url, progress=False))
    assert any("annotations fingerprint mismatch" in v for v in result.violations), result.violations
    assert any("excluded by the plan's --where" in v for v in result.violations)
    # --extend refuses other annotations too
    assert main(["plan", data["manifest"], "--extend", url, "--annotations", data["dups"]]) == 2


def test_weight_by_is_exact_per_epoch(data, tmp_path):
    """Each kept sample is drawn floor or ceil of k * w / W times per epoch (exactly k slots), and on average
    over epochs its expected count; samples of weight 0 never."""
    url = str(tmp_path / "weighted")
    keep = data["scored"] & ~data["duplicate"]
    epochs = 6
    result = run(PlanJob(manifests=(data["manifest"],), out=url, world_size=1, batch_size=1, epochs=epochs,
                         annotations=(data["scores"], data["dups"]), where="NOT duplicate AND aesthetic IS NOT NULL",
                         weight_by="CASE WHEN aesthetic > 8 THEN 0 ELSE aesthetic END", progress=False))  # fmt: skip
    meta = result.meta
    assert meta.mix is not None and meta.inputs.selection.weight_by.startswith("CASE")
    ids, w = data["ids"][keep], data["aesthetic"][keep].astype(np.float64)
    w = np.where(w > 8, 0, w)
    buckets = np.asarray(read_manifest(data["manifest"]).samples.column("bucket").to_pylist())[keep]
    per_bucket = {b: c.per_epoch for b, c in meta.mix.datasets[0].buckets.items()}
    assert sum(per_bucket.values()) == int(keep.sum())  # an epoch: as many draws as samples kept
    total = Counter()
    for e in range(epochs):
        got = planned(url, e)
        total.update(got)
        for b, k in per_bucket.items():
            mine = buckets == b
            x = k * w[mine] / w[mine].sum()
            counts = np.asarray([got.get(int(i), 0) for i in ids[mine]])
            assert counts.sum() == k and np.all(counts >= np.floor(x)) and np.all(counts <= np.ceil(x))
    assert not any(total.get(int(i)) for i in ids[w == 0])
    assert run(PlanJob(manifests=(data["manifest"],), check=url, progress=False)).exit_code == 0
    # --leftover pad: the repeats that fill a bucket's last global batch are counted, not violations
    padded = str(tmp_path / "weighted-padded")
    made = run(PlanJob(manifests=(data["manifest"],), out=padded, world_size=2, batch_size=3, epochs=2,
                       leftover="pad", annotations=(data["scores"], data["dups"]), where="NOT duplicate",
                       weight_by="COALESCE(aesthetic, 1)", progress=False))  # fmt: skip
    assert sum(e.padded_total for e in made.meta.epochs) > 0
    assert not run(PlanJob(manifests=(data["manifest"],), check=padded, progress=False)).violations
    # elastic resume of a weighted plan: the rest, re-cut, the same samples
    resumed = resume_plan(url, str(tmp_path / "resumed"), epoch=1, step=10, world_size=1)
    assert resumed.inputs.selection == meta.inputs.selection
    assert sum(planned(str(tmp_path / "resumed"), 1).values()) == meta.steps_per_epoch - 10
    # a sample of weight 0 smuggled into a batch of its own bucket: drawn more often than its weight gives
    first = read_plan_rows(url, [2]).table().slice(0, 1).to_pylist()[0]
    zero = next(int(i) for i, b, x in zip(ids, buckets, w) if x == 0 and b == first["bucket"])
    assert zero not in planned(url, 2)

    def smuggle(table: pa.Table) -> pa.Table:
        rows = table.to_pydict()
        rows["sample_ids"][0][0] = zero
        return pa.Table.from_pydict(rows, schema=table.schema)

    _rewrite(Path(url) / epoch_part(2), 0, smuggle)
    violations = run(PlanJob(manifests=(data["manifest"],), check=url, progress=False)).violations
    assert any("drawn more often than ceil" in v for v in violations), violations


def test_bad_selection_is_one_clear_line(data, tmp_path, capsys):
    base = ["plan", data["manifest"], "--out", str(tmp_path / "p"), "--world-size", "1", "--batch-size", "1",
            "--annotations", data["scores"]]  # fmt: skip
    for extra, words in (
        (["--where", "aesthetic >> AND"], "'>' is not expected here"),
        (["--where", "width IN (SELECT nope FROM read_csv('/etc/passwd'))"], "a subquery (SELECT) is not allowed"),
        (["--where", "beauty > 5"], "available columns: aesthetic"),
        (["--where", "aesthetic + 1"], "not true/false"),
        (["--where", "aesthetic > 5", "--weight-by", "aesthetic - 7"], "negative weight"),
        (["--weight-by", "aesthetic"], "NULL"),
        (["--where", "aesthetic > 100"], "--where keeps none"),
    ):
        capsys.readouterr()
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, (extra, err)
    # a column in two sources: both named
    assert main(base[:-1] + [f"{data['scores']},{data['scores']}", "--where", "aesthetic > 1"]) == 2
    assert "is in both" in capsys.readouterr().err
    assert main(base[:-2] + ["--annotations", data["scores"]]) == 2  # --annotations alone


def test_stats_where_shows_kept_per_bucket_and_histograms(data, capsys):
    from pipeline.stats import StatsJob, run as stats

    result = stats(StatsJob(manifest=data["manifest"], annotations=(data["scores"], data["dups"]), where=WHERE))
    out = capsys.readouterr().out
    keep = expected_keep(data)
    assert result.selected == int(keep.sum())
    assert f"kept {int(keep.sum())} of {N} samples" in out
    assert "aesthetic" in out and "histogram" in out
    assert len(out.splitlines()) < 60  # one screen
    assert main(["stats", data["manifest"], "--annotations", data["scores"]]) == 2  # --annotations alone
    assert main(["stats", data["manifest"], "--annotations", data["scores"], "--where", "beauty > 1"]) == 2


def test_report_shows_what_a_where_kept_and_dropped(tmp_path):
    """The report's selection section: kept/dropped per bucket and thumbnails of dropped samples (real images),
    for ``--where`` given and for a plan made with one."""
    pytest.importorskip("matplotlib")
    from pipeline.report import write_report
    from tests.embed_data import make_dataset

    manifest_url = str(tmp_path / "manifest")
    make_dataset(str(tmp_path / "images"), manifest_url, 8)
    manifest = read_manifest(manifest_url)
    ids = manifest.samples.column("sample_id").to_numpy()
    scores = np.linspace(1, 8, len(ids)).astype(np.float32)  # 4 of 8 below 5
    write_annotations(str(tmp_path / "scores"), manifest, "aesthetic", {"aesthetic": pa.array(scores)}, ids)
    html_path = str(tmp_path / "r.html")
    write_report(manifest_url, html_path, annotations=str(tmp_path / "scores"), where="aesthetic >= 5")
    page = Path(html_path).read_text()
    kept = int((scores >= 5).sum())
    assert "Selection (--where)" in page and f"{kept:,} of {len(ids):,} samples" in page
    assert page.count('id="fig-dropped-') == len(ids) - kept  # every dropped sample's thumbnail (fewer than 8)
    assert "aesthetic 1.0" in page  # the value that dropped it

    plan = str(tmp_path / "plan")
    run(PlanJob(manifests=(manifest_url,), out=plan, world_size=1, batch_size=1,
                annotations=(str(tmp_path / "scores"),), where="aesthetic >= 5", progress=False))  # fmt: skip
    from pipeline.report.selection import selection_section

    title, rows, figures = selection_section(manifest, plan=plan)  # what write_report adds for a plan
    assert title.startswith("Selection of plan") and ("where", "aesthetic >= 5") in rows
    assert len(figures) == len(ids) - kept


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_selection_in_a_mixture_and_extend(shuffle, data, tmp_path):
    """Two manifests, each with its own annotations (matched by the manifest fingerprint they record): each keeps
    what its --where keeps; --window then --extend gives the plan made at once; --check passes."""
    samples, errors = manifest_tables(150, seed=9)
    other = str(tmp_path / "other")
    write_manifest(other, samples, errors, source="/other", spec=BucketSpec(area=512 * 512))
    m2 = read_manifest(other)
    ids2 = m2.samples.column("sample_id").to_numpy()
    scores2 = np.linspace(0, 10, len(ids2)).astype(np.float32)
    write_annotations(str(tmp_path / "scores2"), m2, "aesthetic", {"aesthetic": pa.array(scores2)}, ids2)
    common = dict(manifests=(data["manifest"], other), world_size=2, batch_size=2, epochs=3, repeats="1,2",
                  annotations=(data["scores"], str(tmp_path / "scores2")), where="aesthetic > 5",
                  weight_by="aesthetic", shuffle=shuffle, progress=False)  # fmt: skip
    whole = run(PlanJob(out=str(tmp_path / "whole"), **common)).meta
    kept = [int((data["scored"] & (data["aesthetic"] > 5)).sum()), int((scores2 > 5).sum())]
    assert [d.kept for d in whole.selection.datasets] == kept
    assert [d.samples for d in whole.mix.datasets] == kept
    rows = read_plan_rows(str(tmp_path / "whole"), [0]).table().to_pydict()
    allowed = [set(data["ids"][data["scored"] & (data["aesthetic"] > 5)].tolist()), set(ids2[scores2 > 5].tolist())]
    assert all(i in allowed[d] for ids, sets in zip(rows["sample_ids"], rows["dataset"]) for i, d in zip(ids, sets))
    windowed = str(tmp_path / "windowed")
    run(PlanJob(out=windowed, window=1, **common))
    run(PlanJob(manifests=common["manifests"], extend=windowed, progress=False))  # the plan's own selection
    assert read_plan_meta(windowed).epochs == whole.epochs
    assert run(PlanJob(manifests=common["manifests"], check=windowed, progress=False)).exit_code == 0


def test_resolve_keeps_the_newest_row_of_each_sample():
    """read_annotations' one-row-per-sample rule, on both of its paths (unique ids: a sort; repeats: the newest)."""
    from manifests.annotations import resolve

    unique = pa.table({"sample_id": pa.array([5, 1, 3], pa.uint64()), "written_at": [1.0, 2.0, 3.0], "v": [50, 10, 30]})
    assert resolve(unique).to_pydict() == {"sample_id": [1, 3, 5], "written_at": [2.0, 3.0, 1.0], "v": [10, 30, 50]}
    again = pa.table({"sample_id": pa.array([5, 1, 5, 3], pa.uint64()), "written_at": [1.0, 2.0, 4.0, 3.0],
                      "v": [50, 10, 51, 30]})  # fmt: skip
    assert resolve(again).column("v").to_pylist() == [10, 30, 51]
