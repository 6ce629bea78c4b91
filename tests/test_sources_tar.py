"""WebDataset tar shards: the header walker against tarfile, the scan of shards locally and on S3
(exact sizes, error rows, bytes and requests counted by the filesystem), per-shard rescans, embed + verify,
plan + train."""

from __future__ import annotations

import io
import json
import tarfile
import threading

import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from manifests.buckets import BucketSpec
from manifests.errors import UsageError
from manifests.manifest import read_manifest
from manifests.schema import MAX_PIXELS, image_range
from pipeline.cli import main
from pipeline.embed.imaging import fetch_images
from pipeline import ScanJob, run
from pipeline.scan import ScanConfig
from pipeline.sources.results import checked
from pipeline.sources.jpeg import KEEP, sparse_jpeg_header
from pipeline.sources.tar import walk_tar
from tests.corpus import truth
from tests.shards import ShardSet, awkward_shards, good_shard, put, tar_bytes
from tests.train_dataset import train_here
from train.config import DEFAULT_CONFIG


QUIET = ScanConfig(progress=False)


# --- the walker ----------------------------------------------------------------------------------

_names = st.text(st.characters(codec="utf-8", exclude_characters="\0/", exclude_categories=("Cs",)), min_size=1,
                 max_size=40)  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    members=st.lists(st.tuples(st.lists(_names, min_size=1, max_size=5), st.integers(0, 3000), st.booleans()),
                     max_size=12),  # fmt: skip
    fmt=st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT]),
    window=st.sampled_from([512, 1024, 4096, 8192]),
)
def test_walker_finds_exactly_what_tarfile_finds(members, fmt, window):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for i, (parts, size, is_dir) in enumerate(members):
            info = tarfile.TarInfo("/".join(parts) + f".{i}")  # long, unicode and deep names, unique
            if is_dir:
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            else:
                info.size = size
                tf.addfile(info, io.BytesIO(bytes([i % 256]) * size))
    data = buf.getvalue()
    reads = []

    def read_range(start: int, end: int) -> bytes:
        reads.append(end - start)
        return data[start:end]

    walk = walk_tar(read_range, len(data), window=window)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        expected = [(m.name, m.offset_data, m.size) for m in tf.getmembers() if m.isfile()]
    assert [(m.name, m.offset, m.size) for m in walk.members] == expected
    assert walk.problem is None and walk.skipped == sum(d for *_, d in members)
    for m in walk.members:  # what the walk kept of a member's data is that data
        assert data[m.offset : m.offset + len(m.head)] == m.head
    # a header per read at most, plus one for the long name / pax header that precedes it
    assert len(reads) <= 2 * len(members) + 1


def test_walker_reads_a_run_of_small_members_at_once():
    data = tar_bytes([(f"k{i}.txt", b"caption %d" % i) for i in range(10)])
    reads = []
    walk = walk_tar(lambda s, e: reads.append((s, e)) or data[s:e], len(data), window=16384)
    assert len(walk.members) == 10 and [m.head for m in walk.members][3] == b"caption 3"
    assert len(reads) == 1


# --- the scan of shards --------------------------------------------------------------------------


class CountingLocal(LocalFileSystem):
    """The local disk, with every read (path, start, end, bytes) appended to ``log`` (Ray workers too)."""

    cachable = False

    def __init__(self, log: str, **kwargs):
        super().__init__(log=log, **kwargs)
        self.log = log
        self.lock = threading.Lock()

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = super().cat_file(path, start=start, end=end, **kwargs)
        with self.lock, open(self.log, "a") as f:
            f.write(json.dumps([self._strip_protocol(path), start, end, len(data)]) + "\n")
        return data

    def __reduce__(self):
        return CountingLocal, (self.log,)


def reads_of(log) -> list[tuple[str, int, int, int]]:
    return [tuple(json.loads(line)) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> ShardSet:
    return awkward_shards(tmp_path_factory.mktemp("shards"))


def _check_rows(m, shards: ShardSet) -> None:
    assert {r["filename"]: (r["width"], r["height"]) for r in m.samples.to_pylist()} == shards.sizes
    assert {r["filename"]: r["caption"] for r in m.samples.to_pylist()} == shards.captions
    assert {r["filename"]: r["error"] for r in m.errors.to_pylist()} == shards.errors


@pytest.mark.ray
def test_shard_scan_matches_pillow_and_reads_only_headers(shards, ray_local, tmp_path, capsys):
    log = tmp_path / "reads.jsonl"
    out = str(tmp_path / "manifest")
    meta = run(ScanJob(source=str(shards.root), out=out, config=QUIET, fs=CountingLocal(str(log)))).meta
    m = read_manifest(out)
    _check_rows(m, shards)
    s = meta.summary
    # no caption: plain.jpg, the one sample without (html.jpg, the cut and the lying member are error rows)
    assert s.no_caption == m.samples.column("caption").null_count == 1
    assert s.ignored_members == {"cls": 1, "txt": 1}  # plain.cls, orphan.txt
    assert meta.counts.listed == len(shards.sizes) + sum("/" in f[1:] for f in shards.errors)
    # every row says where its image is; those bytes are the member's (one ranged read)
    row = next(r for r in m.samples.to_pylist() if r["filename"] == "mixed.tar/orient.webp")
    path, start, end = image_range(row)
    with tarfile.open(shards.root / path) as tf:
        member = tf.getmember("orient.webp")
        assert (start, end) == (member.offset_data, member.offset_data + member.size)

    reads = reads_of(log)
    sizes = {p.rsplit("/", 1)[-1]: (shards.root / p.split(str(shards.root) + "/", 1)[-1]).stat().st_size
             for p, *_ in reads}  # fmt: skip
    assert reads and all(n < sizes[p.rsplit("/", 1)[-1]] for p, _, _, n in reads)  # no shard read whole
    total = sum(n for *_, n in reads)
    assert total == s.bytes_read and len(reads) == s.requests
    images = len(shards.sizes) + 5  # + the images of error rows that were probed or walked
    assert total < 0.2 * shards.shard_bytes, (total, shards.shard_bytes)
    assert len(reads) <= 1.5 * images

    # a rescan of unchanged shards reads nothing and commits the same manifest
    run(ScanJob(source=str(shards.root), out=out, config=QUIET))
    line = capsys.readouterr().out
    assert "scanned 5 tar shards" in line and "shards reused 5, new 0, changed 0" in line
    assert read_manifest(out).fingerprint == m.fingerprint


def test_embed_fetches_a_member_with_one_ranged_read(shards, tmp_path):
    log = tmp_path / "reads.jsonl"
    rows = [{"filename": "good-000.tar/sample_00001.jpg", "container": None}]
    with tarfile.open(shards.root / "good-000.tar") as tf:
        member = tf.getmember("sample_00001.jpg")
        expected = tf.extractfile(member).read()
    rows = [{"filename": "good-000.tar/sample_00001.jpg", "container": "good-000.tar",
             "member_offset": member.offset_data, "size": member.size}]  # fmt: skip
    (blob,) = fetch_images(CountingLocal(str(log)), str(shards.root), rows)
    assert blob == expected
    assert [n for *_, n in reads_of(log)] == [member.size]


@pytest.mark.ray
def test_rescan_reads_only_the_changed_shard(tmp_path, ray_local):
    s = ShardSet(tmp_path / "src")
    for k in range(3):
        good_shard(s, f"{k:05d}.tar", 10 * k, 4)
    out = str(tmp_path / "manifest")
    run(ScanJob(source=str(s.root), out=out, config=QUIET))
    changed = ShardSet(s.root)
    good_shard(changed, "00001.tar", 100, 5)  # rewritten: other samples, one more
    (s.root / "00002.tar").unlink()
    good_shard(changed, "00003.tar", 200, 2)  # new
    meta = run(ScanJob(source=str(s.root), out=out, config=QUIET)).meta
    summary = meta.summary
    assert (summary.reused, summary.changed, summary.new, summary.deleted) == (1, 1, 1, 1)
    assert summary.shards_read == 2
    clean = run(ScanJob(source=str(s.root), out=str(tmp_path / "clean"), config=QUIET)).meta
    assert meta.fingerprint == clean.fingerprint
    names = set(read_manifest(out).samples.column("filename").to_pylist())
    assert names == {f for f in s.sizes if f.startswith("00000")} | set(changed.sizes)


def test_compressed_shards_alone_or_with_format_tar_are_refused_with_what_to_do(tmp_path):
    s = ShardSet(tmp_path / "gz")
    put(s, "00000.tar.gz", b"\x1f\x8b not really")
    with pytest.raises(UsageError, match=r"gzip -dc"):
        run(ScanJob(source=str(s.root), out=str(tmp_path / "m1"), config=QUIET))
    with pytest.raises(UsageError, match=r"gzip -dc"):  # --format tar: the same refusal beside good shards
        good_shard(s, "00001.tar", 0, 1)
        run(ScanJob(source=str(s.root), out=str(tmp_path / "m2"), config=ScanConfig(progress=False, format="tar")))
    assert not (tmp_path / "m1").exists() and not (tmp_path / "m2").exists()


@pytest.mark.s3
@pytest.mark.ray
@pytest.mark.slow  # ~20-35 s: embed's text and VAE actors start, two training steps
@pytest.mark.usefixtures("bucketeer_home")
@pytest.mark.full
def test_shards_on_s3_scan_then_embed_verify_plan_and_train(s3, ray_local, tmp_path, capsys):
    from tests.embed_data import embed_cache

    s = ShardSet(tmp_path / "src")
    good_shard(s, "train/00000.tar", 0, 5)
    good_shard(s, "train/00001.tar", 5, 5, fmt=tarfile.GNU_FORMAT)
    url = s3.fresh_url("shards")
    s3.fs.put(str(s.root) + "/", url + "/", recursive=True)
    out = s3.fresh_url("manifest")
    so = json.dumps(s3.storage_options)
    # tiny buckets: the CPU VAE's time grows with the pixels
    run(ScanJob(source=url, out=out, storage_options=s3.storage_options, spec=BucketSpec(area=64 * 64, step=32),
                config=QUIET))
    assert "scanned 2 tar shards, 10 images: 10 samples" in capsys.readouterr().out
    m = read_manifest(out, s3.storage_options)
    _check_rows(m, s)
    assert all(r["etag"] for r in m.samples.to_pylist())
    assert m.meta.summary.read_fraction < 0.5

    cache = str(tmp_path / "cache")
    embed_cache(out, cache, storage_options=s3.storage_options)
    assert "10 embedded, 0 error rows" in capsys.readouterr().out
    assert main(["verify", cache]) == 0

    # plan and train from the sharded manifest, as from any other
    plan = str(tmp_path / "plan")
    assert main(["plan", out, "--out", plan, "--world-size", "1", "--batch-size", "2", "--epochs", "1",
                 "--cache", cache, "--storage-options", so]) == 0  # fmt: skip
    trained = tmp_path / "run"
    assert train_here("--plan", plan, "--cache", cache, "--config", DEFAULT_CONFIG, "--output-dir", trained,
                      "--max-steps", 2).steps == 2  # fmt: skip
    assert (trained / "model").is_dir()


@settings(max_examples=25, deadline=None)
@given(exif_bytes=st.integers(0, 60_000), icc_bytes=st.integers(0, 80_000), orientation=st.integers(1, 8),
       window=st.sampled_from([512, 4096, 8192]))  # fmt: skip
def test_sparse_jpeg_header_is_pillows_answer_without_reading_exif_or_icc_bodies(
    exif_bytes, icc_bytes, orientation, window
):
    img = Image.fromarray(np.random.default_rng(exif_bytes).integers(0, 255, (30, 50, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = orientation
    if exif_bytes:
        exif.get_ifd(0x8769)[0x927C] = bytes(exif_bytes)
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif.tobytes(), **({"icc_profile": b"\1" * icc_bytes} if icc_bytes else {}))
    data = buf.getvalue()
    reads = []

    def read_range(start: int, end: int) -> bytes:
        reads.append(end - start)
        return data[start:end]

    header = sparse_jpeg_header(read_range, len(data), data[:window], window)
    assert header is not None
    probe = checked(header, MAX_PIXELS)
    assert (probe.width, probe.height) == truth(data)
    assert window + sum(reads) <= 3 * KEEP + 4 * window  # never the EXIF or ICC body


class FailingLocal(LocalFileSystem):
    """The local disk, where every read of ``shard`` fails with ``error``."""

    cachable = False

    def __init__(self, shard: str, error: Exception, **kwargs):
        super().__init__(shard=shard, **kwargs)
        self.shard, self.error = shard, error

    def cat_file(self, path, start=None, end=None, **kwargs):
        if path.endswith(self.shard):
            raise self.error
        return super().cat_file(path, start=start, end=end, **kwargs)


def test_a_shard_unreadable_after_retries_is_one_read_failed_row_access_denied_stops(tmp_path, monkeypatch):
    import errno

    from manifests.errors import StorageError
    from pipeline.sources.listing import list_source
    from pipeline.sources.shards import scan_shards

    monkeypatch.setenv("BUCKETEER_STORAGE_ATTEMPTS", "2")
    monkeypatch.setenv("BUCKETEER_STORAGE_RETRY_DELAY", "0.01")
    monkeypatch.setenv("BUCKETEER_STORAGE_THROTTLE_SECONDS", "0.5")  # SlowDown is retried this long, not twice
    s = ShardSet(tmp_path)
    good_shard(s, "00000.tar", 0, 2)
    good_shard(s, "00001.tar", 2, 2)
    shards = list_source(LocalFileSystem(), str(tmp_path)).shards
    busy = FailingLocal("00001.tar", OSError(errno.EBUSY, "SlowDown: please reduce your request rate"))
    rows = scan_shards(busy, str(tmp_path), shards, QUIET).to_pylist()
    assert {r["filename"]: r["error"] for r in rows} == {
        "00000.tar/sample_00000.jpg": None, "00000.tar/sample_00001.jpg": None, "00001.tar": "read_failed"}
    denied = FailingLocal("00001.tar", PermissionError("Access Denied"))
    with pytest.raises(StorageError, match="00001.tar"):
        scan_shards(denied, str(tmp_path), shards, QUIET)
