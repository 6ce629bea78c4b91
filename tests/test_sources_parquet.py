"""Parquet datasets with an image-bytes column (``scan --format parquet``): exact sizes against Pillow,
error rows naming file and row, per-file rescans that read nothing of unchanged files (reads counted
by the filesystem), embed's fetch by row group; on the S3 server: scan -> embed -> verify.
Also ``--captions TABLE`` over tar shards (keyed by ``<shard>/<member>``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from manifests.buckets import BucketSpec
from manifests.errors import UsageError
from manifests.manifest import read_manifest
from pipeline.cli import main
from pipeline.embed.imaging import fetch_images
from pipeline import ScanJob, run
from pipeline.scan import ScanConfig
from tests.corpus import truth
from tests.shards import ShardSet, good_shard, photo
from tests.test_sources_tar import CountingLocal, reads_of

PARQUET = ScanConfig(progress=False, format="parquet", image_column="image", caption_column="text")
HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # datasets.Image()'s storage type


@dataclass
class ParquetSet:
    root: Path
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)  # <file>/<row> -> display size
    captions: dict[str, str | None] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # filename -> error kind
    blobs: dict[str, bytes] = field(default_factory=dict)


def small(seed: int, fmt: str = "JPEG", orientation: int = 1) -> bytes:
    return photo(seed, fmt, orientation, size=(48 + 8 * (seed % 5), 40 + 4 * (seed % 3)))


def write_parquet(s: ParquetSet, name: str, images: list[bytes | None], *, hf: bool, group_rows: int,
                  broken: dict[int, str] | None = None, first_caption: int = 0) -> None:  # fmt: skip
    """``images`` as rows of ``name`` (raw binary column, or HF struct), ``group_rows`` per row group."""
    broken = broken or {}
    captions = [None if i % 4 == 3 else f"caption {first_caption + i}" for i in range(len(images))]
    if hf:
        column = pa.array([None if b is None and i not in broken else {"bytes": b, "path": f"img{i}.jpg"}
                           for i, b in enumerate(images)], HF_IMAGE)  # fmt: skip
    else:
        column = pa.array(images, pa.large_binary())
    table = pa.table({"id": list(range(len(images))), "image": column, "text": captions})
    path = s.root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=group_rows)
    for i, blob in enumerate(images):
        row = f"{name}/{i}"
        if i in broken:
            s.errors[row] = broken[i]
        else:
            s.sizes[row], s.captions[row], s.blobs[row] = truth(blob), captions[i], blob


def parquet_set(root: Path) -> ParquetSet:
    s = ParquetSet(root)
    raw = [small(i, orientation=6 if i % 4 == 1 else 1) for i in range(6)] + [small(6, "PNG"), small(7, "WEBP")]
    write_parquet(s, "raw-000.parquet", raw, hf=False, group_rows=3)
    jpeg = small(20)
    hf = [small(21), None, b"<html>not an image</html>", jpeg[:100], small(22, orientation=8), b""]
    write_parquet(s, "sub/hf-000.parquet", hf, hf=True, group_rows=2, first_caption=100,
                  broken={1: "empty", 2: "not_an_image", 3: "truncated", 5: "empty"})  # fmt: skip
    return s


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> ParquetSet:
    return parquet_set(tmp_path_factory.mktemp("parquet"))


@pytest.mark.ray
def test_parquet_scan_matches_pillow_and_error_rows_name_file_and_row(dataset, ray_local, tmp_path, capsys):
    out = str(tmp_path / "manifest")
    run(ScanJob(source=str(dataset.root), out=out, config=ScanConfig(
        format="parquet", image_column="image", caption_column="text", progress=False)))  # fmt: skip
    line = capsys.readouterr().out
    assert "scanned 2 parquet files, 14 images: 10 samples, 4 errors" in line, line
    m = read_manifest(out)
    samples = {r["filename"]: r for r in m.samples.to_pylist()}
    assert {f: (r["width"], r["height"]) for f, r in samples.items()} == dataset.sizes
    assert {f: r["caption"] for f, r in samples.items()} == dataset.captions
    errors = {r["filename"]: r for r in m.errors.to_pylist()}
    assert {f: r["error"] for f, r in errors.items()} == dataset.errors
    for name, row in errors.items():  # the file and the row, in the message too
        number = int(name.rsplit("/", 1)[1])
        assert row["message"].startswith(f"row {number} (row group {number // 2}, index {number % 2}) of "
                                         "sub/hf-000.parquet: "), row["message"]  # fmt: skip
    assert "only a path" in errors["sub/hf-000.parquet/1"]["message"]
    row = samples["raw-000.parquet/4"]
    assert (row["container"], row["row_group"], row["row_index"]) == ("raw-000.parquet", 1, 1)
    assert row["size"] == len(dataset.blobs["raw-000.parquet/4"]) and row["member_offset"] is None
    assert row["caption_source"] == "column:raw-000.parquet:text"
    assert samples["raw-000.parquet/3"]["caption_source"] is None  # no caption in that row
    assert m.meta.summary.image_column == "image"

    # embed's fetch: every sample's bytes, one image-column read per (file, row group)
    log = tmp_path / "reads.jsonl"
    rows = list(samples.values())
    blobs = fetch_images(CountingLocal(str(log)), str(dataset.root), rows, image_column="image")
    assert blobs == [dataset.blobs[r["filename"]] for r in rows]
    groups = len({(r["container"], r["row_group"]) for r in rows})
    assert groups == 5 and len(reads_of(log)) <= 3 * groups, reads_of(log)  # footer and column chunk per group


@pytest.mark.ray
def test_rescan_reads_only_the_changed_parquet_file(tmp_path, ray_local):
    s = ParquetSet(tmp_path / "src")
    for k in range(3):
        write_parquet(s, f"part-{k}.parquet", [small(10 * k + i) for i in range(3)], hf=k == 1, group_rows=2)
    out = str(tmp_path / "manifest")
    first = run(ScanJob(source=str(s.root), out=out, config=PARQUET)).meta
    assert first.summary.samples == 9
    changed = ParquetSet(s.root)
    write_parquet(changed, "part-1.parquet", [small(50 + i) for i in range(4)], hf=False, group_rows=3)
    log = tmp_path / "reads.jsonl"
    meta = run(ScanJob(source=str(s.root), out=out, config=PARQUET, fs=CountingLocal(str(log)))).meta
    summary = meta.summary
    assert (summary.reused, summary.changed, summary.new, summary.shards_read) == (2, 1, 0, 1)
    assert {Path(p).name for p, *_ in reads_of(log)} == {"part-1.parquet"}  # the others: not one read
    assert sum(n for *_, n in reads_of(log)) == summary.bytes_read
    m = read_manifest(out)
    assert {r["filename"]: (r["width"], r["height"]) for r in m.samples.to_pylist()} == {
        **{f: v for f, v in s.sizes.items() if not f.startswith("part-1")}, **changed.sizes}
    clean = run(ScanJob(source=str(s.root), out=str(tmp_path / "clean"), config=PARQUET)).meta
    assert clean.fingerprint == meta.fingerprint
    # another image column is another scan: every file is read again
    again = run(ScanJob(source=str(s.root), out=out, config=ScanConfig(
        progress=False, format="parquet", image_column="image"))).meta  # fmt: skip
    assert again.summary.shards_read == 3 and again.summary.no_caption == 10


@pytest.mark.ray
def test_parquet_sources_are_never_silently_ignored(tmp_path, ray_local):
    s = ParquetSet(tmp_path / "src")
    write_parquet(s, "a.parquet", [small(1)], hf=False, group_rows=1)
    with pytest.raises(UsageError, match="--format parquet --image-column"):
        run(ScanJob(source=str(s.root), out=str(tmp_path / "m1"), config=ScanConfig(progress=False)))
    with pytest.raises(UsageError, match=r"a.parquet has no column 'picture' \(columns: id, image, text\)"):
        run(ScanJob(source=str(s.root), out=str(tmp_path / "m2"), config=ScanConfig(
            progress=False, format="parquet", image_column="picture")))  # fmt: skip
    with pytest.raises(UsageError, match="a.parquet column 'text' is string, not image bytes"):
        run(ScanJob(source=str(s.root), out=str(tmp_path / "m3"), config=ScanConfig(
            progress=False, format="parquet", image_column="text")))  # fmt: skip
    (s.root / "loose.jpg").write_bytes(small(2))
    # --format parquet scans the parquet files only; a loose image beside them is an ignored file, counted
    meta = run(ScanJob(source=str(s.root), out=str(tmp_path / "m4"), config=PARQUET)).meta
    assert meta.summary.samples == 1 and meta.summary.ignored_extensions == {"jpg": 1}
    # beside images (a caption table, say) a parquet file is an ignored file, counted by extension
    meta = run(ScanJob(source=str(s.root), out=str(tmp_path / "m5"), config=ScanConfig(progress=False))).meta
    assert meta.summary.samples == 1 and meta.summary.ignored_extensions == {"parquet": 1}
    (s.root / "not-parquet.parquet").write_bytes(b"PAR1 but no footer")
    (s.root / "loose.jpg").unlink()
    meta = run(ScanJob(source=str(s.root), out=str(tmp_path / "m6"), config=PARQUET)).meta
    errors = read_manifest(str(tmp_path / "m6")).errors.to_pylist()
    assert [(r["filename"], r["error"]) for r in errors] == [("not-parquet.parquet", "corrupt_container")]
    assert meta.summary.samples == 1
    assert not any((tmp_path / f"m{i}").exists() for i in range(1, 4))


@pytest.mark.ray
def test_a_caption_table_keyed_by_member_captions_tar_shards(tmp_path, ray_local):
    s = ShardSet(tmp_path / "src")
    good_shard(s, "00000.tar", 0, 3)
    table = tmp_path / "captions.jsonl"
    table.write_text(json.dumps({"filename": "00000.tar/sample_00001.jpg", "caption": "from the table"}) + "\n")
    out = str(tmp_path / "manifest")
    run(ScanJob(source=str(s.root), out=out, captions=str(table), config=ScanConfig(progress=False)))
    rows = {r["filename"]: r for r in read_manifest(out).samples.to_pylist()}
    assert rows["00000.tar/sample_00001.jpg"]["caption"] == "from the table"
    assert rows["00000.tar/sample_00001.jpg"]["caption_source"].startswith("table:")
    assert rows["00000.tar/sample_00002.jpg"]["caption"] == s.captions["00000.tar/sample_00002.jpg"]


@pytest.mark.s3
@pytest.mark.ray
@pytest.mark.slow  # ~15-30 s: embed's text and VAE actors start
@pytest.mark.usefixtures("bucketeer_home")
@pytest.mark.full
def test_parquet_on_s3_scan_then_embed_and_verify(s3, ray_local, tmp_path, capsys):
    from tests.embed_data import embed_cache

    s = ParquetSet(tmp_path / "src")
    write_parquet(s, "train/0.parquet", [small(i) for i in range(5)], hf=True, group_rows=2)
    write_parquet(s, "train/1.parquet", [small(10 + i) for i in range(4)] + [b"broken"], hf=False, group_rows=3,
                  broken={4: "not_an_image"})  # fmt: skip
    url = s3.fresh_url("parquet")
    s3.fs.put(str(s.root) + "/", url + "/", recursive=True)
    out = s3.fresh_url("manifest")
    run(ScanJob(source=url, out=out, storage_options=s3.storage_options, spec=BucketSpec(area=64 * 64, step=32),
                config=ScanConfig(progress=False, format="parquet", caption_column="text")))  # fmt: skip
    assert "scanned 2 parquet files, 10 images: 9 samples, 1 errors" in capsys.readouterr().out
    m = read_manifest(out, s3.storage_options)
    assert {r["filename"]: (r["width"], r["height"]) for r in m.samples.to_pylist()} == s.sizes
    assert all(r["etag"] for r in m.samples.to_pylist())

    cache = str(tmp_path / "cache")
    embed_cache(out, cache, storage_options=s3.storage_options)
    assert "9 embedded, 0 error rows" in capsys.readouterr().out
    assert main(["verify", cache]) == 0


def test_embed_units_keep_a_row_groups_rows_together():
    from pipeline.embed.work import cut_units

    # 12 rows of one bucket from 3 row groups of one file, interleaved by sample id
    rows = pa.table({"sample_id": pa.array(range(12), pa.uint64()), "bucket": ["64x64"] * 12,
                     "container": ["a.parquet"] * 12, "row_group": pa.array([i % 3 for i in range(12)], pa.int32())})
    units = list(cut_units(rows, batch_size=4, shard_records=4))
    assert [sorted(set(u.column("row_group").to_pylist())) for u in units] == [[0], [1], [2]]
    # loose files (no container columns) keep the order by sample id
    loose = list(cut_units(rows.select(["sample_id", "bucket"]), batch_size=4, shard_records=4))
    assert [u.column("sample_id").to_pylist() for u in loose] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
