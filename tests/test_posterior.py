"""The trainer draws each latent from its VAE posterior (a ``--latents posterior`` cache), seeded by
``(seed, epoch, sample id)``: new every epoch, centred on the mean. The draws from a real embedded cache,
across a rank split and a resume, are in tests/test_captions_list.py (it shares that module's embed)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from manifests.cache.records import SampleRecord
from train.config import TrainConfig
from manifests.draws import uniforms
from train.data import caption_dropout_mask, draw_posterior, posterior_noise


def _old_dropout_mask(seed: int, epoch: int, ids, p: float) -> np.ndarray:
    """caption_dropout_mask as it was before its hash was factored out of it (runs must resume exactly)."""
    ids = np.asarray(ids, np.uint64)
    key = np.uint64(((seed * 1_000_003 + epoch) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1))
    mixed = (ids * np.uint64(0x9E3779B97F4A7C15)) ^ key
    mixed ^= mixed >> np.uint64(31)
    mixed *= np.uint64(0x94D049BB133111EB)
    mixed ^= mixed >> np.uint64(29)
    return (mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53) < p


def test_noise_is_a_pure_function_of_seed_epoch_and_sample():
    a = posterior_noise(7, 3, 12345, (4, 8, 8))
    assert a.dtype == np.float32 and a.shape == (4, 8, 8)
    np.testing.assert_array_equal(a, posterior_noise(7, 3, 12345, (4, 8, 8)))
    for other in (posterior_noise(7, 4, 12345, (4, 8, 8)), posterior_noise(8, 3, 12345, (4, 8, 8)),
                  posterior_noise(7, 3, 12346, (4, 8, 8))):  # fmt: skip
        assert not np.allclose(a, other)
    ids = np.random.default_rng(0).integers(0, 2**63, 1000, dtype=np.uint64)
    for seed, epoch in ((0, 0), (3, 5), (-1, 2)):
        np.testing.assert_array_equal(caption_dropout_mask(seed, epoch, ids, 0.3), _old_dropout_mask(seed, epoch,
                                                                                                       ids, 0.3))
    assert not np.array_equal(uniforms(3, 5, ids), uniforms(3, 5, ids, 1))


def test_draws_average_to_the_mean_with_the_posterior_spread():
    rng = np.random.default_rng(1)
    mean = rng.normal(size=(4, 4, 4)).astype(np.float32)
    std = rng.uniform(0.1, 0.5, size=(4, 4, 4)).astype(np.float32)
    record = SampleRecord(sample_id=99, bucket="32x32", latent=mean, dtype="F32", original_size=(32, 32),
                          resized_size=(32, 32), crop_top_left=(0, 0), target_size=(32, 32), caption_key=0,
                          latent_std=std)  # fmt: skip
    draws = np.stack([draw_posterior([record], seed=0, epoch=e)[0].latent for e in range(2000)])  # (2000, 4, 4, 4)
    np.testing.assert_allclose(draws.mean(0), mean, atol=4 * 0.5 / np.sqrt(2000))
    np.testing.assert_allclose(draws.std(0) / std, 1.0, atol=0.1)
    means_only = replace(record, latent_std=None)
    assert draw_posterior([means_only], 0, 0)[0] is means_only  # a cache of means trains on the mean


def test_config_switch_defaults_to_sampling():
    assert TrainConfig().posterior_sampling is True
    assert TrainConfig(posterior_sampling=False).posterior_sampling is False
