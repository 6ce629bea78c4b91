"""The record layouts: byte-plane records round-trip bit for bit and are plain RFC 1952 gzip; a caption only one
sample has lives in its record (one read); caches of the older ``plain`` layout still read, verify and continue."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load

from manifests.cache import CacheReader, CacheWriter, read_cache_meta, read_index
from manifests.cache import codec
from manifests.cache.records import decode_sample, decode_text, encode_sample, encode_text, to_torch
from manifests.cache.verify import verify_cache
from tests.test_cache_format import INFO, SETTINGS, sample, text

FIXTURE_CACHE = Path(__file__).parent / "fixtures" / "v0_2" / "cache"


def _tensors(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, str]]:
    bf16 = (rng.standard_normal((4, 16, 24), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return {"bf16": (bf16, "BF16"), "f16": (rng.standard_normal((300,)).astype("<f2"), "F16"),
            "f32": (rng.standard_normal((17, 31)).astype("<f4"), "F32"),
            "small": (np.arange(5, dtype="<u2"), "BF16"),  # too small to split: stored whole
            "crops": (np.arange(6, dtype="<i4").reshape(3, 2), "I32"), "scalar": (np.array(3.5, "<f4"), "F32")}


def test_planar_records_round_trip_bit_for_bit_and_are_gzip():
    tensors = _tensors(np.random.default_rng(0))
    data = codec.encode_record(tensors, {"kind": "x"})
    assert codec.record_layout(data) == "planar"
    back, meta = codec.decode_record(data)
    assert meta == {"kind": "x"} and back.keys() == tensors.keys()
    for name, (array, tag) in tensors.items():
        assert back[name][1] == tag and back[name][0].dtype == array.dtype and np.array_equal(back[name][0], array)
    head, low = codec.encode_planar(tensors, {"kind": "x"})
    assert gzip.decompress(data) == head + low  # any gzip reader inflates both members as one stream
    header = json.loads(head[8 : 8 + int.from_bytes(head[:8], "little")])
    assert {n for n, e in header.items() if "planes" in e} == {"bf16", "f16", "f32"}
    plain = codec.encode_record(tensors, {"kind": "x"}, layout="plain")
    assert codec.record_layout(plain) == "plain"
    assert all(np.array_equal(codec.decode_record(plain)[0][n][0], a) for n, (a, _) in tensors.items())
    # bf16 activations: the exponent plane compresses, the mantissa plane is stored
    big = {"t": ((np.random.default_rng(1).standard_normal(1 << 16, dtype=np.float32).view(np.uint32) >> 16)
                 .astype(np.uint16), "BF16")}  # fmt: skip
    assert len(codec.encode_record(big, {})) < 0.9 * len(codec.encode_record(big, {}, layout="plain"))


def test_corrupt_planar_records_raise_record_error():
    data = codec.encode_record(_tensors(np.random.default_rng(2)), {})
    with pytest.raises(codec.RecordError):
        codec.decode_record(data[: len(data) - 100])
    head, low = codec.encode_planar({"x": (np.zeros(1000, "<u2"), "BF16")}, {})
    bad = head.replace(b'"planes":[0,1000]', b'"planes":[0,9999]')
    assert bad != head
    with pytest.raises(codec.RecordError, match="do not fit"):
        codec.decode_tensors(bad + low)


def test_inline_text_reads_with_one_fetch_and_shared_captions_stay_apart(tmp_path):
    url = str(tmp_path / "cache")
    writer = CacheWriter(url, SETTINGS, info=INFO, shard_records=4)
    shared = text("shared", 3)
    writer.add_text(shared.caption_key, encode_text(shared))
    want = {}
    for i in range(6):
        caption = "shared" if i % 2 else f"only {i}"
        record = sample(100 + i, caption, seed=i)
        inline = i % 2 == 0
        if inline:
            record = record.__class__(**{**record.__dict__, "text": text(caption, 4 + i)})
        writer.add_sample(record.sample_id, encode_sample(record, inline_text=inline), record.caption_key,
                          record.bucket, text_inline=inline)  # fmt: skip
        want[record.sample_id] = (record, record.text if inline else shared)
    meta = writer.finish("fp")
    assert meta.records.layouts == ("planar",) and meta.counts.texts == 4  # 3 inline + 1 shared
    assert meta.bytes.per_caption is not None and meta.bytes.texts < meta.bytes.samples
    index = read_index(url)
    texts = {r["caption_key"]: r["shard"] for r in index["texts"].to_pylist()}
    assert sorted(s.split("-")[0] for s in texts.values()) == ["shards/samples"] * 3 + ["shards/texts"]
    reader = CacheReader(url)
    fetched = []
    fetch = reader._fetch
    reader._fetch = lambda items: fetched.append(len(items)) or fetch(items)
    ids = [100, 102, 104]
    for record, sid in zip(reader.read(ids), ids):
        assert np.array_equal(record.latent, want[sid][0].latent)
        assert all(np.array_equal(a, b) for a, b in zip(record.text.tokens, want[sid][1].tokens))
    assert fetched == [3]  # one read per sample, no text record
    records = reader.read([101, 103])
    assert fetched[-1] == 3 and all(np.array_equal(r.text.tokens[0], shared.tokens[0]) for r in records)
    # the text of an inline caption is also readable by its key (its text row names the sample's record)
    inline_key = want[102][0].caption_key
    assert np.array_equal(reader.read_texts([inline_key])[0].pooled, want[102][1].pooled)
    assert verify_cache(url).ok
    # verify checks an inline record as a sample and as its caption's text: damage names that sample only
    row = next(r for r in index["samples"].to_pylist() if r["sample_id"] == 102)
    path = tmp_path / "cache" / row["shard"]
    data = bytearray(path.read_bytes())
    data[row["offset"] + row["length"] // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert verify_cache(url).bad_sample_ids == [102]


def test_old_layout_cache_reads_back_equal_and_continues(tmp_path):
    """The 0.2 fixture cache (plain records, no text_inline column, no ``records``) reads as the reference
    safetensors implementation reads its bytes; continued by this writer it holds both layouts."""
    url = str(shutil.copytree(FIXTURE_CACHE, tmp_path / "cache"))
    meta = read_cache_meta(url)
    assert meta.records is None
    index = read_index(url)
    rows = index["samples"].to_pylist()
    reader = CacheReader(url)
    records = reader.read([r["sample_id"] for r in rows])
    for row, record in zip(rows, records):
        blob = (Path(url) / row["shard"]).read_bytes()[row["offset"] : row["offset"] + row["length"]]
        assert codec.record_layout(blob) == "plain"
        ref = st_load(gzip.decompress(blob))  # the reference implementation, bf16 included
        assert torch.equal(to_torch(record.latent, record.dtype), ref["latent"])
        trow = next(t for t in index["texts"].to_pylist() if t["caption_key"] == row["caption_key"])
        tblob = (Path(url) / trow["shard"]).read_bytes()[trow["offset"] : trow["offset"] + trow["length"]]
        tref = st_load(gzip.decompress(tblob))
        assert torch.equal(to_torch(record.text.tokens[0], record.text.dtype), tref["tokens.0"])

    # continued by this bucketeer: a new sample, its caption inline, in the planar layout
    first = records[0]
    writer = CacheWriter(url, meta.settings.to_json())
    new = first.__class__(**{**first.__dict__, "sample_id": 7, "caption_keys": None})
    writer.add_sample(7, encode_sample(new, inline_text=True), new.caption_key, new.bucket, text_inline=True)
    meta = writer.finish("fp")
    assert meta.records.layouts == ("plain", "planar")
    again = CacheReader(url).read([7, rows[0]["sample_id"]])
    assert np.array_equal(again[0].latent, first.latent) and np.array_equal(again[1].latent, first.latent)
    assert all(np.array_equal(a, b) for a, b in zip(again[0].text.tokens, first.text.tokens))
    assert verify_cache(url).ok
    assert decode_text(encode_text(first.text)).caption_key == first.caption_key
    assert decode_sample(encode_sample(first, layout="plain")).sample_id == first.sample_id
