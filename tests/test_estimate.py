"""``bucketeer estimate``: the bill before an embed run, against the run it prices.

On the tiny default models of several families (fixed-length and masked text, a chat template, a packed VAE), the
bill's counts and bytes are checked against what ``embed`` then does and writes: rows embedded, captions encoded,
and every latent and text tensor's bytes read back from the cache (exact: the layout is the one the records use).
A rerun's bill is empty. Time comes from ``pipeline/rates.json``: missing for a device, family or model size never
measured, and otherwise computed from that rate (checked by hand here).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from manifests.cache import CacheReader, read_index
from manifests.errors import UsageError
from pipeline import EmbedJob, run
from pipeline.estimate import EstimateJob, estimate, rates
from tests.embed_data import make_dataset

FAMILIES = ["sdxl", "pixart", "qwen-image", "flux2-klein"]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory, bucketeer_home) -> str:  # the default encoders in this session's home, not ~/.cache
    base = tmp_path_factory.mktemp("estimate")
    make_dataset(str(base / "ds"), str(base / "manifest"), n=12, unique_from=9)
    return str(base / "manifest")


def _job(manifest: str, out: str, family: str, **options) -> EmbedJob:
    return EmbedJob(manifest=manifest, out=out, family=family, model=options.pop("model", "default"),
                    executor="local", batch_size=4, shard_records=4, **options)  # fmt: skip


def _written(cache: str) -> tuple[int, int]:
    """``(latent bytes, text bytes)`` of every tensor the cache's records hold, read back."""
    reader = CacheReader(cache)
    latent = sum(r.latent.nbytes + (0 if r.latent_std is None else r.latent_std.nbytes)
                 for r in reader.read(reader.sample_ids.tolist()))  # fmt: skip
    keys = read_index(cache)["texts"].column("caption_key").to_pylist()
    text = sum(sum(t.nbytes for t in r.tokens) + (0 if r.pooled is None else r.pooled.nbytes)
               for r in reader.read_texts(keys))  # fmt: skip
    return latent, text


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_bill_is_what_embed_then_does_and_writes(manifest, tmp_path, family):
    out = str(tmp_path / "cache")
    job = _job(manifest, out, family, latents="posterior" if family == "sdxl" else "mean")
    bill = estimate(EstimateJob(embed=job, gpu="cpu"))
    result = run(job)
    assert (bill.samples, bill.to_embed) == (12, result.embedded) == (12, 12)
    # 3 shared captions, the 3 of their own, and the empty caption (caption dropout): one text each
    assert bill.captions == 7 == len(read_index(out)["texts"])
    assert (bill.latent_bytes, bill.text_bytes) == _written(out)
    assert bill.requests == 12 and bill.read_bytes > 0
    again = estimate(EstimateJob(embed=job, gpu="cpu"))  # nothing left to do: an empty bill
    assert (again.to_embed, again.captions, again.latent_bytes, again.text_bytes) == (0, 0, 0, 0)


def test_time_is_missing_where_no_rate_was_measured_and_computed_from_the_rate_where_one_was(manifest, tmp_path):
    from pipeline.embed.families.tiny import build_tiny

    default = estimate(EstimateJob(embed=_job(manifest, str(tmp_path / "a"), "sdxl"), gpu="h100"))
    assert default.seconds is None and "no rate measured for sdxl (the tiny default model) on h100" in default.rate
    # a folder that is not the default's stands for the real size: priced at the H100's measured SDXL rate
    folder = build_tiny("sdxl", tmp_path / "sdxl")
    (folder / "README.txt").unlink()
    bill = estimate(EstimateJob(embed=_job(manifest, str(tmp_path / "b"), "sdxl", model=str(folder)), gpu="h100",
                                gpus=4, price_gpu_hour=2.0, price_gb_month=0.02, price_egress_gb=0.09))  # fmt: skip
    rate = rates()["h100"]["families"]["sdxl"]["real"]
    (pixels, per_second), = rate["images"]  # one point at 1024²: time linear in pixels from it
    one = bill.pixels / (per_second * pixels) + bill.captions / rate["captions_per_second"]
    assert bill.seconds == pytest.approx(one / 4) and bill.gpu_hours == pytest.approx(one / 3600)
    assert "2026-11-27" in bill.rate and "H100" in bill.rate
    assert bill.money["compute"] == pytest.approx(bill.gpu_hours * 2.0)
    assert bill.money["storage_per_month"] == pytest.approx((bill.latent_bytes + bill.text_bytes) / 1e9 * 0.02)
    assert bill.money["reads"] == pytest.approx(bill.read_bytes / 1e9 * 0.09)


def test_images_per_second_follows_a_power_law_between_measured_points():
    from pipeline.estimate import images_per_second

    rate = {"images": [[65536, 64.0], [262144, 8.0]]}  # 4x the pixels, 8x the time: exponent -1.5
    assert images_per_second(rate, 65536) == pytest.approx(64.0)
    assert images_per_second(rate, 131072) == pytest.approx(64.0 * 2**-1.5)
    assert images_per_second(rate, 1048576) == pytest.approx(8.0 * 4**-1.5)  # beyond: the nearest two
    assert images_per_second({"images": [[1048576, 20.0]]}, 262144) == pytest.approx(80.0)  # one point: linear


def test_the_command_prints_the_bill_and_refuses_what_it_cannot_count(manifest, tmp_path):
    args = [sys.executable, "-m", "pipeline.cli", "estimate", manifest, "--out", str(tmp_path / "c"), "--family",
            "pixart", "--model", "default", "--gpu", "a100"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "to embed 12" in done.stdout and "time: no rate measured for pixart" in done.stdout  # none on an A100
    as_json = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=300)
    assert json.loads(as_json.stdout)["to_embed"] == 12
    refused = subprocess.run([*args, "--features", "dinov2"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "does not count DINOv2 features yet" in refused.stderr
    with pytest.raises(UsageError, match="--gpus must be >= 1"):
        EstimateJob(embed=None, gpus=0)


@pytest.mark.slow
def test_the_bill_of_an_edit_family_counts_each_samples_text_of_its_reference(tmp_path, bucketeer_home):
    """Qwen-Image-Edit: a text per sample (its instruction with its reference image's tokens, inline in its record)
    and a reference latent beside each target's; equal to what embed writes."""
    from tests.test_families_qwen_edit import make_edit_pairs

    manifest = make_edit_pairs(tmp_path)
    job = _job(manifest, str(tmp_path / "cache"), "qwen-image-edit", reference_resolution=64)
    bill = estimate(EstimateJob(embed=job, gpu="cpu"))
    run(job)
    reader = CacheReader(job.out)
    records = reader.read(reader.sample_ids.tolist())
    latent = sum(r.latent.nbytes + r.cond_latent.nbytes for r in records)
    text = sum(sum(t.nbytes for t in r.text.tokens) for r in records)
    assert (bill.to_embed, bill.captions, bill.requests) == (6, 6, 12)
    assert (bill.latent_bytes, bill.text_bytes) == (latent, text)
