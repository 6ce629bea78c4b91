"""Every count a job's summary gives equals what a reader of its artifact counts, recounted here from the
artifact itself: ``scan`` (``_manifest.json`` counts and summary against ``samples/`` and ``errors/``, after a
first scan and after a rescan that reuses part of it), ``embed`` (``_cache.json`` against its index),
``annotate`` and ``dedup`` (``_annotations.json`` against their parts), ``plan`` (``_plan.json`` against its
rows). For each kind of source: loose files with sidecars, tar shards as img2dataset writes them (``.jpg``,
``.txt``, ``.json`` per key, a ``.parquet`` and ``_stats.json`` per shard) and as WebDataset writes them
(``.txt`` or a ``.json`` caption field, ``.cls``), and parquet files with an image column.

Each dataset holds captions that are empty (an empty ``.txt`` member or sidecar, ``""`` in a column), absent,
an image that is not one, one too small for any bucket, and an exact duplicate.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from manifests.annotations import read_annotations
from manifests.cache import read_cache_meta, read_index
from manifests.manifest import read_manifest
from manifests.plan import read_plan_meta
from pipeline.cli import main
from pipeline.scan import ScanConfig, ScanJob, run
from manifests.buckets import BucketSpec
from tests.embed_data import embed_cache, jpeg

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("bucketeer_home"), pytest.mark.full]

KINDS = ("loose", "img2dataset", "webdataset", "parquet")
SPEC = BucketSpec(area=64 * 64, step=32, min_side=16)  # sample 10 (8 x 8) is too_small
CONFIG = {"parquet": ScanConfig(progress=False, format="parquet", image_column="image", caption_column="text")}


def _items(changed: bool) -> list[tuple[str, bytes, str | None]]:
    """``(key, image bytes, caption)`` of 12 samples: captions empty (1, 4, 7), absent (5); 8 is 2's bytes again;
    9 is no image; 10 is too small for a bucket. ``changed``: sample 3's caption becomes empty, what a rescan
    must read again, in the first half (the other half, with its empty caption 7, it reuses)."""
    items = []
    for i in range(12):
        image = jpeg(64 + 16 * (i % 3), 64, seed=i)
        caption: str | None = "" if i in (1, 4, 7) else None if i == 5 else f"a photo of thing {i % 3}"
        if i == 8:
            image = jpeg(64 + 16 * (2 % 3), 64, seed=2)  # byte for byte sample 2: a duplicate
        elif i == 9:
            image = b"<html>not an image</html>"
        elif i == 10:
            image = jpeg(8, 8, seed=i)
        if changed and i == 3:
            caption = ""
        items.append((f"{i:09d}", image, caption))
    return items


def _put(path: Path, data: bytes) -> None:
    """Write ``data`` unless the file holds it already: an unchanged file keeps its mtime, and a rescan reuses it."""
    if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)


def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_700_000_000
            tf.addfile(info, io.BytesIO(data))
    _put(path, buf.getvalue())


def _parquet(path: Path, table: pa.Table, **kwargs) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf, **kwargs)
    _put(path, buf.getvalue())


def write_source(root: Path, kind: str, changed: bool = False) -> None:
    """The dataset of :func:`_items` under ``root`` as ``kind`` lays it out (two shards or files, 6 samples each;
    what ``changed`` changes lies in the first; files it leaves alone are not written again)."""
    root.mkdir(parents=True, exist_ok=True)
    items = _items(changed)
    for n, half in enumerate([items[:6], items[6:]]):
        if kind == "loose":
            for key, image, caption in half:
                _put(root / f"img_{key}.jpg", image)
                if caption is not None:
                    _put(root / f"img_{key}.txt", caption.encode())
        elif kind == "img2dataset":  # what img2dataset writes: the caption twice, a metadata parquet, stats
            members = []
            for key, image, caption in half:
                meta = {"url": f"https://example.com/{key}.jpg", "key": key, "status": "success",
                        "caption": caption, "width": 64, "height": 64}  # fmt: skip
                members += [(f"{key}.jpg", image), (f"{key}.json", json.dumps(meta).encode()),
                            (f"{key}.txt", (caption or "").encode())]  # an empty .txt where it had none
            _tar(root / f"{n:05d}.tar", members)
            _parquet(root / f"{n:05d}.parquet", pa.table({"key": [k for k, *_ in half],
                                                          "caption": [c for *_, c in half]}))  # fmt: skip
            _put(root / f"{n:05d}_stats.json", json.dumps({"count": len(half)}).encode())
        elif kind == "webdataset":  # a caption in .txt, or in the .json's "caption" field; a class label
            members = []
            for j, (key, image, caption) in enumerate(half):
                members.append((f"sample_{key}.jpg", image))
                if caption is not None and j % 2:
                    members.append((f"sample_{key}.json", json.dumps({"caption": caption}).encode()))
                elif caption is not None:
                    members.append((f"sample_{key}.txt", caption.encode()))
                members.append((f"sample_{key}.cls", b"3"))
            _tar(root / f"wds-{n:03d}.tar", members)
        else:
            table = pa.table({"image": pa.array([image for _, image, _ in half], pa.large_binary()),
                              "text": pa.array([caption for *_, caption in half], pa.string())})  # fmt: skip
            _parquet(root / f"part-{n:03d}.parquet", table, row_group_size=4)


# --- recounts ---------------------------------------------------------------------------------------


def recount_scan(url: str, kind: str) -> None:
    m = read_manifest(url)
    s, c, samples, errors = m.meta.summary, m.meta.counts, m.samples, m.errors
    whole = errors.filter(pc.equal(errors.column("filename"), errors.column("container"))).num_rows \
        if "container" in errors.column_names else 0  # fmt: skip
    assert (c.samples, c.errors) == (s.samples, s.errors) == (samples.num_rows, errors.num_rows)
    assert s.errors_by_kind == dict(Counter(errors.column("error").to_pylist()))
    assert s.no_caption == samples.column("caption").null_count  # the 1 of 5 after a rescan
    assert c.listed == s.listed == samples.num_rows + errors.num_rows - whole
    if s.caption_lists is not None:
        lists = samples.column("captions").to_pylist()
        assert s.caption_lists == sum(len(x or ()) > 1 for x in lists)
    if kind != "loose":
        containers = set(pa.concat_arrays([samples.column("container").combine_chunks(),
                                           errors.column("container").combine_chunks()]).to_pylist())  # fmt: skip
        assert c.shards == s.shards == len(containers)


def recount_embed(cache: str, manifest: str) -> None:
    meta, index = read_cache_meta(cache), read_index(cache)
    s, c = meta.summary, meta.counts
    samples, texts, errors = index["samples"], index["texts"], index["errors"]
    assert (c.samples, c.texts, c.errors) == (samples.num_rows, texts.num_rows, errors.num_rows)
    assert (s.embedded, s.errors) == (c.samples, c.errors) and s.skipped == 0  # a first run: it wrote them all
    assert c.samples + c.errors == read_manifest(manifest).samples.num_rows
    shards = set(samples.column("shard").to_pylist()) | set(texts.column("shard").to_pylist())
    assert s.shards == len(shards)
    assert len(set(texts.column("caption_key").to_pylist())) == texts.num_rows


def recount_annotations(out: str, manifest: str) -> None:
    meta, rows, errors = read_annotations(out)
    c = meta.counts
    assert (c.annotated, c.errors) == (rows.num_rows, errors.num_rows)
    assert c.samples == read_manifest(manifest).samples.num_rows == c.annotated + c.errors


def recount_dedup(out: str, result_line: str) -> None:
    meta, rows, _ = read_annotations(out)
    sizes = Counter(rows.column("cluster_id").to_pylist())
    clusters, duplicates = sum(n > 1 for n in sizes.values()), int(pc.sum(rows.column("duplicate")).as_py() or 0)
    assert meta.counts.samples == meta.counts.annotated == rows.num_rows
    assert f"clusters: {clusters} of two or more samples; {duplicates} duplicates, " \
           f"{rows.num_rows - duplicates} samples kept" in result_line  # fmt: skip
    assert duplicates >= 1  # sample 8 is sample 2's bytes


def recount_plan(plan: str, manifest: str) -> None:
    meta = read_plan_meta(plan)
    rows = ds.dataset(plan, format="parquet", exclude_invalid_files=True).to_table()
    planned = set(read_manifest(manifest).samples.column("sample_id").to_pylist())
    assert meta.samples.planned + meta.samples.not_in_cache + meta.samples.stale == len(planned)
    padded = dropped = 0
    for entry in meta.epochs:
        epoch = rows.filter(pc.equal(rows.column("epoch"), entry.epoch))
        ids = [i for batch in epoch.column("sample_ids").to_pylist() for i in batch]
        assert entry.steps == len(set(epoch.column("step").to_pylist()))
        assert entry.padded_total == len(ids) - len(set(ids)) == sum(entry.padded.values())
        assert entry.dropped_total == meta.samples.planned - len(set(ids)) == sum(entry.dropped.values())
        padded, dropped = padded + entry.padded_total, dropped + entry.dropped_total
    assert (meta.counts.padded, meta.counts.dropped) == (padded, dropped)


@pytest.mark.parametrize("kind", KINDS)
def test_every_summary_count_is_what_a_reader_of_the_artifact_counts(kind, tmp_path, ray_local, capsys):
    from pipeline.annotate import AnnotateJob
    from pipeline.annotate import run as annotate
    from pipeline.dedup import DedupJob
    from pipeline.dedup import run as dedup

    source, manifest = tmp_path / "src", str(tmp_path / "manifest")
    config = CONFIG.get(kind, ScanConfig(progress=False))
    write_source(source, kind)
    run(ScanJob(source=str(source), out=manifest, spec=SPEC, config=config))
    recount_scan(manifest, kind)
    first = read_manifest(manifest)
    assert first.errors.num_rows == 2 and first.samples.column("caption").null_count == 4  # 1, 4, 7 empty; 5 none

    write_source(source, kind, changed=True)  # a rescan: the second half (and its no-caption samples) reused
    meta = run(ScanJob(source=str(source), out=manifest, spec=SPEC, config=config)).meta
    recount_scan(manifest, kind)
    assert meta.summary.no_caption == 5 and (meta.summary.reused or 0) > 0  # 7: in what the rescan reused

    cache = str(tmp_path / "cache")
    embed_cache(manifest, cache)
    recount_embed(cache, manifest)

    annotations = str(tmp_path / "annotations")
    annotate(AnnotateJob(manifest=manifest, out=annotations, tasks=("phash", "sha256"), unit_rows=4))
    recount_annotations(annotations, manifest)
    capsys.readouterr()
    dedup(DedupJob(annotations=(annotations,), out=str(tmp_path / "dedup"), by=("sha256",)))
    recount_dedup(str(tmp_path / "dedup"), capsys.readouterr().out)

    plan = str(tmp_path / "plan")
    assert main(["plan", manifest, "--out", plan, "--world-size", "2", "--batch-size", "2", "--epochs", "2",
                 "--seed", "3", "--cache", cache]) == 0  # fmt: skip
    recount_plan(plan, manifest)
