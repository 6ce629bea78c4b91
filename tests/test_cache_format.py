"""Record codec (gzip'd safetensors, no pickle), shard writer, index, writer commits and the reader."""

from __future__ import annotations

import gzip
import json
import struct

import numpy as np
import pyarrow as pa
import pytest

from manifests.cache import records as cf
from manifests.cache import (
    CacheError,
    CacheReader,
    CacheWriter,
    available_sample_ids,
    cache_freshness,
    read_cache_meta,
    read_index,
    source_key,
)
from manifests.cache.records import SampleRecord, TextRecord, caption_key

SETTINGS = {"dtype": "BF16", "crop": "center", "vae": {"id": "x", "weights_sha256": "aa"}}
INFO = {"latent": {"kind": "posterior_mean", "dtype": "BF16", "channels": 4, "factor": 8},
        "text": {"dtype": "BF16", "pooled_dim": 8, "encoders": [{"id": "x", "hidden_size": 16}]}}  # fmt: skip


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def sample(sid: int, caption: str | None, bucket=(64, 32), seed: int = 0) -> SampleRecord:
    bw, bh = bucket
    latent = bf16_bits(np.random.default_rng(seed).normal(size=(4, bh // 8, bw // 8)))
    return SampleRecord(sample_id=sid, bucket=f"{bw}x{bh}", latent=latent, dtype="BF16", original_size=(50, 90),
                        resized_size=(36, 64), crop_top_left=(2, 0), target_size=(bh, bw),
                        caption_key=caption_key(caption))  # fmt: skip


def text(caption: str | None, length: int) -> TextRecord:
    rng = np.random.default_rng(length)
    return TextRecord(caption_key=caption_key(caption), tokens=(bf16_bits(rng.normal(size=(length, 16))),),
                      pooled=bf16_bits(rng.normal(size=8)), dtype="BF16")  # fmt: skip


def build_cache(url: str, storage_options=None, n: int = 10, shard_records: int = 4) -> dict[int, SampleRecord]:
    """A committed cache of ``n`` synthetic samples with 3 captions (incl. the null one), no Ray."""
    from manifests.cache.records import encode_sample, encode_text

    writer = CacheWriter(url, SETTINGS, info=INFO, storage_options=storage_options, shard_records=shard_records)
    captions = [None, "a cat", "a dog"]
    for i, c in enumerate(captions):
        writer.add_text(caption_key(c), encode_text(text(c, 2 + 5 * i)))
    writer.commit("texts")
    out = {}
    for i in range(n):
        rec = sample(1000 + i, captions[i % 3], bucket=(64, 32) if i % 2 else (32, 64), seed=i)
        writer.add_sample(rec.sample_id, encode_sample(rec), rec.caption_key, rec.bucket)
        out[rec.sample_id] = rec
    writer.finish("manifest-fp")
    return out


def test_safetensors_round_trip_and_interop():
    import torch
    from safetensors.torch import load as st_load

    x = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    tensors = {"a": (bf16_bits(x), "BF16"), "b": (x.astype(np.float16), "F16"), "c": (x, "F32")}
    data = cf.encode_tensors(tensors, {"k": "v"})
    (n,) = struct.unpack("<Q", data[:8])
    assert data[8:9] == b"{" and (8 + n) % 8 == 0  # a JSON header, data 8-byte aligned: no pickle
    json.loads(data[8 : 8 + n])
    back, meta = cf.decode_tensors(data)
    assert meta == {"k": "v"}
    for name, (arr, tag) in tensors.items():
        assert back[name][1] == tag and np.array_equal(back[name][0], arr)
    # the reference safetensors implementation reads our bytes, bf16 included
    ref = st_load(data)
    assert ref["a"].dtype == torch.bfloat16
    assert torch.equal(ref["a"], cf.to_torch(*back["a"]))
    np.testing.assert_allclose(cf.to_float32(*back["a"]), x, rtol=1e-2)


def test_gzip_backends_read_each_other():
    payload = cf.encode_tensors({"x": (np.arange(1000, dtype=np.float32), "F32")}, {})
    ours = cf.gzip_compress(payload)
    assert ours[:2] == b"\x1f\x8b"
    assert gzip.decompress(ours) == payload  # stdlib reads what the fast backend wrote
    assert cf.gzip_decompress(gzip.compress(payload)) == payload  # and the other way round
    import isal.igzip

    assert cf.gzip_decompress(isal.igzip.compress(payload)) == payload


def test_gzip_decompress_reads_every_member_and_refuses_any_damage():
    """A planar record is several gzip members: all are read, in order; a cut inside or after any member, a
    flipped trailer CRC and bytes after the last member are RecordErrors, as gzip.decompress refuses them."""
    members = [gzip.compress(bytes([k]) * (70_000 + k), mtime=0) for k in range(3)]  # > one 64 KiB stored block
    data = b"".join(members)
    assert cf.gzip_decompress(data) == gzip.decompress(data)
    assert cf.gzip_decompress(memoryview(data)) == gzip.decompress(data)  # chunked reads hand over views
    assert cf.gzip_decompress(b"") == b""
    for cut in (5, len(members[0]) - 1, len(members[0]) + 12, len(data) - 4):
        with pytest.raises(cf.RecordError, match="gzip"):
            cf.gzip_decompress(data[:cut])
    bad_crc = bytearray(data)
    bad_crc[len(members[0]) - 8] ^= 1  # the first member's CRC-32
    for damaged in (bytes(bad_crc), data + b"garbage!"):
        with pytest.raises(cf.RecordError, match="gzip"):
            cf.gzip_decompress(damaged)
        with pytest.raises((OSError, EOFError)):
            gzip.decompress(damaged)


def test_corrupt_records_raise_record_error():
    blob = cf.encode_sample(sample(1, "x"))
    with pytest.raises(cf.RecordError):
        cf.decode_sample(blob[: len(blob) // 2])
    with pytest.raises(cf.RecordError):
        cf.decode_tensors(b"\xff" * 8 + b"{}")
    with pytest.raises(cf.RecordError):  # a text record is not a sample record
        cf.decode_sample(cf.encode_text(text("x", 3)))
    with pytest.raises(ValueError):
        cf.encode_tensors({"x": (np.zeros(2, np.float32), "BF16")}, {})


def test_sample_and_text_round_trip():
    rec = sample(7, "a cat")
    back = cf.decode_sample(cf.encode_sample(rec))
    assert np.array_equal(back.latent, rec.latent) and back.crop_box == (2, 0, 34, 64)
    assert (back.original_size, back.resized_size, back.target_size) == ((50, 90), (36, 64), (32, 64))
    t = cf.decode_text(cf.encode_text(text("a cat", 9)))
    assert t.lengths == (9,) and t.pooled.shape == (8,)
    assert caption_key(None) == caption_key("") != caption_key("a cat")


@pytest.mark.parametrize("where", ["local", "memory"])
def test_writer_reader_round_trip(tmp_path, where):
    url = str(tmp_path / "cache") if where == "local" else f"memory://cache-{tmp_path.name}"
    written = build_cache(url, n=10)
    meta = read_cache_meta(url)
    assert meta.complete and len(meta.index.samples) == 1  # compacted at finish
    assert (meta.counts.samples, meta.counts.texts, meta.counts.errors) == (10, 3, 0)
    assert "shards" not in meta.to_json()  # _cache.json names index parts only; the shards are in the index
    assert len(set(read_index(url)["samples"].column("shard").to_pylist())) == 3  # 4 + 4 + 2 records
    assert available_sample_ids(url).tolist() == sorted(written)
    reader = CacheReader(url)
    ids = [1007, 1000, 1003]
    got = reader.read(ids)
    assert [r.sample_id for r in got] == ids
    for r in got:
        assert np.array_equal(r.latent, written[r.sample_id].latent)
        assert r.text.caption_key == r.caption_key
    assert got[1].text.lengths == (2,)  # sample 1000 has the null caption
    t = got[0].torch()
    assert t["latent"].shape == (4, 4, 8) and t["time_ids"].tolist() == [50, 90, 2, 0, 32, 64]
    with pytest.raises(CacheError, match="not in cache"):
        reader.read([5])


def test_reopen_resumes_and_other_settings_are_refused(tmp_path):
    url = str(tmp_path / "cache")
    build_cache(url, n=5)
    writer = CacheWriter(url, SETTINGS, info=INFO)
    assert writer.done_samples == set(range(1000, 1005)) and len(writer.done_texts) == 3
    other = {**SETTINGS, "crop": "random", "vae": {"id": "x", "weights_sha256": "bb"}}
    with pytest.raises(CacheError, match=r"(?s)crop: 'center' -> 'random'.*weights_sha256: 'aa' -> 'bb'.*new --out"):
        CacheWriter(url, other, info=INFO)


def test_meta_refuses_non_caches(tmp_path):
    with pytest.raises(CacheError, match="has no _cache.json"):
        read_cache_meta(str(tmp_path))
    (tmp_path / "_cache.json").write_text(json.dumps({"kind": "bucketeer.cache", "format_version": 99}))
    with pytest.raises(CacheError, match="format version 99"):
        CacheReader(str(tmp_path))


@pytest.mark.s3
def test_round_trip_on_s3(s3, s3_client):
    url = s3.fresh_url("cache")
    written = build_cache(url, s3.storage_options, n=6)
    reader = CacheReader(url, s3.storage_options)
    expected = {"obstore": "ObstoreS3FileSystem", "fsspec": "SingleAttemptS3FileSystem"}[s3_client]
    assert type(reader.fs).__name__ == expected
    got = reader.read(sorted(written))
    assert [r.sample_id for r in got] == sorted(written)
    assert all(np.array_equal(r.latent, written[r.sample_id].latent) for r in got)


def manifest_rows(ids, sizes=None, captions=None, etags=None, mtimes=None, buckets=None) -> pa.Table:
    """A samples-like table with just the columns a source key reads (and the ids)."""
    n = len(ids)
    return pa.table({
        "sample_id": pa.array(ids, pa.uint64()),
        "size": pa.array(sizes or [100 + i for i in range(n)], pa.int64()),
        "etag": pa.array(etags or [None] * n, pa.string()),
        "mtime": pa.array(mtimes or [1.5e9 + i for i in range(n)], pa.float64()),
        "caption": pa.array(captions or ["a cat"] * n, pa.string()),
        "bucket": pa.array(buckets or ["64x32"] * n, pa.string()),
    })  # fmt: skip


def test_source_key_tracks_exactly_the_inputs_of_a_record():
    base = pa.table({"size": pa.array([123, 456], pa.int64()), "etag": pa.array(['"abc"', None]),
                     "mtime": pa.array([None, 1700000000.25]), "caption": pa.array(["a cat", None]),
                     "bucket": ["64x32", "32x64"]})  # fmt: skip
    # pinned: keys are stored in caches, so the function must never drift between versions
    assert source_key(base).tolist() == [7949151076773694728, 8462699479086781070]
    key = source_key(base)

    def changed(column: str, values: list) -> list[bool]:
        i = base.column_names.index(column)
        table = base.set_column(i, column, pa.array(values, base.schema.field(column).type))
        return (source_key(table) != key).tolist()

    assert changed("size", [124, 456]) == [True, False]
    assert changed("caption", ["a cat", "a dog"]) == [False, True]
    assert changed("caption", ["a cat", ""]) == [False, False]  # null and empty captions embed the same
    assert changed("bucket", ["32x64", "32x64"]) == [True, False]
    assert changed("mtime", [5.0, 1700000000.5]) == [False, True]  # mtime counts only without an etag
    assert changed("etag", ['"abd"', '"x"']) == [True, True]
    # other columns (dimensions, format, ...) do not enter; absent etag/mtime columns mean null
    assert source_key(base.append_column("width", pa.array([1, 2], pa.int32()))).tolist() == key.tolist()
    no_version = base.set_column(1, "etag", pa.nulls(2, pa.string())).set_column(2, "mtime", pa.nulls(2, pa.float64()))
    assert source_key(base.drop_columns(["etag", "mtime"])).tolist() == source_key(no_version).tolist()
    assert source_key(base.slice(1)).tolist() == key[1:].tolist()
    big = manifest_rows(list(range(2500)), captions=[f"caption {i % 7}" for i in range(2500)])
    from manifests.cache import freshness as cache_freshness

    whole = source_key(big)
    old = cache_freshness._CHUNK_ROWS
    cache_freshness._CHUNK_ROWS = 1000  # chunking must not change any key
    try:
        assert np.array_equal(source_key(big), whole)
    finally:
        cache_freshness._CHUNK_ROWS = old
    assert len(np.unique(whole)) == 2500 and source_key(big.slice(0, 0)).dtype == np.uint64


def test_newest_row_wins_and_freshness_follows_the_manifest(tmp_path):
    url = str(tmp_path / "cache")
    written = build_cache(url, n=6)  # rows without source keys, as caches before them were written
    ids = sorted(written)
    manifest = manifest_rows(ids)
    keys = source_key(manifest)
    status = cache_freshness(url, manifest)
    assert status.stale.all() and available_sample_ids(url, manifest=manifest).tolist() == []

    # a second run: 1000 re-embedded (new latent), 1001 now fails to decode, 1002/1003 get keys
    from manifests.cache.records import encode_sample

    writer = CacheWriter(url, SETTINGS, info=INFO, shard_records=4)
    new = sample(1000, "a cat", seed=50)
    writer.add_sample(1000, encode_sample(new), new.caption_key, new.bucket, int(keys[0]))
    writer.add_error(1001, "img_1001.jpg", "not_an_image", "no decoder", int(keys[1]))
    for i in (2, 3):
        rec = written[ids[i]]
        writer.add_sample(rec.sample_id, encode_sample(rec), rec.caption_key, rec.bucket, int(keys[i]))
    with pytest.raises(AssertionError, match="twice in one run"):
        writer.add_sample(1000, encode_sample(new), new.caption_key, new.bucket, int(keys[0]))
    writer.commit()  # committed but not finished: the index parts overlap, the newest row wins
    tables = read_index(url)
    sample_ids = tables["samples"].column("sample_id").to_pylist()
    assert sorted(sample_ids) == [1000, 1002, 1003, 1004, 1005]
    assert tables["errors"].column("sample_id").to_pylist() == [1001]
    reader = CacheReader(url)
    assert np.array_equal(reader.read([1000])[0].latent, new.latent)
    with pytest.raises(CacheError, match="not in cache"):
        reader.read([1001])
    status = cache_freshness(url, manifest)
    assert status.fresh.tolist() == [True, False, True, True, False, False]
    assert status.failed.tolist() == [False, True, False, False, False, False]
    assert status.stale.tolist() == [False, False, False, False, True, True] and not status.missing.any()
    assert available_sample_ids(url, manifest=manifest).tolist() == [1000, 1002, 1003]
    # a manifest row the cache never saw is missing; another caption makes a fresh record stale
    grown = manifest_rows([*ids, 77], captions=["a dog"] + ["a cat"] * 6)
    counts = cache_freshness(url, grown).counts()
    assert counts == {"fresh": 2, "failed": 1, "retry": 0, "stale": 3, "missing": 1}

    meta = writer.finish("manifest-fp")
    assert (meta.counts.samples, meta.counts.texts, meta.counts.errors) == (5, 3, 1) and meta.superseded_records == 4
    assert all(len(meta.index.parts(kind)) == 1 for kind in ("samples", "texts", "errors"))
    assert read_index(url)["samples"].num_rows == 5 and verify_cache_ok(url)
    # the image is fixed: its record supersedes the error row
    writer = CacheWriter(url, SETTINGS, info=INFO)
    fixed = written[1001]
    writer.add_sample(1001, encode_sample(fixed), fixed.caption_key, fixed.bucket, int(keys[1]) + 1)
    writer.finish()
    assert read_index(url)["errors"].num_rows == 0 and 1001 in CacheReader(url).sample_ids.tolist()


def verify_cache_ok(url: str) -> bool:
    from manifests.cache.verify import verify_cache

    return verify_cache(url).ok


def test_merge_reads_covers_every_range_with_fewer_reads():
    from manifests.cache.reader import merge_reads

    ranges = [("b", 0, 10), ("a", 100, 110), ("a", 0, 10), ("a", 15, 30), ("a", 0, 10), ("a", 5000, 5010)]
    reads, where = merge_reads(ranges, max_gap=64)
    assert reads == [("a", 0, 30), ("a", 100, 110), ("a", 5000, 5010), ("b", 0, 10)]
    data = {"a": bytes(range(256)) * 20, "b": b"0123456789"}
    blocks = [data[p][s:e] for p, s, e in reads]
    for (p, s, e), (k, at) in zip(ranges, where):
        assert blocks[k][at : at + e - s] == data[p][s:e]
    assert merge_reads(ranges, max_gap=None)[0] == ranges  # merging off: one read per range
    assert len(merge_reads(ranges, max_gap=10_000)[0]) == 2  # one per object
    assert len(merge_reads(ranges, max_gap=10_000, max_block=200)[0]) == 3  # capped block size
    assert len(merge_reads(ranges, max_gap=10_000, max_block=100)[0]) == 4


def test_reader_with_and_without_merged_reads_agree(tmp_path):
    url = str(tmp_path / "cache")
    written = build_cache(url, n=10)
    ids = [1009, 1002, 1003, 1002, 1000]  # a repeat (padding) and neighbours in one shard
    for max_gap in (None, 0, 1 << 16):
        got = CacheReader(url, max_gap=max_gap).read(ids)
        assert [r.sample_id for r in got] == ids
        assert all(np.array_equal(r.latent, written[r.sample_id].latent) for r in got)


def test_local_files_read_ranges_hold_a_bounded_set_and_never_close_one_in_use(tmp_path):
    """LocalFiles (the local reader's pread path): a range's bytes, to the end for None, short past the end,
    the error of a missing file returned, not raised; at most ``keep`` descriptors held, none closed under a
    read: threads reading 12 files through keep=2 each get their own file's bytes."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from manifests.localfiles import LocalFiles

    paths = []
    for i in range(12):
        paths.append(str(tmp_path / f"f{i}"))
        with open(paths[-1], "wb") as f:
            f.write(bytes([i]) * 1000 + bytes(range(256)))
    files = LocalFiles(keep=2)
    data = open(paths[3], "rb").read()
    assert files.read(paths[3], 10, 20) == data[10:20]
    assert files.read(paths[3], 1000, None) == bytes(range(256))
    assert files.read(paths[3], 1200, 5000) == data[1200:]  # short at the end of the file, as a ranged GET
    assert isinstance(files.read(str(tmp_path / "nope"), 0, 5), FileNotFoundError)
    held = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731

    def check(k: int) -> bool:
        i = k % 12
        return files.read(paths[i], 990 + k % 7, 1010) == bytes([i]) * (10 - k % 7) + bytes(range(10))

    before = held()
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(check, range(3000)))
    assert len(files._held) <= 2 + 4 and held() <= before + 4  # keep, plus at most one per reading thread
    files.close()
    assert not files._held and held() <= before - 1


def test_a_local_cache_is_read_by_positional_reads_on_held_files(tmp_path, monkeypatch):
    """The reader of a local cache reads records with pread on descriptors it holds (not fsspec's open per
    range), one descriptor per shard however many reads; a pickled copy opens its own; a truncated or
    missing shard is still named."""
    import pickle

    url = str(tmp_path / "cache")
    written = build_cache(url, n=12, shard_records=4)
    reader = CacheReader(url, max_gap=None)
    monkeypatch.setattr(type(reader.fs), "open", lambda *a, **k: pytest.fail("a record read opened a file"))
    ids = sorted(written) * 3
    got = reader.read(ids)
    assert [r.sample_id for r in got] == ids
    assert all(np.array_equal(r.latent, written[r.sample_id].latent) for r in got)
    assert len(reader._files._held) == 4  # 3 sample shards + the text shard, each opened once
    copy = pickle.loads(pickle.dumps(reader))
    assert copy._files is not reader._files and not copy._files._held
    assert copy.read(ids[:2])[1].sample_id == ids[1]
    monkeypatch.undo()
    shard = sorted(p for p in (tmp_path / "cache" / "shards").iterdir() if p.name.startswith("samples-"))[-1]
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CacheError, match="truncated"):
        CacheReader(url).read(ids)
    shard.unlink()
    with pytest.raises(CacheError, match="missing"):
        CacheReader(url).read(ids)


def test_chunked_reads_agree_fetch_fewer_hold_a_bounded_lru_and_catch_truncation(tmp_path, monkeypatch):
    """read_in_chunks (window-shuffled plans): the same records as one read per record, fewer reads for a run
    of neighbours, at most the budget held, and a truncated shard still named."""
    import manifests.cache.reader as reader_module

    url = str(tmp_path / "cache")
    written = build_cache(url, n=24, shard_records=12)
    reads: list[int] = []
    real = reader_module.read_many
    monkeypatch.setattr(reader_module, "read_many",
                        lambda fs, paths, *a, **k: reads.append(len(paths)) or real(fs, paths, *a, **k))  # fmt: skip
    ids = sorted(written)  # written in id order: neighbours in a shard
    direct = CacheReader(url, max_gap=None)
    expected = direct.read(ids)
    one_each = sum(reads)
    reads.clear()
    chunked = CacheReader(url, max_gap=None)
    shard = max(chunked._shard_end.values())
    chunked.read_in_chunks(chunk_bytes=shard // 3 + 1, budget_bytes=shard)
    got = chunked.read(ids[::-1])[::-1]
    assert [r.sample_id for r in got] == ids and one_each >= len(ids)
    assert all(np.array_equal(a.latent, b.latent) and a.caption_key == b.caption_key for a, b in zip(got, expected))
    assert sum(reads) <= 2 * 3 + 1 < one_each  # ~3 chunks per sample shard (+ the texts' shard)
    assert chunked._chunks_held <= shard and len(chunked._chunks) < 7  # bounded: not every chunk read
    reads.clear()
    assert chunked.read(ids[:2])[0].sample_id == ids[0] and sum(reads) == 0  # the last chunk fetched is held
    shard_path = next(p for p in (tmp_path / "cache" / "shards").iterdir() if p.name.startswith("samples-"))
    shard_path.write_bytes(shard_path.read_bytes()[: shard_path.stat().st_size // 2])
    fresh = CacheReader(url)
    fresh.read_in_chunks(chunk_bytes=shard // 3 + 1)
    with pytest.raises(CacheError, match="truncated"):
        fresh.read(ids)


def test_the_writer_opens_on_the_index_the_caller_read(tmp_path):
    """embed reads the committed index once (freshness) and opens its writer on that same read."""
    import os

    url = str(tmp_path / "cache")
    written = build_cache(url, n=6)
    index = read_index(url)
    assert cache_freshness(url, manifest_rows(sorted(written)), index=index).counts()["stale"] == 6
    for part in read_cache_meta(url).index.samples:
        os.remove(tmp_path / "cache" / part)  # a second read of the index would fail now
    writer = CacheWriter(url, SETTINGS, info=INFO, index=index)
    assert writer.done_samples == set(written) and len(writer.done_texts) == 3 and not writer.done_errors
    with pytest.raises(CacheError, match="index part .* is missing"):
        CacheWriter(url, SETTINGS, info=INFO)


def test_committer_keeps_metadata_small_merges_parts_and_drops_redone_rows(tmp_path):
    """Workers' shards, the driver's commits: _cache.json never names shards and stays small
    (O(log shards) names), this run's index parts are merged (8 into 1), a unit redone after a worker
    died (same sample ids, another shard object) is dropped, not committed twice."""
    from manifests.cache import CacheCommitter, ShardWriter
    from manifests.cache.writer import MERGE_FANIN
    from manifests.storage import open_url

    url = str(tmp_path / "cache")
    committer = CacheCommitter(url, SETTINGS, INFO, commit_seconds=0)
    fs, root = open_url(url)
    sizes = []
    for unit in range(2 * MERGE_FANIN + 1):
        shard = ShardWriter("samples")
        for sid in range(unit * 3, unit * 3 + 3):
            shard.append(bytes([unit]) * 10, sample_id=sid, caption_key=7, bucket="64x32", source_key=sid)
        rows, _ = shard.write(fs, root)
        assert committer.add("samples", rows) == 3
        if unit == 2:  # the same unit, redone elsewhere: other bytes, so another shard object
            again = ShardWriter("samples")
            for sid in range(6, 9):
                again.append(b"redone", sample_id=sid, caption_key=7, bucket="64x32", source_key=sid)
            assert committer.add("samples", again.write(fs, root)[0]) == 0
        committer.commit()
        sizes.append(len((tmp_path / "cache" / "_cache.json").read_bytes()))
    meta = read_cache_meta(url)
    assert "shards" not in meta.to_json() and len(meta.index.samples) == 3  # 8 -> 1, 8 -> 1, and 1
    # a merge shrinks _cache.json back; 16 shards later it names one part more (a level), not 16
    assert sizes[MERGE_FANIN - 1] < sizes[MERGE_FANIN - 2]
    assert sizes[2 * MERGE_FANIN - 1] - sizes[MERGE_FANIN - 1] < 100
    assert committer.redone == 3
    ids = read_index(url)["samples"].column("sample_id").to_pylist()
    assert sorted(ids) == list(range(3 * (2 * MERGE_FANIN + 1)))
    assert len({p.name for p in (tmp_path / "cache" / "index").iterdir()}) == 3  # merged parts removed
    index = read_index(url)["samples"]
    lengths = dict(zip(index.column("sample_id").to_pylist(), index.column("length").to_pylist()))
    assert lengths[7] == 10  # the first unit's record; the redone shard is unreferenced
    assert committer.finish().complete and len(read_cache_meta(url).index.samples) == 1
