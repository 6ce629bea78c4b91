"""``_cache.json`` as a typed :class:`~manifests.cache.CacheMeta`: the v0.2 fixture reads into it and
writes back the same dict (and bytes), a wrong kind or version is one CacheError line, and the
library calls ``run(VerifyJob)`` / ``run(EmbedJob)`` return results that agree with the file."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from manifests.cache import CACHE_FILE, CacheError, CacheMeta, fingerprint_of, read_cache_meta
from manifests.errors import UsageError
from pipeline import EmbedJob, VerifyJob, run
from tests.embed_data import embed_args, embed_cache, make_dataset

FIXTURE = Path(__file__).parent / "fixtures" / "v0_2" / "cache"


def test_the_v0_2_fixture_reads_into_typed_meta_and_back_exactly() -> None:
    text = (FIXTURE / CACHE_FILE).read_text()
    meta = read_cache_meta(str(FIXTURE))
    assert meta.to_json() == json.loads(text)
    assert json.dumps(meta.to_json(), indent=2, sort_keys=True) + "\n" == text  # what the committer writes
    assert meta.fingerprint == meta.settings.fingerprint == fingerprint_of(json.loads(text)["settings"])
    assert (meta.latent.scaling_factor, meta.latent.shift_factor, meta.latent.factor) == (0.18215, None, 8)
    assert meta.settings.vae.class_ == "AutoencoderKL" and meta.settings.buckets.area == 65536
    assert meta.text.encoders[0].hidden_size == meta.text_layout.width == 32
    assert (meta.counts.samples, meta.counts.texts, meta.summary.embedded) == (24, 21, 24)
    assert meta.index.parts("samples") == meta.index.samples and meta.complete


@pytest.mark.parametrize("change, message", [
    ({"format_version": 1}, "format version 1; this bucketeer reads version 2. Re-embed into a new --out"),
    ({"kind": "bucketeer.plan"}, "_cache.json is not a bucketeer.cache (kind='bucketeer.plan')"),
])  # fmt: skip
def test_a_wrong_version_or_kind_is_one_line(tmp_path: Path, change: dict, message: str) -> None:
    d = {**json.loads((FIXTURE / CACHE_FILE).read_text()), **change}
    with pytest.raises(CacheError, match=re.escape(message)) as e:
        CacheMeta.from_json(d, "s3://bucket/cache")
    assert "\n" not in str(e.value) and "s3://bucket/cache" in str(e.value)
    (tmp_path / CACHE_FILE).write_text(json.dumps(d))
    with pytest.raises(CacheError, match=re.escape(message)):
        read_cache_meta(str(tmp_path))


def test_keys_an_older_or_hand_made_file_lacks_stay_absent() -> None:
    d = json.loads((FIXTURE / CACHE_FILE).read_text())
    for key in ("summary", "compute", "bytes"):
        del d[key]
    del d["latent"]["shift_factor"], d["text"]["validation_prompts"]
    d["something_newer"] = {"kept": [1, 2]}
    meta = CacheMeta.from_json(d, "cache")
    assert meta.summary is None and meta.latent.shift_factor is None and meta.text.validation_prompts is None
    assert meta.to_json() == d


def test_verify_job_on_a_copy_of_the_fixture(tmp_path: Path, capsys) -> None:
    cache = shutil.copytree(FIXTURE, tmp_path / "cache")
    result = run(VerifyJob(cache=str(cache)))
    assert result.ok and result.exit_code == 0 and result.complete
    assert (result.checked_samples, result.checked_texts) == (24, 21)
    assert "OK - 24 sample records and 21 text records" in capsys.readouterr().out


def test_embed_job_from_args_and_its_checks(tmp_path: Path) -> None:
    job = embed_args("m", "c", "--text-encoder", "a", "--text-encoder", "b", "--storage-options", '{"anon": true}')
    assert job == EmbedJob(manifest="m", out="c", batch_size=4, shard_records=4, text_encoders=("a", "b"),
                           storage_options={"anon": True})  # fmt: skip
    with pytest.raises(UsageError, match="--crops must be >= 1"):
        EmbedJob(manifest="m", out="c", crops=0)
    with pytest.raises(UsageError, match="--max-clips must be >= 1, got 0"):
        EmbedJob(manifest="m", out="c", max_clips=0)
    with pytest.raises(UsageError, match="--latents posterior stores one posterior std"):
        EmbedJob(manifest="m", out="c", flip=True, latents="posterior")


@pytest.mark.ray
@pytest.mark.usefixtures("bucketeer_home")
@pytest.mark.slow
def test_embed_job_result_matches_the_written_meta(tmp_path: Path, ray_local) -> None:
    manifest, out = str(tmp_path / "manifest"), str(tmp_path / "cache")
    make_dataset(str(tmp_path / "data"), manifest, 4)
    result = embed_cache(manifest, out)
    written = json.loads((Path(out) / CACHE_FILE).read_text())
    assert result.fingerprint == written["fingerprint"] and result.meta.to_json() == written
    assert result.url == out and result.embedded == 4 and result.seconds > 0 and not result.up_to_date
