"""Several captions per image: from a table's list column, numbered sidecars and a tar .json list, into
the manifest's ``captions`` column, embedded once per distinct caption, and chosen by the trainer. The
module's one cache is embedded with ``--latents posterior``: the trainer's posterior draws are checked
on it too (one embed, one Ray for both; the pure parts are in tests/test_posterior.py)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from manifests.cache import CacheReader, read_cache_meta, read_index
from manifests.cache.verify import verify_cache
from manifests.cache.records import caption_key, to_float32
from manifests.manifest import read_manifest
from manifests.schema import sample_id
from pipeline import ScanJob, run
from pipeline.scan import ScanConfig
from pipeline.sources.captions import caption_list, sidecar_number
from tests.embed_data import SPEC, jpeg, embed_cache
from tests.shards import tar_bytes
from train.data import BadRecordError, BatchLoader, PlanStep

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("bucketeer_home")]

QUIET = ScanConfig(progress=False)
# (image, {sidecar name: text}); a table gives d and e; photo.2023's number is a year, not a caption number
SIDECARS = {
    "a.jpg": {"a.txt": "first a", "a.1.txt": "second a", "a.2.txt": "third a"},
    "b.jpg": {"b.txt": "shared caption"},
    "c.jpg": {"c.0.txt": "shared caption", "c.1.txt": "   ", "c.2.txt": "only c"},  # the blank one is dropped
    "d.jpg": {},
    "e.jpg": {},
    "photo.2023.jpg": {"photo.2023.txt": "year photo"},
    "f.jpg": {"f.txt": "f itself"},
    "f.1.jpg": {"f.1.txt": "f.1 itself"},  # an image's own sidecar, not f's second caption
}
TABLE = {"d.jpg": ["from table one", "first a"], "e.jpg": ["single"]}
DISTINCT = {"first a", "second a", "third a", "shared caption", "only c", "from table one", "single", "year photo",
            "f itself", "f.1 itself"}


@dataclass(frozen=True)
class Captioned:
    root: Path
    table: str
    manifest: str
    cache: str
    summary: dict


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    os.utime(path, (1_700_000_000, 1_700_000_000))  # fixed: a rewrite below changes size, not just mtime


@pytest.fixture(scope="module")
def captioned(tmp_path_factory, ray_local) -> Captioned:
    base = tmp_path_factory.mktemp("captions")
    root = base / "images"
    root.mkdir()
    for i, (image, sidecars) in enumerate(SIDECARS.items()):
        _write(root / image, jpeg(96, 64, seed=i))
        for name, text in sidecars.items():
            _write(root / name, text.encode())
    table = str(base / "captions.parquet")
    pq.write_table(pa.table({"filename": list(TABLE), "caption": pa.array(list(TABLE.values()),
                                                                           pa.list_(pa.string()))}), table)
    manifest, cache = str(base / "manifest"), str(base / "cache")
    meta = run(ScanJob(source=str(root), out=manifest, spec=SPEC, captions=table, config=QUIET)).meta
    embed_cache(manifest, cache, latents="posterior")
    return Captioned(root, table, manifest, cache, meta.summary)


def _rows(manifest: str) -> dict[str, dict]:
    return {r["filename"]: r for r in read_manifest(manifest).samples.to_pylist()}


def test_numbering_rule_and_list_cleaning():
    assert sidecar_number("a/img.2") == ("a/img", 2) and sidecar_number("a/img") == ("a/img", 0)
    assert sidecar_number("photo.2023") == ("photo.2023", 0)  # more than 3 digits: part of the name
    assert sidecar_number(".1") == (".1", 0) and sidecar_number("a/.1") == ("a/.1", 0)
    assert caption_list([" x\n y ", "", None, "z"]) == ("x y", ["x y", "z"], 2)
    assert caption_list(["only"]) == ("only", None, 0) and caption_list([]) == (None, None, 0)


@pytest.mark.slow
def test_sidecars_and_table_lists_reach_the_manifest(captioned):
    rows = _rows(captioned.manifest)
    got = {name: (r["caption"], r["captions"]) for name, r in rows.items()}
    assert got == {
        "a.jpg": ("first a", ["first a", "second a", "third a"]),
        "b.jpg": ("shared caption", None),
        "c.jpg": ("shared caption", ["shared caption", "only c"]),
        "d.jpg": ("from table one", ["from table one", "first a"]),
        "e.jpg": ("single", None),
        "photo.2023.jpg": ("year photo", None),
        "f.jpg": ("f itself", None),
        "f.1.jpg": ("f.1 itself", None),
    }
    assert rows["a.jpg"]["caption_source"].startswith("sidecars:sidecar:")
    assert rows["a.jpg"]["caption_source"].endswith(":a.2.txt") and "a.1.txt|" in rows["a.jpg"]["caption_source"]
    assert rows["b.jpg"]["caption_source"].startswith("sidecar:") and rows["d.jpg"]["caption_source"].startswith(
        "table:")
    assert captioned.summary.empty_captions_dropped == 1 and captioned.summary.caption_lists == 3


def test_distinct_captions_are_embedded_once_and_every_key_is_indexed(captioned):
    texts = read_index(captioned.cache)["texts"].column("caption_key").to_pylist()
    assert sorted(texts) == sorted({caption_key(c) for c in DISTINCT} | {caption_key("")})  # "" for dropout
    samples = {r["sample_id"]: r for r in read_index(captioned.cache)["samples"].to_pylist()}
    a, b = samples[sample_id("a.jpg")], samples[sample_id("b.jpg")]
    assert a["caption_keys"] == [caption_key(c) for c in SIDECARS["a.jpg"].values()]
    assert a["caption_key"] == caption_key("first a") and b["caption_keys"] is None
    assert verify_cache(captioned.cache).ok


def test_the_trainer_takes_the_caption_the_plan_chose(captioned):
    reader = CacheReader(captioned.cache)
    meta = read_cache_meta(captioned.cache)
    bucket = _rows(captioned.manifest)["a.jpg"]["bucket"]
    ids = (sample_id("a.jpg"), sample_id("c.jpg"), sample_id("b.jpg"))
    steps = [PlanStep(0, 0, bucket, ids), PlanStep(0, 1, bucket, ids, caption_index=np.array([2, 1, 0], np.uint8))]
    first, chosen = BatchLoader(reader, steps, meta.latent, log=lambda _: None)
    for batch, captions in ((first, ["first a", "shared caption", "shared caption"]),
                            (chosen, ["third a", "only c", "shared caption"])):  # fmt: skip
        texts = reader.read_texts([caption_key(c) for c in captions])
        text, mask, _ = BatchLoader(reader, [], meta.latent).layout.prompt_embeds(texts)
        np.testing.assert_array_equal(batch.text.numpy(), text)
    np.testing.assert_array_equal(first.latents.numpy(), chosen.latents.numpy())  # only the text differs
    beyond = PlanStep(0, 2, bucket, ids, caption_index=np.array([3, 0, 0]))  # a has 3 captions: 0..2
    with pytest.raises(BadRecordError, match="chose caption 3"):
        list(BatchLoader(reader, [beyond], meta.latent))


@pytest.mark.slow  # a second scan and embed
@pytest.mark.full
def test_changing_the_second_caption_rescans_and_reembeds_that_sample_only(captioned, tmp_path, capsys):
    # copies of the source, manifest and cache, so that the module's stay as built
    root, manifest, cache = tmp_path / "images", str(tmp_path / "manifest"), str(tmp_path / "cache")
    root.mkdir()
    for path in captioned.root.iterdir():
        _write(root / path.name, path.read_bytes())
    shutil.copytree(captioned.manifest, manifest)
    shutil.copytree(captioned.cache, cache)
    before = _rows(manifest)
    _write(root / "a.1.txt", b"second a, rewritten")
    meta = run(ScanJob(source=str(root), out=manifest, spec=SPEC, captions=captioned.table, config=QUIET)).meta
    assert (meta.summary.reused, meta.summary.captions_read, meta.summary.files_read) == (8, 1, 0)
    after = _rows(manifest)
    assert after["a.jpg"]["captions"] == ["first a", "second a, rewritten", "third a"]
    assert after["a.jpg"]["caption_source"] != before["a.jpg"]["caption_source"]
    assert {n: r for n, r in after.items() if n != "a.jpg"} == {n: r for n, r in before.items() if n != "a.jpg"}
    capsys.readouterr()
    embed_cache(manifest, cache, latents="posterior")
    summary = read_cache_meta(cache).summary
    assert (summary.embedded, summary.changed, summary.new_captions) == (1, 1, 1)
    keys = {r["sample_id"]: r["caption_keys"] for r in read_index(cache)["samples"].to_pylist()}
    assert keys[sample_id("a.jpg")][1] == caption_key("second a, rewritten")
    assert verify_cache(cache).ok
    a = CacheReader(cache).read([sample_id("a.jpg")])[0]  # the record names every caption, as its index row
    assert a.caption_keys == tuple(keys[sample_id("a.jpg")])


def test_posterior_draws_are_per_epoch_and_exact_across_ranks_and_resumes(captioned):
    reader, latent = CacheReader(captioned.cache), read_cache_meta(captioned.cache).latent
    records = {r.sample_id: r for r in reader.read(reader.sample_ids)}
    bucket = _rows(captioned.manifest)["a.jpg"]["bucket"]
    ids = tuple(sid for sid, r in records.items() if r.bucket == bucket)[:4]
    assert len(ids) == 4 and all(records[i].latent_std is not None for i in ids)
    scale, shift = float(latent.scaling_factor), float(latent.shift_factor or 0.0)
    mean = (np.stack([to_float32(records[i].latent, records[i].dtype) for i in ids]) - shift) * scale  # (4, C, h, w)

    def latents(steps, **kw) -> list[np.ndarray]:
        return [b.latents.numpy() for b in BatchLoader(reader, steps, latent, log=lambda _: None, **kw)]

    steps = [PlanStep(e, s, bucket, ids) for e in range(2) for s in range(2)]
    whole = latents(steps, seed=5)
    assert not np.allclose(whole[0], mean)  # a draw, not the mean
    np.testing.assert_array_equal(whole[0], whole[1])  # the same (seed, epoch, sample): the same draw
    assert not np.allclose(whole[1], whole[2])  # a new epoch: a new draw
    assert not np.allclose(latents(steps[:1], seed=6)[0], whole[0])  # another seed: another draw
    np.testing.assert_allclose(latents(steps[:1], seed=5, posterior_sampling=False)[0], mean, rtol=1e-6)
    # a resume from (epoch 1, step 1), and the same step split over 2 ranks, draw exactly the same latents
    np.testing.assert_array_equal(latents(steps[3:], seed=5)[0], whole[3])
    halves = latents([PlanStep(1, 1, bucket, ids[:2])], seed=5) + latents([PlanStep(1, 1, bucket, ids[2:])], seed=5)
    np.testing.assert_array_equal(np.concatenate(halves), whole[3])
    std = np.stack([to_float32(records[i].latent_std, records[i].dtype) for i in ids]) * scale
    assert np.all(np.abs(whole[0] - mean) <= 6 * std + 1e-6)  # drawn with the stored spread


def test_tar_json_caption_lists(tmp_path, ray_local):
    fields = {"k0": ["tar one", "tar two", ""], "k1": [1, 2], "k2": "plain", "k3": [], "k4": ["alone"]}
    members = []
    for i, (key, value) in enumerate(fields.items()):
        members += [(f"{key}.jpg", jpeg(96, 64, seed=i)), (f"{key}.json", json.dumps({"text": value}).encode())]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "shard-0.tar").write_bytes(tar_bytes(members))
    out = str(tmp_path / "manifest")
    config = ScanConfig(progress=False, caption_field="text")
    meta = run(ScanJob(source=str(tmp_path / "src"), out=out, spec=SPEC, config=config)).meta
    rows = {r["filename"].split("/")[-1]: r for r in read_manifest(out).samples.to_pylist()}
    assert {k: (r["caption"], r["captions"]) for k, r in rows.items()} == {
        "k0.jpg": ("tar one", ["tar one", "tar two"]),  # the empty one is dropped
        "k1.jpg": (None, None),  # not strings: no caption, as for a .json that is not JSON
        "k2.jpg": ("plain", None),
        "k3.jpg": (None, None),  # an empty list: no caption
        "k4.jpg": ("alone", None),
    }
    assert rows["k0.jpg"]["caption_source"] == "member:shard-0.tar:k0.json#text"
    assert meta.summary.no_caption == 2
