"""``embed --reuse``: a second dataset that shares images with a first (other names, another layout) encodes only
what is new; what it takes is checked, equal to a fresh encode bit for bit, verified and trained on; ``estimate
--reuse`` predicts it; families that share a VAE share latents and encode their own text (pipeline.embed.reuse)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from manifests.buckets import BucketSpec
from manifests.cache import read_index
from manifests.cache.identity import latent_key, record_latent_key
from manifests.cache.verify import verify_cache
from manifests.errors import UsageError
from manifests.manifest import read_manifest
from tests.embed_data import embed_cache as embed_in_batches
from tests.embed_data import record_bytes, records_by_id
from tests.shards import photo, tar_bytes

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("bucketeer_home")]
SPEC = BucketSpec(area=64 * 64, step=32)
SHARED, NEW = 6, 6


def embed_cache(manifest: str, out: str, **options):
    """One image (and one caption) a forward pass: an encoder's output for an image must not depend on the batch
    it shares (float kernels sum in another order for another batch size: ~1e-4 of a latent's elements move by a
    few bf16 ulps), so that "equal to a fresh encode, bit for bit" is a property of the records alone."""
    return embed_in_batches(manifest, out, **{"batch_size": 1, "text_batch_size": 1, **options})


def scan(source: Path, out: Path) -> str:
    from pipeline import ScanJob, run
    from pipeline.scan import ScanConfig

    run(ScanJob(source=str(source), out=str(out), spec=SPEC, config=ScanConfig(progress=False)))
    return str(out)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory, ray_local) -> dict[str, str]:
    """A: 12 loose JPEGs with .txt captions. B: a tar shard holding 6 of A's images (same bytes, other names, their
    captions) and 6 new ones; B's shared half includes an image stored sideways (EXIF orientation 6)."""
    base = tmp_path_factory.mktemp("reuse")
    (base / "a").mkdir()
    images = {i: photo(i, orientation=6 if i == 2 else 1, size=((96, 64), (64, 96), (80, 80), (150, 70))[i % 4])
              for i in range(12 + NEW)}  # fmt: skip
    for i in range(12):
        (base / "a" / f"img_{i:03d}.jpg").write_bytes(images[i])
        (base / "a" / f"img_{i:03d}.txt").write_text(f"a photo of thing {i % 4}" if i % 3 else f"only image {i}")
    members = []
    for k, i in enumerate([*range(0, 2 * SHARED, 2), *range(12, 12 + NEW)]):  # A's even images, then new ones
        caption = f"a photo of thing {i % 4}" if i % 3 or i >= 12 else f"only image {i}"
        members += [(f"b{k:04d}.jpg", images[i]), (f"b{k:04d}.txt", caption.encode())]
    (base / "b").mkdir()
    (base / "b" / "shard-000.tar").write_bytes(tar_bytes(members))
    paths = {"base": str(base), "ma": scan(base / "a", base / "ma"), "mb": scan(base / "b", base / "mb")}
    paths["ca"] = str(base / "ca")
    embed_cache(paths["ma"], paths["ca"], executor="local")
    return paths


def test_a_second_dataset_in_tar_shards_encodes_only_its_new_half(datasets, tmp_path):
    from pipeline.estimate import EstimateJob, estimate
    from tests.embed_data import embed_args

    assert len(read_manifest(datasets["mb"]).samples) == SHARED + NEW
    out = str(tmp_path / "cb")
    bill = estimate(EstimateJob(embed=embed_args(datasets["mb"], out, "--reuse", datasets["ca"]), gpu="cpu"))
    taken = embed_cache(datasets["mb"], out, reuse=(datasets["ca"],))  # on Ray: the decode tasks look records up
    assert (taken.embedded, taken.reused_samples, taken.refused) == (SHARED + NEW, SHARED, 0)
    assert taken.meta.summary.reused_samples == SHARED and taken.meta.summary.reused_from == (datasets["ca"],)
    # the estimate predicted it: what is taken, and so what is encoded
    assert (bill.taken, bill.to_embed - bill.taken) == (SHARED, NEW)
    assert bill.texts_taken == taken.reused_texts > 0
    # every record equals a fresh encode of B bit for bit (the shared half's latents copied, the rest encoded)
    fresh = embed_cache(datasets["mb"], str(tmp_path / "fresh"), executor="local")
    assert fresh.reused_samples == 0
    assert record_bytes(out) == record_bytes(str(tmp_path / "fresh"))
    a = {r.content: r for r in records_by_id(datasets["ca"]).values()}
    b = records_by_id(out)
    assert sum(r.content in a for r in b.values()) == SHARED  # the shared half: the same image, under B's ids
    for r in b.values():
        if r.content in a:
            assert r.sample_id != a[r.content].sample_id and np.array_equal(r.latent, a[r.content].latent)
    index = read_index(out)["samples"].to_pylist()
    assert all(row["latent_key"] == record_latent_key(b[row["sample_id"]]) for row in index)
    assert verify_cache(out).ok
    rerun = embed_cache(datasets["mb"], out, reuse=(datasets["ca"],), executor="local")
    assert rerun.up_to_date  # its own records: nothing to take again


def test_a_taken_record_is_checked_and_a_bad_one_encoded(datasets, tmp_path):
    """A shared image's record damaged in the other cache (its checksum fails) is not taken: encoded, and counted."""
    import shutil

    from manifests.schema import sample_ids

    broken = tmp_path / "broken"
    shutil.copytree(datasets["ca"], broken)
    victim_id = int(sample_ids(["img_004.jpg"])[0])  # in B as b0002.jpg
    victim = next(r for r in read_index(str(broken))["samples"].to_pylist() if r["sample_id"] == victim_id)
    shard = broken / victim["shard"]
    data = bytearray(shard.read_bytes())
    data[victim["offset"] + victim["length"] // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = str(tmp_path / "cb")
    result = embed_cache(datasets["mb"], out, reuse=(str(broken),), executor="local")
    assert (result.reused_samples, result.refused) == (SHARED - 1, 1)
    assert record_bytes(out) == record_bytes(_fresh(datasets, tmp_path))


def _fresh(datasets, tmp_path) -> str:
    out = str(tmp_path / "fresh")
    if not Path(out, "_cache.json").exists():
        embed_cache(datasets["mb"], out, executor="local")
    return out


def test_other_latent_settings_take_nothing_and_say_why(datasets, tmp_path, capsys):
    result = embed_cache(datasets["mb"], str(tmp_path / "fp32"), reuse=(datasets["ca"],), dtype="fp32",
                         executor="local")  # fmt: skip
    assert (result.reused_samples, result.reused_texts) == (0, 0)
    said = capsys.readouterr().out
    assert "takes nothing" in said and "dtype: 'BF16' -> 'F32'" in said


def test_random_crops_are_taken_only_where_the_crop_is_the_same(datasets, tmp_path):
    """A random crop is drawn from (seed, sample id): B's ids are not A's, so a latent is taken only where the draw
    for B's id gives A's box (always when the bucket leaves no room to move the crop), and encoded elsewhere."""
    cache_a = str(tmp_path / "ca-random")
    embed_cache(datasets["ma"], cache_a, crop="random", executor="local")
    result = embed_cache(datasets["mb"], str(tmp_path / "cb"), crop="random", reuse=(cache_a,), executor="local")
    a = {r.content: r for r in records_by_id(cache_a).values()}
    b = records_by_id(str(tmp_path / "cb"))
    same_box = [r for r in b.values() if r.content in a and a[r.content].crop_box == r.crop_box]
    assert 0 < result.reused_samples == len(same_box) < SHARED
    embed_cache(datasets["mb"], str(tmp_path / "fresh"), crop="random", executor="local")
    assert record_bytes(str(tmp_path / "cb")) == record_bytes(str(tmp_path / "fresh"))


def test_reuse_refuses_its_own_out_and_a_missing_cache(datasets, tmp_path):
    with pytest.raises(UsageError, match="--reuse names --out itself"):
        embed_cache(datasets["mb"], datasets["ca"], reuse=(datasets["ca"],))
    with pytest.raises(UsageError, match="--reuse"):
        embed_cache(datasets["mb"], str(tmp_path / "cb"), reuse=(str(tmp_path / "nothing"),), executor="local")


def test_latent_key_is_the_images_content_and_geometry():
    key = latent_key("ab" * 32, "64x64", (96, 64), (96, 64), [(16, 0)], 1)
    assert key == latent_key("ab" * 32, "64x64", (96, 64), (96, 64), [(16, 0)], 1)
    for other in (latent_key("cd" * 32, "64x64", (96, 64), (96, 64), [(16, 0)], 1),
                  latent_key("ab" * 32, "64x64", (96, 64), (96, 64), [(15, 0)], 1),
                  latent_key("ab" * 32, "64x64", (96, 64), (96, 64), [(16, 0)], 2),
                  latent_key("ab" * 32, "32x128", (96, 64), (96, 64), [(16, 0)], 1)):  # fmt: skip
        assert other != key


@pytest.mark.slow
def test_a_family_that_shares_the_vae_takes_the_latents_and_encodes_its_text(datasets, tmp_path, capsys):
    """Flux 2 Klein ships Flux 2's VAE: a Klein cache embedded with --reuse of a Flux 2 one takes every shared latent
    and encodes all of its own text (Mistral's records are not Qwen3's)."""
    from pipeline.embed.families.tiny import ensure_tiny

    flux2 = str(tmp_path / "flux2")
    embed_cache(datasets["ma"], flux2, family="flux2", model="default", executor="local")
    vae = str(ensure_tiny("flux2"))
    klein = embed_cache(datasets["mb"], str(tmp_path / "klein"), family="flux2-klein", model="default", vae=vae,
                        vae_subfolder="vae", reuse=(flux2,), executor="local")  # fmt: skip
    assert (klein.reused_samples, klein.reused_texts) == (SHARED, 0)
    assert "takes its latents" in capsys.readouterr().out
    embed_cache(datasets["mb"], str(tmp_path / "fresh"), family="flux2-klein", model="default", vae=vae,
                        vae_subfolder="vae", executor="local")  # fmt: skip
    assert record_bytes(str(tmp_path / "klein")) == record_bytes(str(tmp_path / "fresh"))
    assert verify_cache(str(tmp_path / "klein")).ok


@pytest.mark.slow
@pytest.mark.dist
def test_a_cache_that_took_records_trains_on_two_processes(datasets, tmp_path):
    from pipeline import PlanJob, run
    from tests.test_train import write_config
    from tests.test_train_dist import consumed, launch, rows

    cache = str(tmp_path / "cb")
    embed_cache(datasets["mb"], cache, reuse=(datasets["ca"],), executor="local")
    plan = str(tmp_path / "plan")
    run(PlanJob(manifests=(datasets["mb"],), out=plan, world_size=2, batch_size=1, epochs=1, seed=3, cache=(cache,)))
    config = write_config(tmp_path / "c.yaml", checkpoint_every=100, log_every=1)
    out = tmp_path / "run"
    launch(2, "--plan", plan, "--cache", cache, "--config", config, "--output-dir", out, "--record-samples",
           out / "rec")  # fmt: skip
    for rank in (0, 1):  # each rank trained exactly its plan's batches, the taken records among them
        assert consumed(out / "rec", rank) == rows(plan, rank)


@pytest.mark.s3
def test_reuse_from_a_cache_on_s3(datasets, s3, tmp_path):
    """The other cache on an S3-compatible store (R2 as users have it): records taken with ranged reads over HTTP,
    the credentials nowhere in what the run writes."""
    remote = s3.fresh_url("ca")
    s3.fs.put(datasets["ca"] + "/", remote + "/", recursive=True)
    s3.fs.invalidate_cache()
    out = str(tmp_path / "cb")
    result = embed_cache(datasets["mb"], out, reuse=(remote,), storage_options=dict(s3.storage_options),
                         executor="local")  # fmt: skip
    assert (result.reused_samples, result.refused) == (SHARED, 0)
    assert record_bytes(out) == record_bytes(_fresh(datasets, tmp_path))
    assert "testing-secret-key" not in Path(out, "_cache.json").read_text()
