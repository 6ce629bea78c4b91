"""Damage caught twice: by `bucketeer verify` (listing the sample) and by the reader (naming sample + shard)."""

from __future__ import annotations

import numpy as np
import pytest

from manifests.cache import CacheError, CacheReader, read_cache_meta, read_index
from manifests.cache.records import encode_sample
from manifests.cache.verify import verify_cache
from manifests.storage import join, open_url
from pipeline import VerifyJob, run
from pipeline.cli import main
from tests.test_cache_format import build_cache, sample


def _victim(url: str, storage_options=None) -> tuple[int, str, int, int]:
    """(sample_id, shard, offset, length) of one record in the middle of a shard."""
    row = [r for r in read_index(url, storage_options)["samples"].to_pylist() if r["offset"] > 0][0]
    return row["sample_id"], row["shard"], row["offset"], row["length"]


def _damage(url: str, how: str, storage_options=None) -> tuple[set[int], str]:
    fs, root = open_url(url, storage_options)
    sid, shard, offset, length = _victim(url, storage_options)
    path = join(root, shard)
    data = bytearray(fs.cat_file(path))
    in_shard = {r["sample_id"] for r in read_index(url, storage_options)["samples"].to_pylist() if r["shard"] == shard}
    if how == "corrupt":
        data[offset + length // 2] ^= 0xFF
        fs.pipe_file(path, bytes(data))
        return {sid}, shard
    if how == "truncate":
        fs.pipe_file(path, bytes(data[: offset + length // 2]))
        return _after(url, shard, offset, storage_options), shard  # the victim and every record after it
    fs.rm(path)
    return in_shard, shard


def _after(url: str, shard: str, offset: int, storage_options=None) -> set[int]:
    return {r["sample_id"] for r in read_index(url, storage_options)["samples"].to_pylist()
            if r["shard"] == shard and r["offset"] >= offset}  # fmt: skip


@pytest.mark.parametrize("how", ["corrupt", "truncate", "missing"])
def test_damage_is_caught_by_verify_and_reader(tmp_path, how, capsys):
    url = str(tmp_path / "cache")
    build_cache(url, n=10)
    assert verify_cache(url).ok
    bad, shard = _damage(url, how)

    result = verify_cache(url)
    assert set(result.bad_sample_ids) == bad
    assert all(b.shard == shard for b in result.bad)
    checked = run(VerifyJob(cache=url, max_listed=len(bad)))
    assert checked.exit_code == 1 and set(checked.bad_sample_ids) == bad and not checked.ok
    err = capsys.readouterr().err
    assert all(f"sample {s}" in err for s in bad) and shard in err and "more" not in err

    reader = CacheReader(url)
    victim = sorted(bad)[0]
    with pytest.raises(CacheError) as e:
        reader.read([victim])
    msg = str(e.value)
    assert f"sample {victim}" in msg and shard in msg and "bucketeer verify" in msg
    good = [s for s in reader.sample_ids.tolist() if s not in bad]
    assert len(reader.read(good)) == len(good)  # the rest of the cache stays readable


def test_verify_checks_shapes_and_finite_values(tmp_path, capsys):
    from manifests.cache import CacheWriter
    from tests.test_cache_format import INFO, SETTINGS

    url = str(tmp_path / "cache")
    build_cache(url, n=4)
    writer = CacheWriter(url, SETTINGS, info=INFO)
    wrong_shape = sample(2001, "a cat", bucket=(64, 32))
    wrong_shape = type(wrong_shape)(**{**wrong_shape.__dict__, "bucket": "64x64", "target_size": (64, 64)})
    nan = sample(2002, "a cat")
    nan.latent.flags.writeable = True
    nan.latent[0, 0, 0] = 0x7FC0  # bf16 NaN
    for rec in (wrong_shape, nan):
        writer.add_sample(rec.sample_id, encode_sample(rec), rec.caption_key, rec.bucket)
    writer.finish()
    result = verify_cache(url)
    reasons = {b.sample_id: b.reason for b in result.bad}
    assert set(reasons) == {2001, 2002}
    assert "latent shape (4, 4, 8) != (4, 8, 8)" in reasons[2001] and "non-finite" in reasons[2002]
    # the command line: exit code 1 when a record is bad, 2 and one line when there is no cache
    assert main(["verify", url]) == 1
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert "has no _cache.json" in capsys.readouterr().err


def test_verify_ok_exit_zero(tmp_path, capsys):
    url = str(tmp_path / "cache")
    build_cache(url, n=3)
    result = run(VerifyJob(cache=url))
    assert result.exit_code == 0 and (result.checked_samples, result.checked_texts, result.complete) == (3, 3, True)
    assert "OK - 3 sample records and 3 text records" in capsys.readouterr().out
    assert read_cache_meta(url).complete


@pytest.mark.s3
@pytest.mark.parametrize("how", ["corrupt", "missing"])
def test_damage_on_s3(s3, how):
    url, so = s3.fresh_url("cache"), s3.storage_options
    build_cache(url, so, n=8)
    bad, shard = _damage(url, how, so)
    assert set(verify_cache(url, so).bad_sample_ids) == bad
    with pytest.raises(CacheError, match=f"sample {sorted(bad)[0]} in shard {shard}"):
        CacheReader(url, so).read([sorted(bad)[0]])
    assert np.all(np.isin(list(bad), CacheReader(url, so).sample_ids))
