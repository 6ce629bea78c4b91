"""Records carry their own identity: an index whose rows no longer name their records is caught.

A real cache (``run(EmbedJob)``) and plan are built once; each test copies them, tampers with the
copy the way a mixed-up index or an edited plan would, and checks that ``bucketeer verify`` exits 2
with one line and that the readers the trainer uses (:class:`CacheReader`, ``read_plan_rows`` for
one rank) refuse it in one line.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from manifests.cache import CacheError, CacheReader, read_cache_meta, read_index
from manifests.cache.records import caption_key, decode_sample, encode_sample, sample_mismatch
from manifests.plan import PlanError, epoch_part, read_plan_meta, read_plan_rows, read_rank_plan
from pipeline import PlanJob, VerifyJob, run
from pipeline.cli import main


@pytest.fixture(scope="module")
def built(tmp_path_factory, ray_local, bucketeer_home) -> SimpleNamespace:
    from tests.embed_data import embed_cache, make_dataset

    base = tmp_path_factory.mktemp("identity")
    manifest, cache, plan = str(base / "manifest"), str(base / "cache"), str(base / "plan")
    make_dataset(str(base / "images"), manifest, 10)
    embed_cache(manifest, cache)
    run(PlanJob(manifests=(manifest,), out=plan, world_size=2, batch_size=1, epochs=2, cache=(cache,),
                progress=False))  # fmt: skip
    assert run(VerifyJob(cache=cache)).exit_code == 0
    return SimpleNamespace(cache=cache, plan=plan)


def _copy(src: str, tmp_path: Path) -> str:
    dst = tmp_path / Path(src).name
    shutil.copytree(src, dst)
    return str(dst)


def _edit_index(cache: str, kind: str, edit) -> None:
    """Rewrite the index part of ``kind`` that holds most rows with ``edit(rows) -> rows`` (a list of dicts)."""
    parts = read_cache_meta(cache).index.parts(kind)
    path = max((Path(cache) / p for p in parts), key=lambda p: pq.read_metadata(p).num_rows)
    table = pq.read_table(path)
    pq.write_table(pa.Table.from_pylist(edit(table.to_pylist()), schema=table.schema), path)


def _swap(rows: list[dict], i: int, j: int, columns: tuple[str, ...]) -> list[dict]:
    for c in columns:
        rows[i][c], rows[j][c] = rows[j][c], rows[i][c]
    return rows


def _verify_exits_2_in_one_line(cache: str, capsys, *expected: str) -> str:
    with pytest.raises(CacheError) as e:
        run(VerifyJob(cache=cache))
    assert "\n" not in str(e.value) and all(x in str(e.value) for x in expected), str(e.value)
    capsys.readouterr()
    assert main(["verify", cache]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("bucketeer verify: error: ") and "re-embed" in errors[0]
    return str(e.value)


def _reader_refuses(cache: str, sample_ids: list[int], *expected: str) -> None:
    with pytest.raises(CacheError) as e:
        CacheReader(cache).read(sample_ids)
    msg = str(e.value)
    assert "\n" not in msg and "shard" in msg and "re-embed" in msg and all(x in msg for x in expected), msg


LOCATION = ("shard", "offset", "length", "crc32")  # where a row says its record is


@pytest.mark.slow
def test_swapped_sample_rows_are_caught(built, tmp_path, capsys):
    cache = _copy(built.cache, tmp_path)
    rows = read_index(cache)["samples"].to_pylist()
    a, b = rows[0]["sample_id"], rows[1]["sample_id"]
    by_id = {r["sample_id"]: r for r in rows}
    _edit_index(cache, "samples", lambda rs: _swap(rs, *[k for k, r in enumerate(rs) if r["sample_id"] in (a, b)],
                                                   LOCATION))  # fmt: skip
    assert read_index(cache)["samples"].num_rows == len(rows)  # every row is there, and each crc32 matches
    _verify_exits_2_in_one_line(cache, capsys, "records are not the ones the index names", "holds sample")
    _reader_refuses(cache, [a], f"the index names sample {a} but the record holds sample {b}")
    others = [s for s in by_id if s not in (a, b)]
    assert len(CacheReader(cache).read(others)) == len(others)  # the rest stays readable


def test_a_changed_caption_key_is_caught(built, tmp_path, capsys):
    cache = _copy(built.cache, tmp_path)
    rows = read_index(cache)["samples"].to_pylist()
    victim = rows[0]
    other = next(r["caption_key"] for r in rows if r["caption_key"] != victim["caption_key"])  # has a text record

    def recaption(rs: list[dict]) -> list[dict]:
        for r in rs:
            if r["sample_id"] == victim["sample_id"]:
                r["caption_key"] = other
        return rs

    _edit_index(cache, "samples", recaption)
    msg = _verify_exits_2_in_one_line(cache, capsys, ": 1 of ", f"sample {victim['sample_id']}")
    assert f"caption key {other} but its record was embedded with caption key {victim['caption_key']}" in msg
    _reader_refuses(cache, [victim["sample_id"]], f"caption key {victim['caption_key']}")


def test_swapped_text_rows_are_caught(built, tmp_path, capsys):
    cache = _copy(built.cache, tmp_path)
    texts = read_index(cache)["texts"].to_pylist()
    assert len(texts) >= 2
    a, b = texts[0]["caption_key"], texts[1]["caption_key"]
    _edit_index(cache, "texts", lambda rs: _swap(rs, *[k for k, r in enumerate(rs) if r["caption_key"] in (a, b)],
                                                 LOCATION))  # fmt: skip
    _verify_exits_2_in_one_line(cache, capsys, "text record", "the index names caption key")
    sample = next(r["sample_id"] for r in read_index(cache)["samples"].to_pylist() if r["caption_key"] == a)
    _reader_refuses(cache, [sample], f"the index names caption key {a} but the text record holds {b}")
    with pytest.raises(CacheError, match=f"caption key {b} but the text record holds {a}"):
        CacheReader(cache).read_texts([b])  # the validation prompts' and the empty caption's reads too


def _tamper_plan_keeping_size_and_footer(path: Path) -> None:
    """Flip one byte inside a data page: same size, same footer, other rows (or an unreadable page)."""
    data = bytearray(path.read_bytes())
    metadata = pq.read_metadata(path)
    column = metadata.row_group(0).column(metadata.row_group(0).num_columns - 1)  # sample_ids of rank 0
    data[column.data_page_offset + column.total_compressed_size // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_an_edited_plan_file_is_refused_by_the_ranks_reading_it(built, tmp_path):
    plan = _copy(built.plan, tmp_path)
    meta = read_plan_meta(plan)
    path = Path(plan) / epoch_part(1)
    size, footer = path.stat().st_size, path.read_bytes()[-meta.epochs[1].footer_bytes - 8 :]
    _tamper_plan_keeping_size_and_footer(path)
    assert path.stat().st_size == size and path.read_bytes().endswith(footer)  # size and footer still match
    for rank in range(2):  # rank 1's own row group is intact, but the file is not the one planned
        with pytest.raises(PlanError) as e:
            read_plan_rows(plan, [1], [rank], meta=meta).table()  # what train/data.py reads each epoch
        msg = str(e.value)
        assert "\n" not in msg and "epoch 1: epoch-00001.parquet does not hash to the sha256" in msg, msg
    with pytest.raises(PlanError, match="sha256"):
        read_rank_plan(plan, 0)
    assert read_rank_plan(plan, 0, epoch=0).num_rows == meta.epochs[0].steps  # the other epoch is fine


def test_the_plan_hash_streams_the_file_in_chunks(built):
    """The hash streams the file in ranged reads; a row group that straddles chunks comes out whole."""
    import fsspec

    from manifests.plan.parts import PartProblem, read_epoch_ranks
    from manifests.plan.read import plan_columns

    meta = read_plan_meta(built.plan)
    entry, fs, path = meta.epochs[0], fsspec.filesystem("file"), str(Path(built.plan) / epoch_part(0))
    want = plan_columns(meta)
    whole = read_epoch_ranks(fs, path, "e", entry, 2, [0, 1], want)
    for chunk in (7, 64, entry.bytes - 1):
        assert read_epoch_ranks(fs, path, "e", entry, 2, [0, 1], want, chunk=chunk) == whole
    wrong = replace(entry, sha256="0" * 64)
    with pytest.raises(PartProblem, match="does not hash"):
        read_epoch_ranks(fs, path, "e", wrong, 2, [1], want, chunk=64)


def test_sample_records_carry_every_caption_key():
    """A sample with several captions names them all, so rows with swapped caption lists are caught too."""
    from tests.test_cache_format import sample

    record = sample(7, "a cat")
    keys = (record.caption_key, caption_key("a kitten"))
    several = replace(record, caption_keys=keys)
    assert decode_sample(encode_sample(several)).caption_keys == keys
    assert decode_sample(encode_sample(record)).caption_keys is None  # one caption: bytes as before
    assert sample_mismatch(several, 7, keys[0], list(keys)) is None
    assert sample_mismatch(several, 7, keys[0], None) is None  # an index without the list
    assert "caption keys" in sample_mismatch(several, 7, keys[0], [keys[0], caption_key("a dog")])
    assert sample_mismatch(record, 7, keys[0], list(keys)) is None  # a record from before: compared on the rest


def test_swapped_caption_lists_are_caught(tmp_path, capsys):
    from manifests.cache import CacheWriter
    from manifests.cache.records import encode_text
    from tests.test_cache_format import INFO, SETTINGS, sample, text

    url = str(tmp_path / "cache")
    writer = CacheWriter(url, SETTINGS, info=INFO)
    captions = ["a cat", "a kitten", "a dog", "a puppy"]
    for i, c in enumerate(captions):
        writer.add_text(caption_key(c), encode_text(text(c, 2 + i)))
    first = caption_key("a cat")
    for sid, extra in ((1, "a kitten"), (2, "a dog")):
        rec = sample(sid, "a cat")
        rec = replace(rec, caption_keys=(first, caption_key(extra)))
        writer.add_sample(sid, encode_sample(rec), first, rec.bucket, caption_keys=list(rec.caption_keys))
    writer.finish()
    assert run(VerifyJob(cache=url)).exit_code == 0
    assert [r.text.caption_key for r in CacheReader(url).read([1, 2], [1, 1])] == [caption_key("a kitten"),
                                                                                   caption_key("a dog")]
    _edit_index(url, "samples", lambda rs: _swap(rs, 0, 1, ("caption_keys",)))
    _verify_exits_2_in_one_line(url, capsys, "caption keys")
    _reader_refuses(url, [1], "caption keys")
