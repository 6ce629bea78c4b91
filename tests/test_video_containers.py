"""``scan --frames`` of videos inside WebDataset tar shards: probed from their headers through ranged reads of
the member's byte range, with the shard and byte range in the row; sizes and frames equal a full PyAV decode's."""

from __future__ import annotations

import json
import os

import pytest

av = pytest.importorskip("av")

from manifests.buckets import BucketSpec  # noqa: E402
from manifests.manifest import read_manifest  # noqa: E402
from pipeline.scan import ScanConfig, ScanJob, run  # noqa: E402
from tests.shards import tar_bytes  # noqa: E402
from tests.test_video_scan import H264, LADDER, _decoded, _write  # noqa: E402


@pytest.fixture(scope="module")
def shard_source(tmp_path_factory):
    clips = tmp_path_factory.mktemp("clips")
    _write(clips / "a.mp4", H264, 20)
    _write(clips / "b.mkv", H264, 40, seed=1)
    options = {"crf": "0", "preset": "ultrafast"} if H264 == "libx264" else {"qscale": "1"}
    _write(clips / "big.mp4", H264, 40, size=(160, 120), options=options, seed=2)  # > 1 MB
    _write(clips / "short.mp4", H264, 5, seed=3)
    root = tmp_path_factory.mktemp("shards")
    (root / "shard-000.tar").write_bytes(tar_bytes([
        ("a.mp4", (clips / "a.mp4").read_bytes()), ("a.txt", b"a red ball\n"),
        ("b.mkv", (clips / "b.mkv").read_bytes()), ("b.json", json.dumps({"caption": "a blue cube"}).encode()),
        ("c.mp4", b"\x00\x00\x00\x18ftypisom" + os.urandom(3000)),  # not_a_video
        ("d.cls", b"3"),  # an ignored member
    ]))  # fmt: skip
    (root / "shard-001.tar").write_bytes(tar_bytes([
        ("big.mp4", (clips / "big.mp4").read_bytes()), ("big.txt", b"noise"),
        ("short.mp4", (clips / "short.mp4").read_bytes()),
    ]))  # fmt: skip
    _write(root / "loose.mp4", H264, 12, seed=4)  # a loose video beside the shards
    return clips, root


def test_tar_video_members_scanned_from_their_headers(shard_source, ray_local, tmp_path):
    clips, root = shard_source
    out = str(tmp_path / "m")
    result = run(ScanJob(source=str(root), out=out, spec=BucketSpec(area=64 * 64, step=16), frames=LADDER,
                         config=ScanConfig(progress=False)))  # fmt: skip
    manifest = read_manifest(out)
    rows = {r["filename"]: r for r in manifest.samples.to_pylist()}
    assert set(rows) == {"shard-000.tar/a.mp4", "shard-000.tar/b.mkv", "shard-001.tar/big.mp4", "loose.mp4"}
    for name, clip in (("shard-000.tar/a.mp4", "a.mp4"), ("shard-000.tar/b.mkv", "b.mkv"),
                       ("shard-001.tar/big.mp4", "big.mp4")):  # fmt: skip
        row = rows[name]
        assert (row["width"], row["height"], row["frames"]) == _decoded(clips / clip), name
        # one ranged read of the row's byte range is the clip
        with open(root / row["container"], "rb") as fh:
            data = os.pread(fh.fileno(), row["size"], row["member_offset"])
        assert data == (clips / clip).read_bytes(), name
    assert rows["shard-000.tar/a.mp4"]["caption"] == "a red ball"
    assert rows["shard-000.tar/b.mkv"]["caption"] == "a blue cube" and rows["shard-000.tar/b.mkv"]["clips"] == 2
    assert rows["loose.mp4"]["container"] is None and rows["loose.mp4"]["frames"] == 12
    big = rows["shard-001.tar/big.mp4"]
    assert big["size"] > 1_000_000 and big["bytes_read"] <= 0.05 * big["size"]
    errors = {r["filename"]: r["error"] for r in manifest.errors.to_pylist()}
    assert errors == {"shard-000.tar/c.mp4": "not_a_video", "shard-001.tar/short.mp4": "too_short"}
    summary = result.meta.summary
    shard_bytes = sum(os.path.getsize(root / f"shard-00{i}.tar") for i in (0, 1))
    assert summary.shards == 2 and summary.shard_bytes == shard_bytes and summary.other["videos"] == 5 + 1
    # every byte read of the shards (member headers, captions, video headers): a small share of them
    assert summary.other["video_bytes_read"] - rows["loose.mp4"]["bytes_read"] <= 0.15 * shard_bytes
    assert summary.ignored_members == {"cls": 1}

    # the report's contact sheet decodes the shard's clips from their byte ranges
    from pipeline import ReportJob, run as report

    page = tmp_path / "r.html"
    report(ReportJob(manifest=out, out=str(page), progress=False))
    text = page.read_text()
    assert "unreadable" not in text and text.count('class="thumb"') == 4 * 3


def test_parquet_video_column(shard_source, ray_local, tmp_path):
    """``--format parquet --image-column video``: each value probed from its header; row group and row in the row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    clips, _ = shard_source
    root = tmp_path / "pq"
    root.mkdir()
    names = ["a.mp4", "b.mkv", "big.mp4", "short.mp4"]
    table = pa.table({"video": [(clips / n).read_bytes() for n in names] + [b"not a video"],
                      "text": ["a red ball", "a blue cube", None, "short", "broken"]})  # fmt: skip
    pq.write_table(table, root / "videos.parquet", row_group_size=2)
    out = str(tmp_path / "m")
    run(ScanJob(source=str(root), out=out, spec=BucketSpec(area=64 * 64, step=16), frames=LADDER,
                config=ScanConfig(progress=False, format="parquet", image_column="video",
                                  caption_column="text")))  # fmt: skip
    manifest = read_manifest(out)
    rows = {r["filename"]: r for r in manifest.samples.to_pylist()}
    assert set(rows) == {"videos.parquet/0", "videos.parquet/1", "videos.parquet/2"}
    for i, name in enumerate(names[:3]):
        row = rows[f"videos.parquet/{i}"]
        assert (row["width"], row["height"], row["frames"]) == _decoded(clips / name), name
        assert (row["container"], row["row_group"], row["row_index"]) == ("videos.parquet", i // 2, i % 2)
        assert row["size"] == (clips / name).stat().st_size
    assert rows["videos.parquet/1"]["caption"] == "a blue cube" and rows["videos.parquet/2"]["caption"] is None
    errors = {r["filename"]: r["error"] for r in manifest.errors.to_pylist()}
    assert errors == {"videos.parquet/3": "too_short", "videos.parquet/4": "not_a_video"}
    assert manifest.meta.summary.image_column == "video"

    from pipeline import ReportJob, run as report

    page = tmp_path / "r.html"
    report(ReportJob(manifest=out, out=str(page), progress=False))
    text = page.read_text()
    assert "unreadable" not in text and text.count('class="thumb"') == 3 * 3


def test_a_rescan_reuses_the_rows_of_unchanged_containers(shard_source, ray_local, tmp_path):
    """The video rows of an unchanged shard (or parquet file) are taken from the previous manifest, nothing of the
    shard read; a changed shard is read again; a changed caption setting reads every shard again."""
    clips, root = shard_source
    source = tmp_path / "src"
    source.mkdir()
    for name in ("shard-000.tar", "shard-001.tar"):
        (source / name).write_bytes((root / name).read_bytes())
    out, spec = str(tmp_path / "m"), BucketSpec(area=64 * 64, step=16)
    first = run(ScanJob(source=str(source), out=out, spec=spec, frames=LADDER, config=ScanConfig(progress=False)))
    before = read_manifest(out)
    (source / "shard-001.tar").write_bytes(tar_bytes([  # changed: a new caption, big.mp4 only
        ("big.mp4", (clips / "big.mp4").read_bytes()), ("big.txt", b"a green cone"),
    ]))  # fmt: skip
    again = run(ScanJob(source=str(source), out=out, spec=spec, frames=LADDER, config=ScanConfig(progress=False)))
    after = read_manifest(out)
    s = again.meta.summary
    assert (first.meta.summary.shards_reused, s.shards_reused, s.shards_changed, s.shards_new) == (0, 1, 1, 0)
    rows = {r["filename"]: r for r in after.samples.to_pylist()}
    old = {r["filename"]: r for r in before.samples.to_pylist()}
    assert set(rows) == {"shard-000.tar/a.mp4", "shard-000.tar/b.mkv", "shard-001.tar/big.mp4"}
    for name in ("shard-000.tar/a.mp4", "shard-000.tar/b.mkv"):  # reused: every column but the read counts
        assert rows[name]["bytes_read"] == 0
        same = [c for c in after.samples.column_names if c != "bytes_read"]
        assert {c: rows[name][c] for c in same} == {c: old[name][c] for c in same}, name
    assert rows["shard-001.tar/big.mp4"]["caption"] == "a green cone" and rows["shard-001.tar/big.mp4"]["bytes_read"]
    errors = {r["filename"]: r["error"] for r in after.errors.to_pylist()}
    assert errors == {"shard-000.tar/c.mp4": "not_a_video"}  # kept from shard-000; short.mp4 left shard-001
    assert s.other["videos"] == 3 + 1 and s.other["video_bytes_read"] < first.meta.summary.other["video_bytes_read"]

    # a different --caption-field: the captions may differ, so every shard is read again
    third = run(ScanJob(source=str(source), out=out, spec=spec, frames=LADDER,
                        config=ScanConfig(progress=False, caption_field="text")))  # fmt: skip
    assert (third.meta.summary.shards_reused, third.meta.summary.shards_changed) == (0, 0)
    assert third.meta.summary.shards_new == 2


def test_a_rescan_reuses_an_unchanged_parquet_files_videos(shard_source, ray_local, tmp_path):
    """A too_short reject of an unchanged parquet file is bucketed again: a longer frame ladder makes it a sample."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from manifests.frames import FrameLadder

    clips, _ = shard_source
    root = tmp_path / "pq"
    root.mkdir()
    pq.write_table(pa.table({"video": [(clips / n).read_bytes() for n in ("a.mp4", "short.mp4")] + [b"junk"]}),
                   root / "videos.parquet")  # fmt: skip
    out, spec = str(tmp_path / "m"), BucketSpec(area=64 * 64, step=16)
    config = ScanConfig(progress=False, format="parquet", image_column="video")
    run(ScanJob(source=str(root), out=out, spec=spec, frames=LADDER, config=config))
    assert {r["error"] for r in read_manifest(out).errors.to_pylist()} == {"too_short", "not_a_video"}
    again = run(ScanJob(source=str(root), out=out, spec=spec, frames=FrameLadder((5, 9)), config=config))
    assert again.meta.summary.shards_reused == 1 and again.meta.summary.other["video_bytes_read"] == 0
    manifest = read_manifest(out)
    rows = {r["filename"]: r for r in manifest.samples.to_pylist()}
    assert set(rows) == {"videos.parquet/0", "videos.parquet/1"} and rows["videos.parquet/1"]["frames"] == 5
    assert {r["filename"]: r["error"] for r in manifest.errors.to_pylist()} == {"videos.parquet/2": "not_a_video"}
