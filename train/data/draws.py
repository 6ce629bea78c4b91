"""Per-sample draws of one epoch: caption dropout, the variant, the posterior sample.

Each is a pure function of ``(seed, epoch, sample id)`` (and the dataset in mixture plans), never
of the rank, the batch a sample lands in or any RNG state, so a resumed run (on any number of
processes) draws exactly what an uninterrupted run would have drawn. Each kind of draw has its own
salt, so they are independent of one another.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from manifests.cache.records import SampleRecord, to_float32
from manifests.draws import SALT_VARIANT, uniforms

__all__ = ["caption_dropout_mask", "variant_choice", "variant_text_keys", "posterior_noise", "draw_posterior"]

_POSTERIOR_SALT = 0x706F7374  # "post": keeps the posterior's stream apart from every other per-sample draw


def caption_dropout_mask(seed: int, epoch: int, sample_ids: Sequence[int], p: float,
                         datasets: Sequence[int] | None = None) -> np.ndarray:  # fmt: skip
    """Which of ``sample_ids`` train on the empty caption this epoch: (B,) bool, each True with probability
    ``p``, a pure function of ``(seed, epoch, sample id)`` (so of the plan, not of the rank or the RNG state).
    ``datasets`` (mixture plans): the sample is ``(dataset, id)``; dataset 0 draws what a one-manifest plan does."""
    if p <= 0:
        return np.zeros(len(sample_ids), bool)
    return uniforms(seed, epoch, sample_ids, 0 if datasets is None else np.asarray(datasets, np.uint64)) < p


def variant_choice(seed: int, epoch: int, sample_ids: Sequence[int], variants: Sequence[int] | int,
                   datasets: Sequence[int] | None = None) -> np.ndarray:  # fmt: skip
    """Which variant (``embed --flip`` / ``--crops``) each of ``sample_ids`` trains on this epoch: (B,) int64,
    uniform over ``0 .. variants - 1`` (per sample, or one count for all), a pure function of ``(seed,
    epoch, sample id)`` (and the dataset in mixture plans): a resumed run, on any number of processes, picks
    what an uninterrupted run picks; independent of caption dropout and the caption choice (own salt)."""
    counts = np.broadcast_to(np.asarray(variants, np.int64), (len(sample_ids),))
    salt = np.uint64(SALT_VARIANT) + (np.zeros(1, np.uint64) if datasets is None else np.asarray(datasets, np.uint64))
    return np.minimum((uniforms(seed, epoch, sample_ids, salt) * counts).astype(np.int64), counts - 1)


def variant_text_keys(records: Sequence[SampleRecord]) -> list[int | None]:
    """The caption key each one-variant record (:meth:`SampleRecord.variant`) trains on when its variant carries
    its own caption (``variant_captions``: a clip's shot's, whatever caption the plan chose), else None (the
    plan's). Raises ValueError for an index beyond the record's captions."""
    out: list[int | None] = []
    for r in records:
        if r.variant_captions is None:
            out.append(None)
            continue
        keys, at = r.caption_keys or (r.caption_key,), int(r.variant_captions[0])
        if not 0 <= at < len(keys):
            raise ValueError(f"sample {r.sample_id}: its clip's caption is number {at}, but it has {len(keys)}")
        out.append(int(keys[at]))
    return out


def posterior_noise(seed: int, epoch: int, sample_id: int, shape: tuple[int, ...], dataset: int = 0) -> np.ndarray:
    """Standard normal float32 noise of ``shape`` for one sample's posterior draw this epoch: a pure
    function of ``(seed, epoch, sample id)`` and, in mixture plans, the dataset (a Philox stream keyed
    by them; the same on every rank)."""
    entropy = [seed & ((1 << 64) - 1), epoch, int(sample_id), _POSTERIOR_SALT] + ([int(dataset)] if dataset else [])
    key = np.random.SeedSequence(entropy)
    return np.random.Generator(np.random.Philox(key)).standard_normal(shape, dtype=np.float32)


def draw_posterior(records: Sequence[SampleRecord], seed: int, epoch: int,
                   datasets: Sequence[int] | None = None) -> list[SampleRecord]:  # fmt: skip
    """Records whose latent is a draw ``mean + std * eps`` from their VAE posterior (float32, not yet
    scaled), ``eps`` from :func:`posterior_noise` (``datasets``: each record's, in mixture plans);
    records without ``latent_std`` are returned as they are."""
    out = []
    for r, d in zip(records, [0] * len(records) if datasets is None else datasets):
        if r.latent_std is None:
            out.append(r)
            continue
        mean, std = to_float32(r.latent, r.dtype), to_float32(r.latent_std, r.dtype)  # (C, h, w)
        latent = mean + std * posterior_noise(seed, epoch, r.sample_id, mean.shape, d)
        out.append(replace(r, latent=latent.astype(np.float32), dtype="F32", latent_std=None))
    return out
