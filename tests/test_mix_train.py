"""A 3-manifest plan trained on two real processes (accelerate launch, gloo on the CPU), consumption checked
against the plan per (dataset, sample id); the loader reads each sample from its dataset's cache.

The three manifests are overlapping subsets of the session's tiny dataset (some images are in two
datasets: the same sample id, two samples); their caches are copies of the session's cache.
"""

from __future__ import annotations

import shutil
from collections import Counter

import pyarrow as pa
import pytest

from manifests.manifest import read_manifest, write_manifest
from manifests.plan import read_plan_meta, read_rank_plan
from pipeline.cli import main
from tests.test_train import records, write_config
from tests.test_train_dist import launch
from tests.train_dataset import SPEC, train_data  # noqa: F401  (session fixture)

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.ray, pytest.mark.full]

SUBSETS = (range(0, 24), range(16, 32), range(28, 40))  # rows of the session manifest; 16..23 and 28..31 shared


@pytest.fixture(scope="module")
def mixture(train_data, tmp_path_factory):
    """Three manifests, a cache for each, and a 2-rank plan with --repeats 1,2,0.5 (one epoch)."""
    base = tmp_path_factory.mktemp("mix-train")
    source = read_manifest(train_data.manifest)
    samples = source.samples.sort_by("filename")
    manifests, caches = [], []
    for d, rows in enumerate(SUBSETS):
        url = str(base / f"m{d}")
        write_manifest(url, samples.take(pa.array(list(rows))), source.errors, source=train_data.root, spec=SPEC)
        manifests.append(url)
        caches.append(str(base / f"c{d}"))
        shutil.copytree(train_data.cache, caches[-1])
    plan = str(base / "plan")
    assert main(["plan", *manifests, "--out", plan, "--cache", ",".join(caches), "--repeats", "1,2,0.5",
                 "--world-size", "2", "--batch-size", "2", "--epochs", "1", "--seed", "4"]) == 0  # fmt: skip
    assert main(["plan", "--check", plan, *manifests, "--cache", ",".join(caches)]) == 0
    return manifests, caches, plan


def test_two_processes_train_on_exactly_the_mixture_planned(mixture, tmp_path):
    manifests, caches, plan = mixture
    config = write_config(tmp_path / "c.yaml", checkpoint_every=1000, log_every=100)
    out = tmp_path / "out"
    launch(2, "--plan", plan, "--cache", ",".join(caches), "--config", config, "--output-dir", out,
           "--record-samples", out / "rec")  # fmt: skip
    meta = read_plan_meta(plan)
    for rank in (0, 1):
        planned = [(r["epoch"], r["step"], r["sample_ids"], r["dataset"])
                   for r in read_rank_plan(plan, rank).to_pylist()]  # fmt: skip
        got = [(r["epoch"], r["step"], r["sample_ids"], r["datasets"]) for r in records(out / "rec", rank)]
        assert got == planned
    for e in meta.epochs:
        pairs = Counter(p for rank in (0, 1) for r in records(out / "rec", rank) if r["epoch"] == e.epoch
                        for p in zip(r["datasets"], r["sample_ids"]))  # fmt: skip
        assert [sum(c for (d, _), c in pairs.items() if d == x) for x in range(3)] == list(e.datasets)
        ids = {d: set(read_manifest(m).samples.column("sample_id").to_pylist()) for d, m in enumerate(manifests)}
        assert all(i in ids[d] for d, i in pairs)  # every (dataset, id) is a sample of that dataset
        as_0, as_1 = ({i for d, i in pairs if d == x} for x in (0, 1))
        assert as_0 & as_1  # an image of two datasets is two samples, trained as both


def test_the_loader_reads_each_sample_from_its_datasets_cache(mixture):
    from manifests.cache import CacheReader
    from train.data import BatchLoader, rank_steps

    _, caches, plan = mixture
    readers = [CacheReader(c) for c in caches]
    asked: list[tuple[int, list[int]]] = []
    for d, reader in enumerate(readers):
        original = reader.read

        def read(ids, d=d, original=original):
            asked.append((d, list(ids)))
            return original(ids)

        reader.read = read
    steps = list(rank_steps(plan, 0))
    batches = list(BatchLoader(readers, steps, readers[0].meta.latent, read_threads=1, prefetch=1))
    assert [b.sample_ids for b in batches] == [list(s.sample_ids) for s in steps]
    assert [b.datasets for b in batches] == [s.dataset.tolist() for s in steps]
    wanted = Counter((int(d), i) for s in steps for d, i in zip(s.dataset, s.sample_ids))
    assert Counter((d, i) for d, ids in asked for i in ids) == wanted  # each from its own dataset's cache, once
    assert all(s.caption_index is None for s in steps)  # no caption lists in these manifests
