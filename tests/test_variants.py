"""Variants in the cache (``embed --flip`` / ``--crops K``): the record layout (additive, old records still
read) and the trainer's variant choice, a pure function of (seed, epoch, sample id)."""

from __future__ import annotations

import numpy as np
import pytest

from manifests.cache.records import RecordError, SampleRecord, decode_sample, encode_sample
from manifests.draws import uniforms
from pipeline.embed.imaging import cover_and_crop
from pipeline.embed.samples import sample_record, variant_pixels
from train.data import caption_dropout_mask, variant_choice

IDS = np.random.default_rng(0).integers(0, 2**63, 4000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def _record(**extra) -> SampleRecord:
    latent = np.arange(2 * 4 * 4, dtype=np.float32).reshape(2, 4, 4)
    return SampleRecord(sample_id=7, bucket="32x32", latent=latent, dtype="F32", original_size=(40, 32),
                        resized_size=(40, 32), crop_top_left=(3, 0), target_size=(32, 32), caption_key=9, **extra)


def test_variant_choice_is_a_pure_function_of_seed_epoch_and_id():
    first = variant_choice(3, 0, IDS, 4)
    assert first.dtype == np.int64 and set(first.tolist()) == {0, 1, 2, 3}
    assert np.array_equal(first, variant_choice(3, 0, IDS, 4))  # deterministic
    # per sample: the same choice whatever batch or order the sample comes in (ranks, resumes, world sizes)
    order = np.random.default_rng(1).permutation(len(IDS))
    assert np.array_equal(variant_choice(3, 0, IDS[order], 4), first[order])
    assert np.array_equal(np.concatenate([variant_choice(3, 0, IDS[:7], 4), variant_choice(3, 0, IDS[7:], 4)]), first)
    others = [variant_choice(3, e, IDS, 4) for e in range(1, 4)] + [variant_choice(4, 0, IDS, 4)]
    for other in others:  # another epoch or seed: another, independent draw
        assert 0.70 < np.mean(other != first) < 0.80  # 3/4 differ when independent
    assert np.all(np.bincount(first, minlength=4) > 0.22 * len(IDS))  # uniform over the variants
    counts = np.where(np.arange(len(IDS)) % 2, 1, 6)
    mixed = variant_choice(3, 0, IDS, counts)  # per-sample counts: a sample of one variant always takes it
    assert np.all(mixed[counts == 1] == 0) and mixed.max() == 5


def test_variant_choice_is_independent_of_caption_dropout():
    drop = caption_dropout_mask(3, 0, IDS, 0.5)
    flip = variant_choice(3, 0, IDS, 2) == 1
    assert 0.45 < np.mean(drop == flip) < 0.55
    assert np.array_equal(drop, uniforms(3, 0, IDS) < 0.5)  # the dropout draws are unchanged (salt 0)


def test_record_variants_round_trip_and_old_records_read():
    rng = np.random.default_rng(0)
    extra = rng.normal(size=(3, 2, 4, 4)).astype(np.float32)
    record = _record(cond_latent=extra[0] * 2, variant_latents=extra, variant_cond_latents=extra * 3,
                     variant_crops=np.array([[3, 0], [3, 0], [5, 0], [5, 0]], np.int32),
                     variant_flips=np.array([0, 1, 0, 1], np.uint8))  # fmt: skip
    back = decode_sample(encode_sample(record))
    assert back.variants == 4
    for v in range(4):
        one = back.variant(v)
        assert one.variants == 1 and one.crop_top_left == tuple(record.variant_crops[v])
        np.testing.assert_array_equal(one.latent, record.latent if v == 0 else extra[v - 1])
        np.testing.assert_array_equal(one.cond_latent, extra[0] * 2 if v == 0 else extra[v - 1] * 3)
    with pytest.raises(IndexError):
        back.variant(4)
    old = decode_sample(encode_sample(_record()))  # a record of a cache made before variants
    assert old.variants == 1 and old.cond_latent is None and old.variant(0) == old
    bad = _record(variant_latents=extra, variant_crops=np.zeros((2, 2), np.int32), variant_flips=np.zeros(2, np.uint8))
    with pytest.raises(RecordError):
        decode_sample(encode_sample(bad))


def test_sample_record_mirrors_the_crop_box_of_flipped_variants():
    pixels = np.random.default_rng(0).integers(0, 255, (1, 2, 32, 32, 3), dtype=np.uint8)  # (b, K, H, W, 3)
    views = variant_pixels(pixels, 2)  # (b * K * 2, H, W, 3)
    assert np.array_equal(views[1], pixels[0, 0, :, ::-1]) and np.array_equal(views[2], pixels[0, 1])
    (resized, first), (_, second) = (cover_and_crop((40, 50), (32, 32), seed=5, sample_id=7, index=k) for k in (0, 1))
    row = {"sample_id": 7, "caption_key": 9, "original_h": 40, "original_w": 50, "resized_h": resized[0],
           "resized_w": resized[1], "crop_top": first[0], "crop_left": first[1], "crops": [*first, *second]}
    latents = np.zeros((4, 2, 4, 4), np.float32)
    record = sample_record(row, "32x32", "F32", latents, None, None, 2)
    expected = [first, (first[0], resized[1] - first[1] - 32), second, (second[0], resized[1] - second[1] - 32)]
    assert [tuple(c) for c in record.variant_crops.tolist()] == expected
    assert record.cond_latent is None and record.variant_cond_latents is None
