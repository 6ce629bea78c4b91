"""Plan IO, the CLI, --check, elastic resume on storage, and the S3 round trip."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from manifests.buckets import BucketSpec
from manifests.manifest import read_manifest, write_manifest
from manifests.plan import (
    PLAN_FILE,
    DatasetSamples,
    PLAN_SCHEMA,
    PlanConfig,
    PlanError,
    epoch_part,
    read_plan_meta,
    read_plan_rows,
    read_rank_plan,
    resume_plan,
    write_plan,
)
from manifests.plan.check import check_plan
from manifests.plan.schedule import cached_mask
from pipeline import PlanJob, run
from pipeline.cli import main
from tests.factories import manifest_tables
from tests.test_plan_properties import SHUFFLES


@pytest.fixture(scope="module")
def manifest_url(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("m") / "manifest")
    write_manifest(url, *manifest_tables(600, seed=1), source="/data", spec=BucketSpec(area=512 * 512))
    return url


def plan_args(manifest: str, out: str, *extra: str) -> list[str]:
    return [
        "plan",
        manifest,
        "--out",
        out,
        "--world-size",
        "4",
        "--batch-size",
        "2",
        "--seed",
        "5",
        "--epochs",
        "3",
        *extra,
    ]


def all_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def epoch_ids(url: str, epoch: int, storage_options=None, steps: slice = slice(None)) -> Counter:
    out: Counter = Counter()
    for t in read_plan_rows(url, [epoch], storage_options=storage_options).ranks(epoch):
        for batch in t.column("sample_ids").to_pylist()[steps]:
            out.update(batch)
    return out


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_plans_checks_and_is_byte_identical(shuffle, manifest_url, tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run(PlanJob(manifests=(manifest_url,), out=a, world_size=4, batch_size=2, seed=5, epochs=3, leftover="pad",
                grad_accum=2, shuffle=shuffle, progress=False))  # fmt: skip
    out = capsys.readouterr().out
    assert "per epoch" in out and "padded" in out and "fingerprint" in out
    run(PlanJob(manifests=(manifest_url,), out=b, world_size=4, batch_size=2, seed=5, epochs=3, leftover="pad",
                grad_accum=2, shuffle=shuffle, progress=False))  # fmt: skip
    files_a, files_b = all_files(Path(a)), all_files(Path(b))
    assert files_a == files_b  # same inputs, same bytes (the _plan.json too: no timestamps)
    assert len(files_a) == 1 + 3  # _plan.json + a file per epoch (a row group per rank in it)
    meta = read_plan_meta(a)
    assert meta.inputs.manifest_fingerprint == read_manifest(manifest_url).fingerprint
    assert meta.steps_per_epoch % 2 == 0 and meta.counts.padded > 0
    assert sum(meta.counts.padded_per_bucket.values()) == meta.counts.padded
    for path in files_a:
        if path.endswith(".parquet"):
            assert pq.read_schema(Path(a) / path).names == PLAN_SCHEMA.names
    assert run(PlanJob(manifests=(manifest_url,), check=a, progress=False)).exit_code == 0
    assert "ok" in capsys.readouterr().out


def test_cli_argv_becomes_the_job_and_its_exit_code(manifest_url, tmp_path, capsys):
    from pipeline.cli import build_parser
    from pipeline.plan import job_from_args

    def job(*argv: str) -> PlanJob:
        return job_from_args(build_parser("plan").parse_args(["plan", *argv]))

    assert job("m1", "m2", "--out", "p", "--world-size", "2", "--batch-size", "4", "--cache", "c1,c2", "--weights",
               "1,2", "--storage-options", '{"anon": true}') == PlanJob(
        manifests=("m1", "m2"), out="p", world_size=2, batch_size=4, cache=("c1", "c2"), weights="1,2",
        storage_options={"anon": True})  # fmt: skip
    resume = job("--resume", "p", "--at", "3:12", "--world-size", "2", "--out", "q")
    assert resume.mode == "resume" and resume.at == (3, 12)
    assert job("m", "--extend", "p", "--epochs", "4").mode == "extend"
    assert main(["plan", "m", "--world-size", "2", "--batch-size", "2"]) == 2
    assert "--out PLAN is required" in capsys.readouterr().err
    assert main(["plan", "m", "--out", "p", "--world-size", "2", "--batch-size", "2", "--cache", "a,b"]) == 2
    assert "--cache names 2 caches for 1 manifests" in capsys.readouterr().err
    url = str(tmp_path / "p")
    assert main(plan_args(manifest_url, url)) == 0
    assert "fingerprint:" in capsys.readouterr().out
    assert main(["plan", "--check", url, manifest_url]) == 0


def test_shuffle_option_is_recorded_and_kept_by_extend(manifest_url, tmp_path, capsys):
    full, window = str(tmp_path / "full"), str(tmp_path / "window")
    assert main(plan_args(manifest_url, full)) == 0
    assert main(plan_args(manifest_url, window, "--shuffle", "window", "--window", "1")) == 0
    assert read_plan_meta(full).inputs.shuffle is None  # the full shuffle's _plan.json is the one of before
    assert "shuffle" not in json.loads((Path(full) / "_plan.json").read_text())["inputs"]
    assert read_plan_meta(window).inputs.config.window == 256  # `window` alone: the default size, recorded
    assert sum(epoch_ids(full, 0).values()) == sum(epoch_ids(window, 0).values()) != 0
    assert all_files(Path(full))[epoch_part(0)] != all_files(Path(window))[epoch_part(0)]  # another order
    capsys.readouterr()
    assert main(["plan", manifest_url, "--extend", window, "--shuffle", "full"]) == 2  # not the plan's shuffle
    assert "--shuffle full differs from the plan's window:256" in capsys.readouterr().err
    assert main(["plan", manifest_url, "--extend", window, "--shuffle", "window:256"]) == 0
    assert main(["plan", "--check", window, manifest_url]) == 0
    assert main(plan_args(manifest_url, window, "--shuffle", "window:0")) == 2
    assert "--shuffle must be full, window or window:SIZE" in capsys.readouterr().err


def test_epochs_differ_and_rows_are_sorted(manifest_url, tmp_path):
    url = str(tmp_path / "p")
    run(PlanJob(manifests=(manifest_url,), out=url, world_size=4, batch_size=2, seed=5, epochs=3, progress=False))
    rows = read_rank_plan(url, 2)
    assert rows.schema.equals(PLAN_SCHEMA)
    d = rows.to_pydict()
    meta = read_plan_meta(url)
    steps = meta.steps_per_epoch
    assert d["epoch"] == [e for e in range(3) for _ in range(steps)]
    assert d["step"] == list(range(steps)) * 3 and set(d["rank"]) == {2}
    assert d["sample_ids"][:steps] != d["sample_ids"][steps : 2 * steps]
    assert read_rank_plan(url, 2, epoch=1).to_pydict()["sample_ids"] == d["sample_ids"][steps : 2 * steps]
    # drop: the ranks' samples are disjoint within an epoch
    seen = epoch_ids(url, 0)
    assert max(seen.values()) == 1
    assert sum(seen.values()) + meta.epochs[0].dropped_total == meta.samples.planned


def test_a_rank_reads_only_its_own_row_groups(manifest_url, tmp_path):
    url = tmp_path / "p"
    run(PlanJob(manifests=(manifest_url,), out=str(url), world_size=4, batch_size=2, seed=5, epochs=3, progress=False))
    expected = read_rank_plan(str(url), 1)
    # overwrite every byte but rank 1's row groups and the footers: rank 1 must read exactly the same rows
    only = tmp_path / "only"
    shutil.copytree(url, only)
    for path in only.glob("epoch-*.parquet"):
        data = bytearray(path.read_bytes())
        metadata = pq.read_metadata(path)
        group = metadata.row_group(1)
        columns = [group.column(c) for c in range(group.num_columns)]
        start = min(c.dictionary_page_offset or c.data_page_offset for c in columns)
        end = max((c.dictionary_page_offset or c.data_page_offset) + c.total_compressed_size for c in columns)
        footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
        for i in [*range(4, start), *range(end, footer)]:
            data[i] = 0xAB
        path.write_bytes(bytes(data))
    with pytest.raises(PlanError, match="epoch-00000.parquet does not hash to the sha256"):  # edited: refused
        read_rank_plan(str(only), 1)
    # as if planned so (the sha256s recorded): rank 1 decodes only its row groups, the rest is only hashed
    meta = json.loads((only / PLAN_FILE).read_text())
    for entry in meta["epochs"]:
        entry["sha256"] = hashlib.sha256((only / epoch_part(entry["epoch"])).read_bytes()).hexdigest()
    (only / PLAN_FILE).write_text(json.dumps(meta))
    assert read_rank_plan(str(only), 1).equals(expected)
    with pytest.raises(PlanError, match="rank 0"):
        read_rank_plan(str(only), 0)


def test_unreadable_plans_are_refused(tmp_path, manifest_url):
    with pytest.raises(PlanError, match="no _plan.json"):
        read_rank_plan(str(tmp_path), 0)
    url = str(tmp_path / "p")
    run(PlanJob(manifests=(manifest_url,), out=url, world_size=4, batch_size=2, seed=5, epochs=3, progress=False))
    with pytest.raises(PlanError, match="outside"):
        read_rank_plan(url, 4)
    with pytest.raises(PlanError, match="no epoch 7"):
        read_rank_plan(url, 0, epoch=7)
    meta = json.loads((tmp_path / "p" / PLAN_FILE).read_text())
    (tmp_path / "p" / PLAN_FILE).write_text(json.dumps(dict(meta, format_version=99)))
    with pytest.raises(PlanError, match="format version 99"):
        read_plan_meta(url)


def test_one_reader_gives_rows_of_epochs_ranks_and_columns(manifest_url, tmp_path):
    root = tmp_path / "p"
    url = str(root)
    run(PlanJob(manifests=(manifest_url,), out=url, world_size=4, batch_size=2, seed=5, epochs=3, progress=False))
    meta = read_plan_meta(url)
    some = read_plan_rows(url, [1], [0, 2], columns=["step", "sample_ids"])
    assert set(some.tables) == {(1, 0), (1, 2)} and some.tables[(1, 2)].column_names == ["step", "sample_ids"]
    assert some.tables[(1, 2)].column("sample_ids").equals(read_rank_plan(url, 2, epoch=1).column("sample_ids"))
    assert some.sha256 == {}  # an epoch's digest needs every rank's part
    assert read_plan_rows(url, [1]).sha256 == {1: meta.epochs[1].sha256}
    with pytest.raises(PlanError, match="not plan columns"):
        read_plan_rows(url, columns=["bucket", "weight"])

    # a missing file and one that is not parquet: problems of the result, raised on use, reported by --check
    (root / epoch_part(2)).unlink()
    (root / epoch_part(0)).write_bytes(b"not parquet")
    rows = read_plan_rows(url)
    assert set(rows.problems) == {2, 0} and set(rows.sha256) == {1}
    with pytest.raises(PlanError, match="epoch 0: epoch-00000.parquet is not parquet"):
        rows.table()
    with pytest.raises(PlanError, match="epoch 2: epoch-00002.parquet named by _plan.json is missing"):
        read_rank_plan(url, 1, epoch=2)
    problems = check_plan(url)
    assert any(p.startswith("epoch 2: epoch-00002.parquet") and "missing" in p for p in problems)
    assert any(p.startswith("epoch 0: epoch-00000.parquet") and "not parquet" in p for p in problems)


def _rewrite(path: Path, rank: int, edit) -> None:
    """Rewrite an epoch file with ``edit(table)`` applied to rank ``rank``'s row group (still one per rank)."""
    parquet = pq.ParquetFile(path)
    groups = [parquet.read_row_group(r) for r in range(parquet.metadata.num_row_groups)]
    groups[rank] = edit(groups[rank])
    with pq.ParquetWriter(path, groups[rank].schema) as writer:
        for group in groups:
            writer.write_table(group.select(groups[rank].schema.names))


def test_check_catches_a_duplicated_sample(manifest_url, tmp_path):
    url = tmp_path / "p"
    run(PlanJob(manifests=(manifest_url,), out=str(url), world_size=4, batch_size=2, seed=5, epochs=3, progress=False))
    assert check_plan(str(url), manifests=[read_manifest(manifest_url)]) == []

    def repeat(table: pa.Table) -> pa.Table:
        rows = table.to_pydict()
        rows["sample_ids"][0] = [rows["sample_ids"][0][0]] * len(rows["sample_ids"][0])  # same bucket, a repeat
        return pa.Table.from_pydict(rows, schema=PLAN_SCHEMA)

    _rewrite(url / epoch_part(0), 0, repeat)
    problems = check_plan(str(url), manifests=[read_manifest(manifest_url)])
    assert any("repeated samples" in p for p in problems)
    assert any("sha256" in p for p in problems)
    assert main(["plan", "--check", str(url), manifest_url]) == 1


def test_check_catches_unequal_steps_and_missing_columns(manifest_url, tmp_path):
    url = tmp_path / "p"
    run(PlanJob(manifests=(manifest_url,), out=str(url), world_size=4, batch_size=2, seed=5, epochs=3, progress=False))
    _rewrite(url / epoch_part(1), 3, lambda t: t.slice(0, 5))
    problems = check_plan(str(url))
    assert any("epoch 1 rank 3" in p and "steps" in p for p in problems)
    with pytest.raises(PlanError, match="epoch 1: epoch-00001.parquet"):  # a rank reading its rows sees it too
        read_rank_plan(str(url), 1, epoch=1)
    _rewrite(url / epoch_part(2), 0, lambda t: t.drop_columns(["bucket"]))
    assert any("epoch 2: epoch-00002.parquet: columns" in p for p in check_plan(str(url)))


def test_check_catches_a_changed_manifest(tmp_path, capsys):
    murl = str(tmp_path / "m")
    write_manifest(murl, *manifest_tables(200, seed=2), source="/d", spec=BucketSpec(area=256 * 256))
    purl = str(tmp_path / "p")
    run(PlanJob(manifests=(murl,), out=purl, world_size=2, batch_size=2, progress=False))
    write_manifest(murl, *manifest_tables(210, seed=2), source="/d", spec=BucketSpec(area=256 * 256))
    capsys.readouterr()
    assert main(["plan", "--check", purl, murl]) == 1
    out = capsys.readouterr().out
    assert "manifest fingerprint mismatch" in out and "re-run `bucketeer plan`" in out


def test_bad_inputs_are_one_clear_line(tmp_path, manifest_url, capsys):
    out = str(tmp_path / "p")
    assert main(["plan", manifest_url, "--out", out, "--world-size", "0", "--batch-size", "2"]) == 2
    assert "--world-size must be >= 1" in capsys.readouterr().err
    assert main(["plan", manifest_url, "--out", out, "--world-size", "64", "--batch-size", "32"]) == 2
    err = capsys.readouterr().err
    assert "nothing to train" in err and "--leftover pad" in err and "Traceback" not in err
    assert not (tmp_path / "p" / PLAN_FILE).exists()
    # a manifest whose bucket column holds a name that is not WxH
    samples, errors = manifest_tables(20)
    samples = samples.set_column(
        samples.schema.get_field_index("bucket"), "bucket", pa.array(["square"] * 20, pa.string())
    )
    bad = str(tmp_path / "bad")
    write_manifest(bad, samples, errors, source="/d", spec=BucketSpec())
    assert main(["plan", bad, "--out", out, "--world-size", "1", "--batch-size", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown bucket 'square'" in err and bad in err
    assert main(["plan", manifest_url, "--out", out, "--world-size", "1", "--max-tokens", "10"]) == 2
    assert "raise --max-tokens" in capsys.readouterr().err


def test_packing_mode_summary_and_check(tmp_path, capsys):
    # buckets of three areas: 512x512 (1024 tokens), 768x1024 / 1024x768 (3072), 1024x1024 (4096)
    spec = BucketSpec(buckets=((512, 512), (768, 1024), (1024, 768), (1024, 1024)), no_upscale=False)
    manifest_url = str(tmp_path / "m")
    write_manifest(manifest_url, *manifest_tables(300, seed=4, spec=spec), source="/d", spec=spec)
    url = str(tmp_path / "p")
    run(PlanJob(manifests=(manifest_url,), out=url, world_size=2, max_tokens=4096, leftover="pad", epochs=2,
                progress=False))  # fmt: skip
    out = capsys.readouterr().out
    assert "tokens:   per rank per step min" in out
    meta = read_plan_meta(url)
    assert meta.mode == "packing" and meta.inputs.latent_factor == 8 and meta.inputs.patch_size == 2
    assert meta.tokens_per_step.max <= 4096
    sizes = {n: b.batch_size for n, b in meta.buckets.items()}
    assert sizes == {"512x512": 4, "768x1024": 1, "1024x768": 1, "1024x1024": 1}  # small images, bigger batches
    r0, r1 = read_rank_plan(url, 0).to_pydict(), read_rank_plan(url, 1).to_pydict()
    assert r0["bucket"] == r1["bucket"]
    assert [len(b) for b in r0["sample_ids"]] == [len(b) for b in r1["sample_ids"]] == [sizes[b] for b in r0["bucket"]]
    assert check_plan(url, manifests=[read_manifest(manifest_url)]) == []


@pytest.mark.parametrize(
    "old_world,old_batch,new_world,leftover",
    [
        (4, 6, 2, "drop"),
        (4, 6, 8, "pad"),
        (4, 6, 24, "drop"),
        (2, 4, 1, "pad"),
        (1, 8, 8, "drop"),
        (3, 2, 6, "pad"),
    ],
)
def test_elastic_resume_union_is_exact(manifest_url, tmp_path, old_world, old_batch, new_world, leftover):
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    run(PlanJob(manifests=(manifest_url,), out=old, world_size=old_world, batch_size=old_batch, epochs=3,
                leftover=leftover, seed=11, progress=False))  # fmt: skip
    steps = read_plan_meta(old).steps_per_epoch
    at = steps // 3
    meta = resume_plan(old, new, epoch=1, step=at, world_size=new_world)
    assert meta.inputs.world_size == new_world
    assert meta.inputs.batch_size * new_world == old_world * old_batch
    assert [e.epoch for e in meta.epochs] == [1, 2] and meta.epochs[0].first_step == at
    consumed = epoch_ids(old, 1, steps=slice(0, at))
    rest = epoch_ids(new, 1)
    assert consumed + rest == epoch_ids(old, 1)  # exactly the epoch: no replay, no skip
    if leftover == "drop":
        assert not set(consumed) & set(rest)
    rows = read_rank_plan(new, new_world - 1, epoch=1).to_pydict()
    assert rows["step"] == list(range(at, steps))
    # a later epoch is what a fresh plan for (N2, B2) gives
    fresh = str(tmp_path / "fresh")
    run(PlanJob(manifests=(manifest_url,), out=fresh, world_size=new_world, batch_size=meta.inputs.batch_size,
                epochs=3, leftover=leftover, seed=11, progress=False))  # fmt: skip
    for r in range(new_world):
        assert read_rank_plan(new, r, epoch=2).equals(read_rank_plan(fresh, r, epoch=2))
    assert check_plan(new, manifests=[read_manifest(manifest_url)]) == []


def test_resume_refuses_what_it_cannot_do(manifest_url, tmp_path):
    old = str(tmp_path / "old")
    run(PlanJob(manifests=(manifest_url,), out=old, world_size=4, batch_size=2, seed=5, epochs=3,
                progress=False))  # global batch 8
    with pytest.raises(ValueError, match="is the plan being resumed"):
        resume_plan(old, old, epoch=0, step=1, world_size=2)
    assert read_plan_meta(old)  # and it is untouched
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        resume_plan(old, str(tmp_path / "n"), epoch=0, step=1, world_size=3)
    with pytest.raises(ValueError, match="use batch size 4"):
        resume_plan(old, str(tmp_path / "n"), epoch=0, step=1, world_size=2, batch_size=3)
    steps = read_plan_meta(old).steps_per_epoch
    with pytest.raises(PlanError, match="outside epoch"):
        resume_plan(old, str(tmp_path / "n"), epoch=0, step=steps + 1, world_size=2)
    with pytest.raises(PlanError, match="nothing is left"):
        resume_plan(old, str(tmp_path / "n"), epoch=2, step=steps, world_size=2)
    # the end of an epoch resumes at the start of the next
    meta = resume_plan(old, str(tmp_path / "n"), epoch=0, step=steps, world_size=2)
    assert [e.epoch for e in meta.epochs] == [1, 2] and meta.epochs[0].first_step == 0


def test_cli_resume(manifest_url, tmp_path, capsys):
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    run(PlanJob(manifests=(manifest_url,), out=old, world_size=4, batch_size=2, seed=5, epochs=3, progress=False))
    run(PlanJob(resume=old, at=(1, 3), world_size=8, out=new, progress=False))
    assert "resumed at epoch 1 step 3" in capsys.readouterr().out
    assert read_plan_meta(new).resumed_from.world_size == 4
    assert main(["plan", "--resume", old, "--at", "one", "--world-size", "8", "--out", new]) == 2
    assert "--at must be EPOCH:STEP" in capsys.readouterr().err


def test_cache_filter_keeps_only_cached_samples(manifest_url, tmp_path):
    manifest = read_manifest(manifest_url)
    ids = manifest.samples.column("sample_id").to_numpy()
    available = set(ids[::3].tolist()) | {12345}  # a good record for every third sample (+ a stranger)
    keep = cached_mask(ids, available)
    assert keep.sum() == len(ids[::3]) and np.array_equal(np.flatnonzero(keep), np.arange(0, len(ids), 3))
    assert cached_mask(ids, np.asarray(sorted(available), np.uint64)).tolist() == keep.tolist()
    url = str(tmp_path / "p")
    buckets = manifest.samples.column("bucket").filter(pa.array(keep))
    dataset = DatasetSamples(ids[keep], buckets, manifest_fingerprint=manifest.fingerprint,
                             cache_fingerprint="cache-fp", not_in_cache=int((~keep).sum()))
    meta = write_plan(url, [dataset], PlanConfig(world_size=2, batch_size=1, leftover="pad"))
    assert meta.inputs.cache_fingerprint == "cache-fp" and meta.samples.planned == keep.sum()
    planned = epoch_ids(url, 0)
    assert set(planned) == set(ids[keep].tolist())
    available_ids = np.asarray(sorted(available), np.uint64)
    assert check_plan(url, manifests=[manifest], available_ids=[available_ids], cache_fingerprints=["cache-fp"]) == []
    mismatch = check_plan(url, manifests=[manifest], cache_fingerprints=["other"])
    assert any("cache fingerprint mismatch" in p for p in mismatch)
    assert check_plan(url, manifests=[manifest]) == []  # without the cache: membership in the manifest only


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, ray_local, bucketeer_home) -> SimpleNamespace:
    """A real cache: tiny images (one undecodable) -> manifest -> `pipeline.embed` on local Ray.

    Embedding takes seconds on two cores, so the tests of this module share one.
    """
    from manifests.schema import sample_id
    from tests.embed_data import make_dataset, embed_cache

    base = tmp_path_factory.mktemp("embedded")
    root, manifest, cache = str(base / "data"), str(base / "manifest"), str(base / "cache")
    names = make_dataset(root, manifest, 10, broken=["zz_broken.jpg"])
    embed_cache(manifest, cache)
    return SimpleNamespace(root=root, manifest=manifest, cache=cache, names=names, broken=sample_id("zz_broken.jpg"))


def _all_planned(url: str) -> tuple[set[int], list[tuple[str, int]]]:
    ids, rows = set(), []
    for epoch in range(read_plan_meta(url).inputs.epochs):
        for t in read_plan_rows(url, [epoch]).ranks(epoch):
            for bucket, batch in zip(t.column("bucket").to_pylist(), t.column("sample_ids").to_pylist()):
                ids.update(batch)
                rows += [(bucket, i) for i in batch]
    return ids, rows


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.full
def test_plan_with_a_real_cache_end_to_end(embedded, tmp_path, capsys):
    from manifests.cache import CacheReader, available_sample_ids, read_cache_meta, read_index

    errors = read_index(embedded.cache)["errors"].column("sample_id").to_pylist()
    assert errors == [embedded.broken]  # the undecodable image is an error row of the cache
    url = str(tmp_path / "p")
    run(PlanJob(manifests=(embedded.manifest,), out=url, world_size=2, batch_size=1, epochs=2, leftover="pad",
                cache=(embedded.cache,), progress=False))  # fmt: skip
    assert "1 not in the cache (left out)" in capsys.readouterr().out
    meta = read_plan_meta(url)
    assert meta.inputs.cache_fingerprint == read_cache_meta(embedded.cache).fingerprint
    assert meta.samples.to_json() == {"planned": 10, "not_in_cache": 1, "stale": 0}
    planned, rows = _all_planned(url)
    good = available_sample_ids(embedded.cache, manifest=read_manifest(embedded.manifest))
    assert embedded.broken not in planned and planned == set(good.tolist()) and len(planned) == 10
    records = {r.sample_id: r for r in CacheReader(embedded.cache).read(sorted(planned))}
    assert all(records[i].bucket == bucket for bucket, i in rows)  # every planned id has a record of its bucket
    assert run(PlanJob(manifests=(embedded.manifest,), check=url, cache=(embedded.cache,),
                       progress=False)).exit_code == 0
    assert "ok" in capsys.readouterr().out

    # the same folder re-embedded with other settings is another cache: the plan no longer matches it
    from tests.embed_data import embed_cache

    other = str(tmp_path / "cache-fp32")
    embed_cache(embedded.manifest, other, dtype="fp32")
    assert read_cache_meta(other).fingerprint != meta.inputs.cache_fingerprint
    capsys.readouterr()
    assert main(["plan", "--check", url, embedded.manifest, "--cache", other]) == 1
    assert "cache fingerprint mismatch" in capsys.readouterr().out
    # without --cache the plan is still a sound plan of the manifest (membership only)
    assert run(PlanJob(manifests=(embedded.manifest,), check=url, progress=False)).exit_code == 0


@pytest.mark.ray
def test_plan_check_catches_a_cache_that_lost_records(embedded, tmp_path, capsys):
    # a plan made from the full cache, checked against the cache's samples minus one: the
    # per-bucket counts no longer match, so --check fails (the trainer would hit a missing record)
    from manifests.cache import available_sample_ids, read_cache_meta

    url = str(tmp_path / "p")
    run(PlanJob(manifests=(embedded.manifest,), out=url, world_size=1, batch_size=1, cache=(embedded.cache,),
                progress=False))  # fmt: skip
    manifest = read_manifest(embedded.manifest)
    fresh = available_sample_ids(embedded.cache, manifest=manifest)
    fp = read_cache_meta(embedded.cache).fingerprint
    assert check_plan(url, manifests=[manifest], available_ids=[fresh], cache_fingerprints=[fp]) == []
    problems = check_plan(url, manifests=[manifest], available_ids=[fresh[1:]], cache_fingerprints=[fp])
    assert any("differ from the manifest's (and cache's)" in p for p in problems)


def test_memory_round_trip_and_rewrite_removes_stale_parts():
    ids = np.arange(1, 401, dtype=np.uint64)
    buckets = ["512x512"] * 300 + ["640x384"] * 100
    url = "memory://plans/roundtrip"
    one = [DatasetSamples(ids, buckets, manifest_fingerprint="m")]
    write_plan(url, one, PlanConfig(world_size=4, batch_size=4, epochs=2))
    rows = read_rank_plan(url, 3)
    assert rows.num_rows == 2 * read_plan_meta(url).steps_per_epoch
    write_plan(url, one, PlanConfig(world_size=2, batch_size=4, epochs=1))
    import fsspec

    parts = [p for p in fsspec.filesystem("memory").find("/plans/roundtrip") if p.endswith(".parquet")]
    assert parts == ["/plans/roundtrip/epoch-00000.parquet"]  # the old plan's epoch 1 is gone
    assert check_plan(url) == []


@pytest.mark.s3
def test_s3_round_trip_resume_and_check(s3, manifest_url, tmp_path):
    url, local = s3.fresh_url("plan"), str(tmp_path / "local")
    opts = json.dumps(s3.storage_options)
    assert main(plan_args(manifest_url, url, "--storage-options", opts)) == 0
    run(PlanJob(manifests=(manifest_url,), out=local, world_size=4, batch_size=2, seed=5, epochs=3, progress=False))
    for r in range(4):
        assert read_rank_plan(url, r, s3.storage_options).equals(read_rank_plan(local, r))
    assert read_plan_meta(url, s3.storage_options).fingerprint == read_plan_meta(local).fingerprint
    new = s3.fresh_url("resumed")
    resume_plan(
        url,
        new,
        epoch=0,
        step=2,
        world_size=2,
        storage_options=s3.storage_options,
        out_storage_options=s3.storage_options,
    )
    assert epoch_ids(url, 0, s3.storage_options, slice(0, 2)) + epoch_ids(new, 0, s3.storage_options) == epoch_ids(
        local, 0
    )
    assert check_plan(new, s3.storage_options) == []
    assert main(["plan", "--check", url, manifest_url, "--storage-options", opts]) == 0


def test_a_plan_written_in_windows_has_the_bytes_of_one_planned_at_once(manifest_url, tmp_path, capsys):
    whole, windowed = tmp_path / "whole", tmp_path / "windowed"
    run(PlanJob(manifests=(manifest_url,), out=str(whole), world_size=4, batch_size=2, seed=5, epochs=5,
                progress=False))  # fmt: skip
    run(PlanJob(manifests=(manifest_url,), out=str(windowed), world_size=4, batch_size=2, seed=5, epochs=5, window=2,
                progress=False))  # fmt: skip
    assert "epochs 0..1 of 5 planned (write the rest with --extend)" in capsys.readouterr().out
    meta = read_plan_meta(str(windowed))
    assert [e.epoch for e in meta.epochs] == [0, 1] and meta.inputs.epochs == 5
    assert meta.fingerprint == read_plan_meta(str(whole)).fingerprint  # a window is the same plan
    assert check_plan(str(windowed), manifests=[read_manifest(manifest_url)]) == []
    assert read_rank_plan(str(windowed), 3, epoch=1).equals(read_rank_plan(str(whole), 3, epoch=1))

    assert main(["plan", manifest_url, "--extend", str(windowed), "--epochs", "3", "--seed", "6"]) == 2
    assert "--seed 6 differs from the plan's 5" in capsys.readouterr().err
    run(PlanJob(manifests=(manifest_url,), extend=str(windowed), epochs=3, seed=5, progress=False))
    assert [e.epoch for e in read_plan_meta(str(windowed)).epochs] == [0, 1, 2]
    run(PlanJob(manifests=(manifest_url,), extend=str(windowed), progress=False))  # the rest
    assert all_files(windowed) == all_files(whole)  # _plan.json included: extending is a pure function
    capsys.readouterr()
    assert main(["plan", manifest_url, "--extend", str(windowed)]) == 2
    assert "holds epochs 0..4 of a 5-epoch run" in capsys.readouterr().err

    other = str(tmp_path / "m2")
    write_manifest(other, *manifest_tables(100, seed=9), source="/d", spec=BucketSpec(area=512 * 512))
    run(PlanJob(manifests=(manifest_url,), out=str(windowed), world_size=4, batch_size=2, seed=5, epochs=5, window=1,
                progress=False))  # fmt: skip
    assert main(["plan", other, "--extend", str(windowed)]) == 2
    assert "was made from manifest" in capsys.readouterr().err
    resumed = str(tmp_path / "resumed")
    resume_plan(str(windowed), resumed, epoch=0, step=3, world_size=2)
    assert main(["plan", manifest_url, "--extend", resumed]) == 2
    assert "is a resumed plan" in capsys.readouterr().err


def test_an_older_plan_format_is_refused_with_what_to_do(manifest_url, tmp_path):
    url = tmp_path / "p"
    run(PlanJob(manifests=(manifest_url,), out=str(url), world_size=4, batch_size=2, seed=5, epochs=3, progress=False))
    meta = json.loads((url / PLAN_FILE).read_text())
    (url / PLAN_FILE).write_text(json.dumps(dict(meta, format_version=1)))
    with pytest.raises(PlanError, match="format version 1; this bucketeer reads version 2. Re-run `bucketeer plan`"):
        read_rank_plan(str(url), 0)
