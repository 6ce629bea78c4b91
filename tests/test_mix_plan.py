"""Mixture plans: the counting rule (property tests), the files, --check, --extend, --resume and the CLI.

The invariants are computed here from the rows, independently of ``manifests.plan.check_mix``.
"""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from manifests.buckets import BucketSpec
from manifests.manifest import read_manifest, write_manifest
from manifests.plan import epoch_part, read_plan_meta, read_plan_rows, resume_plan
from manifests.plan.check import check_plan
from manifests.plan.mix import DatasetSamples, MixRule, caption_choice, mix_epoch, mix_samples
from manifests.plan.rows import rank_table
from manifests.plan.schedule import PlanConfig, group_samples, plan_epoch
from pipeline import PlanJob, run
from pipeline.cli import main
from tests.factories import manifest_tables
from tests.test_plan import _rewrite
from tests.test_plan_properties import SHUFFLES

NAMES = ["64x64", "128x32", "32x128", "96x48"]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_dataset(n: int, buckets: int, seed: int, shared: int = 0, captions: bool = False) -> DatasetSamples:
    """``n`` samples; the first ``shared`` ids are the same in every dataset (one image, several datasets)."""
    rng = np.random.default_rng(seed)
    ids = np.concatenate([np.arange(1, shared + 1, dtype=np.uint64) * np.uint64(7919),
                          rng.choice(2**62, size=n - shared, replace=False).astype(np.uint64) + np.uint64(2**62)])
    names = pa.array([NAMES[i] for i in rng.integers(0, buckets, n)])
    counts = rng.integers(1, 5, n) if captions else None
    return DatasetSamples(ids[:n], names, counts, f"dataset{seed}")


def expected_per_epoch(rule: MixRule, sizes: list[int]) -> list[int]:
    """The README's rule, computed independently (Fractions, no numpy)."""
    if rule.kind == "repeats":
        return [math.floor(r * n + Fraction(1, 2)) for r, n in zip(rule.values, sizes)]
    total, whole = sum(sizes), sum(rule.values)
    exact = [total * w / whole for w in rule.values]
    out = [math.floor(e) for e in exact]
    for i in sorted(range(len(exact)), key=lambda i: (-(exact[i] - out[i]), i))[: total - sum(out)]:
        out[i] += 1
    return out


fractions = st.fractions(min_value=Fraction(1, 10), max_value=Fraction(7, 2), max_denominator=20)


@pytest.mark.parametrize("shuffle", SHUFFLES)
@SETTINGS
@given(
    sizes=st.lists(st.integers(1, 60), min_size=1, max_size=4),
    kind=st.sampled_from(["weights", "repeats"]),
    values=st.lists(fractions, min_size=4, max_size=4),
    buckets=st.integers(1, 4),
    world=st.integers(1, 4),
    batch=st.integers(1, 3),
    leftover=st.sampled_from(["drop", "pad"]),
    grad_accum=st.integers(1, 2),
    epoch=st.integers(0, 5),
    shared=st.integers(0, 3),
    max_tokens=st.sampled_from([None, 40, 100]),  # packing mode: per-bucket batches (tokens 16, 16, 16, 18)
)
def test_mixture_counts_follow_the_rule_and_ranks_are_disjoint(shuffle, sizes, kind, values, buckets, world, batch,
                                                               leftover, grad_accum, epoch, shared,
                                                               max_tokens):  # fmt: skip
    rule = MixRule(kind, tuple(values[: len(sizes)]))
    if any(k == 0 for k in expected_per_epoch(rule, sizes)):
        with pytest.raises(ValueError, match="0 samples per epoch"):
            mix_samples([make_dataset(n, buckets, d, min(shared, n)) for d, n in enumerate(sizes)], rule)
        return
    datasets = [make_dataset(n, buckets, d, min(shared, n), captions=d == 0) for d, n in enumerate(sizes)]
    mix = mix_samples(datasets, rule)
    assert mix.per_epoch.tolist() == expected_per_epoch(rule, sizes)
    assert mix.slots.sum(axis=0).tolist() == mix.per_epoch.tolist()
    share = mix.per_epoch[None, :] * mix.strata / np.maximum(mix.strata.sum(axis=0), 1)[None, :]
    assert np.all(np.abs(mix.slots - share) < 1)  # per bucket: proportional, off by less than one
    config = PlanConfig(world_size=world, batch_size=batch, seed=3, leftover=leftover, grad_accum=grad_accum,
                        max_tokens=max_tokens, shuffle=shuffle)  # fmt: skip
    try:
        schedule = mix_epoch(mix, config, epoch)
    except ValueError as e:
        assert "nothing to train" in str(e)
        return
    assert np.array_equal(mix_epoch(mix, config, epoch).ids, schedule.ids)  # deterministic
    assert schedule.steps == mix_epoch(mix, config, epoch + 1).steps  # every epoch has the same steps

    # disjoint ranks: the ranks' rows together are the epoch's (dataset, id) multiset, slot for slot
    tables = [rank_table(schedule, world, r).to_pydict() for r in range(world)]
    assert all(len(t["step"]) == schedule.steps for t in tables)
    pairs: Counter = Counter()
    for t in tables:
        assert t["bucket"] == tables[0]["bucket"]
        for ids, sets in zip(t["sample_ids"], t.get("dataset") or [[0] * len(i) for i in t["sample_ids"]]):
            pairs.update(zip(sets, ids))
    sets = schedule.datasets if schedule.datasets is not None else np.zeros(len(schedule.ids), np.uint8)
    assert pairs == Counter(zip(sets.tolist(), schedule.ids.tolist()))
    assert ("dataset" in tables[0]) == (len(sizes) > 1)

    # multiplicity per (dataset, bucket): floor(k/n) or ceil(k/n), exactly k in all, before leftovers
    index = {(d, i): b for d, ds in enumerate(datasets) for i, b in zip(ds.ids.tolist(), ds.buckets.to_pylist())}
    per_stratum: Counter = Counter()
    for (d, i), times in pairs.items():
        b = mix.names.index(index[(d, i)])
        n, k = int(mix.strata[b, d]), int(mix.slots[b, d])
        per_stratum[(b, d)] += times
        if leftover == "drop":
            assert times <= -(-k // n)
    if not schedule.padded.any() and not schedule.dropped.any():  # no leftover: exactly the rule's counts
        assert {s: c for s, c in per_stratum.items()} == {(b, d): int(mix.slots[b, d]) for b in range(len(mix.names))
                                                          for d in range(len(sizes)) if mix.slots[b, d]}
        for (d, i), times in pairs.items():
            b = mix.names.index(index[(d, i)])
            assert times in (mix.slots[b, d] // mix.strata[b, d], -(-mix.slots[b, d] // mix.strata[b, d]))
    assert schedule.dataset_counts.tolist() == [sum(c for (d, _), c in pairs.items() if d == x)
                                                for x in range(len(sizes))]  # fmt: skip
    # the caption choice: in range, a pure function of (seed, epoch, dataset, id)
    if schedule.captions is not None:
        counts = {(0, i): c for i, c in zip(datasets[0].ids.tolist(), datasets[0].caption_counts.tolist())}
        want = [counts.get((d, i), 1) for d, i in zip(sets.tolist(), schedule.ids.tolist())]
        assert np.all(schedule.captions < np.asarray(want))
        again = caption_choice(3, epoch, schedule.ids, schedule.datasets, np.asarray(want))
        assert np.array_equal(again, schedule.captions)


@pytest.mark.parametrize("shuffle", SHUFFLES)
@SETTINGS
@given(counts=st.lists(st.integers(1, 50), min_size=1, max_size=4), world=st.integers(1, 4),
       epoch=st.integers(0, 3))  # fmt: skip
def test_one_dataset_repeated_once_is_the_one_manifest_schedule(shuffle, counts, world, epoch):
    rng = np.random.default_rng(len(counts))
    ids = rng.choice(2**62, size=sum(counts), replace=False).astype(np.uint64)
    buckets = pa.array(np.repeat(np.asarray(NAMES[: len(counts)]), counts).tolist())
    config = PlanConfig(shuffle=shuffle, world_size=world, batch_size=1, seed=1, leftover="pad")
    one = plan_epoch(group_samples(ids, buckets), config, epoch)
    mixed = mix_epoch(mix_samples([DatasetSamples(ids, buckets)], MixRule("repeats", (Fraction(1),))), config, epoch)
    assert np.array_equal(one.ids, mixed.ids) and np.array_equal(one.step_buckets, mixed.step_buckets)


def test_caption_choice_varies_across_epochs_and_datasets():
    ids = np.arange(1000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    counts = np.full(1000, 4)
    e0 = caption_choice(0, 0, ids, None, counts)
    assert np.array_equal(e0, caption_choice(0, 0, ids, np.zeros(1000, np.uint8), counts))  # dataset 0 = none
    assert set(e0.tolist()) == {0, 1, 2, 3} and 200 < np.sum(e0 == 0) < 300  # uniform
    assert np.mean(e0 != caption_choice(0, 1, ids, None, counts)) > 0.6  # another epoch, another caption
    assert np.mean(e0 != caption_choice(0, 0, ids, np.ones(1000, np.uint8), counts)) > 0.6  # another dataset
    assert not caption_choice(0, 0, ids, None, np.ones(1000)).any()


# ---------------------------------------------------------------- files, CLI, check, extend, resume


@pytest.fixture(scope="module")
def manifests(tmp_path_factory) -> list[str]:
    """Three manifests (600, 150, 12 images; the first 12 images are in all three, the same ids); the
    second has caption lists."""
    base = tmp_path_factory.mktemp("mix")
    urls = []
    for d, n in enumerate((600, 150, 12)):
        samples, errors = manifest_tables(n, seed=d)
        if d == 1:
            lists = [[f"caption {i} {v}" for v in "abc"][: 1 + i % 3] for i in range(samples.num_rows)]
            samples = samples.set_column(samples.schema.get_field_index("captions"), "captions",
                                         pa.array(lists, pa.list_(pa.string())))  # fmt: skip
        url = str(base / f"m{d}")
        write_manifest(url, samples, errors, source=f"/data{d}", spec=BucketSpec(area=512 * 512))
        urls.append(url)
    return urls


def mix_args(manifests: list[str], out: str, *extra: str) -> list[str]:
    return ["plan", *manifests, "--out", out, "--world-size", "4", "--batch-size", "2", "--seed", "5",
            "--epochs", "3", *extra]  # fmt: skip


def epoch_pairs(url: str, epoch: int) -> Counter:
    rows = read_plan_rows(url, [epoch]).table().to_pydict()
    return Counter(p for ids, sets in zip(rows["sample_ids"], rows["dataset"]) for p in zip(sets, ids))


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_cli_mixture_summary_check_extend(shuffle, manifests, tmp_path, capsys):
    whole, windowed = str(tmp_path / "whole"), str(tmp_path / "windowed")
    run(PlanJob(manifests=(*manifests,), out=whole, world_size=4, batch_size=2, seed=5, epochs=3,
                weights="0.6,0.3,0.1", shuffle=shuffle, progress=False))  # fmt: skip
    out = capsys.readouterr().out
    meta = read_plan_meta(whole)
    info = meta.mix.datasets
    n = [read_manifest(m).samples.num_rows for m in manifests]
    assert [d.samples for d in info] == n
    assert [d.per_epoch for d in info] == expected_per_epoch(MixRule.parse("weights", "0.6,0.3,0.1", 3), n)
    assert f"{n[2]} samples, weight 0.1 -> {info[2].per_epoch} per epoch " in out
    assert f"({round(info[2].per_epoch / n[2], 4):g} times each on average)" in out
    assert list(meta.columns) == ["dataset", "caption_index"]
    for e in meta.epochs:  # per dataset, per epoch: what the files hold
        pairs = epoch_pairs(whole, e.epoch)
        assert [sum(c for (d, _), c in pairs.items() if d == x) for x in range(3)] == list(e.datasets)
    assert run(PlanJob(manifests=(*manifests,), check=whole, progress=False)).exit_code == 0

    # --window then --extend: the same bytes as planned at once
    run(PlanJob(manifests=(*manifests,), out=windowed, world_size=4, batch_size=2, seed=5, epochs=3,
                weights="0.6,0.3,0.1", window=1, shuffle=shuffle, progress=False))  # fmt: skip
    run(PlanJob(shuffle=shuffle, manifests=(*manifests,), extend=windowed, progress=False))
    assert read_plan_meta(windowed).epochs == meta.epochs
    assert main(["plan", manifests[0], manifests[1], "--extend", windowed]) == 2  # other manifests: refused

    # one manifest with caption lists: the caption choice, no dataset column; the trainer's PlanStep carries it
    from train.data import rank_steps

    captioned = str(tmp_path / "captioned")
    run(PlanJob(manifests=(manifests[1],), out=captioned, world_size=2, batch_size=2, shuffle=shuffle,
                progress=False))
    assert list(read_plan_meta(captioned).columns) == ["caption_index"]
    assert run(PlanJob(manifests=(manifests[1],), check=captioned, progress=False)).exit_code == 0
    table = read_manifest(manifests[1]).samples
    counts = {i: len(c) for i, c in zip(table.column("sample_id").to_pylist(), table.column("captions").to_pylist())}
    steps = list(rank_steps(captioned, 1))
    assert all(s.dataset is None and len(s.caption_index) == len(s.sample_ids) for s in steps)
    chosen = np.concatenate([s.caption_index for s in steps])
    ids = np.concatenate([np.asarray(s.sample_ids, np.uint64) for s in steps])
    assert np.array_equal(chosen, caption_choice(0, 0, ids, None, np.asarray([counts[int(i)] for i in ids])))
    assert set(chosen.tolist()) == {0, 1, 2}
    assert main(["plan", "--check", whole, manifests[0]]) == 1  # a mixture checked against one of its manifests

    # a one-manifest plan without caption lists stays the plan it always was (no new column or field)
    one = str(tmp_path / "one")
    run(PlanJob(manifests=(manifests[0],), out=one, world_size=4, batch_size=2, shuffle=shuffle, progress=False))
    assert read_plan_meta(one).mix is None and read_plan_meta(one).columns is None
    assert read_plan_rows(one, [0]).table().column_names == ["epoch", "step", "rank", "bucket", "sample_ids"]
    assert main(["plan", "--check", one, manifests[0], manifests[1]]) == 2  # refused: a one-manifest plan


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_check_catches_a_tampered_mixture(shuffle, manifests, tmp_path):
    url = tmp_path / "p"
    run(PlanJob(manifests=(*manifests,), out=str(url), world_size=4, batch_size=2, seed=5, epochs=3,
                repeats="1,2,10", shuffle=shuffle, progress=False))  # fmt: skip
    loaded = [read_manifest(m) for m in manifests]
    assert check_plan(str(url), manifests=loaded) == []

    def other_dataset(table: pa.Table) -> pa.Table:  # move the first sample to another dataset
        rows = table.to_pydict()
        rows["dataset"][0][0] = (rows["dataset"][0][0] + 1) % 3
        return pa.Table.from_pydict(rows, schema=table.schema)

    _rewrite(url / epoch_part(1), 2, other_dataset)
    problems = check_plan(str(url), manifests=loaded)
    assert any("not in their dataset's manifest" in p or "another bucket" in p for p in problems), problems
    assert any("slots per dataset" in p for p in problems)
    assert any("sha256" in p for p in problems)
    assert main(["plan", "--check", str(url), *manifests]) == 1
    # without the manifests the counts still catch it
    assert any("slots per dataset" in p for p in check_plan(str(url)))


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_resume_of_a_mixture_is_exact(shuffle, manifests, tmp_path):
    url, out = str(tmp_path / "p"), str(tmp_path / "r")
    run(PlanJob(manifests=(*manifests,), out=url, world_size=4, batch_size=2, seed=5, epochs=3, repeats="0.5,1,3",
                leftover="pad", shuffle=shuffle, progress=False))  # fmt: skip
    meta = read_plan_meta(url)
    step = meta.steps_per_epoch // 3
    resumed = resume_plan(url, out, epoch=1, step=step, world_size=2)
    assert resumed.columns == meta.columns
    before = read_plan_rows(url, [1]).table().to_pydict()
    consumed = Counter(p for s, ids, sets in zip(before["step"], before["sample_ids"], before["dataset"])
                       if s < step for p in zip(sets, ids))  # fmt: skip
    assert consumed + epoch_pairs(out, 1) == epoch_pairs(url, 1)  # nothing seen twice, nothing skipped
    assert check_plan(out) == []
    # the caption chosen for each remaining slot is the parent's
    def triples(rows, first):
        return Counter(t for s, ids, sets, caps in zip(rows["step"], rows["sample_ids"], rows["dataset"],
                                                       rows["caption_index"]) if s >= first
                       for t in zip(sets, ids, caps))  # fmt: skip

    assert triples(read_plan_rows(out, [1]).table().to_pydict(), step) == triples(before, step)


def test_bad_mixture_inputs_are_one_clear_line(manifests, tmp_path, capsys):
    out = str(tmp_path / "p")
    bad = [
        mix_args([manifests[0], manifests[0]], out),  # the same manifest twice
        mix_args(manifests, out, "--weights", "1,2"),  # one value short
        mix_args(manifests, out, "--weights", "1,0,1"),  # zero
        mix_args(manifests, out, "--weights", "1,1,1", "--repeats", "1,1,1"),
        mix_args(manifests, out, "--repeats", "1,1,x"),
        mix_args(manifests, out, "--repeats", "1,1,0.01"),  # 12 * 0.01 rounds to 0
        mix_args(manifests, out, "--cache", "a,b"),  # not one cache per manifest
    ]
    for argv in bad:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
    assert not Path(out, "_plan.json").exists()


def test_plan_json_records_the_mixture(manifests, tmp_path):
    url = str(tmp_path / "p")
    run(PlanJob(manifests=(*manifests,), out=url, world_size=4, batch_size=2, seed=5, epochs=3, weights="6,3,1",
                json=True, progress=False))  # fmt: skip
    meta = read_plan_meta(url)
    assert list(meta.inputs.mix.values) == ["6", "3", "1"]
    assert [d.share for d in meta.mix.datasets] == [0.6, 0.3, 0.1]
    per_bucket = Counter()
    for d in meta.mix.datasets:
        assert sum(b.per_epoch for b in d.buckets.values()) == d.per_epoch
        per_bucket.update({n: b.per_epoch for n, b in d.buckets.items()})
    assert dict(per_bucket) == {n: b.samples for n, b in meta.buckets.items()}
    assert list(meta.counts.per_dataset) == [sum(e.datasets[d] for e in meta.epochs) for d in range(3)]


def test_report_shows_the_mixture_per_dataset(manifests, tmp_path):
    pytest.importorskip("matplotlib")
    from pipeline.report.job import write_report

    url = str(tmp_path / "p")
    run(PlanJob(manifests=(*manifests,), out=url, world_size=4, batch_size=2, seed=5, epochs=3,
                weights="0.6,0.3,0.1", progress=False))  # fmt: skip
    html = write_report(manifests[2], str(tmp_path / "r.html"), plan=url)[0]
    page = Path(html).read_text()
    info = read_plan_meta(url).mix.datasets[2]
    assert "this manifest is dataset 2 of 3" in page
    assert f"{info.samples} samples, weight 0.1 -&gt; {info.per_epoch} per epoch" in page or \
        f"{info.samples} samples, weight 0.1 -> {info.per_epoch} per epoch" in page
    assert "per bucket (samples -&gt; per epoch)" in page or "per bucket (samples -> per epoch)" in page
