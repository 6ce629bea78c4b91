"""Per-sample random draws that are pure functions of ``(seed, epoch, sample id[, salt])``.

Whatever the trainer or the planner draws per sample and epoch (caption dropout, the caption
chosen from a list, ...) is drawn here: never from the rank or an RNG's state, so a run resumed on
any number of processes draws exactly what an uninterrupted run would have. Vectorised numpy
(arrays wrap mod 2**64), no per-sample hashing.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["uniforms", "SALT_CAPTION_CHOICE", "SALT_VARIANT"]

SALT_CAPTION_CHOICE = 0x63617074  # the plan's caption choice (salt 0 is caption dropout's)
SALT_VARIANT = 0x7661726961  # the trainer's choice of an embed --flip/--crops variant


def uniforms(
    seed: int, epoch: int, sample_ids: Sequence[int] | np.ndarray, salt: int | np.ndarray = 0
) -> np.ndarray:
    """(n,) float64 in [0, 1), one per sample id: a splitmix64-style mix of (id, seed, epoch, salt).

    ``salt`` (an int, or one uint64 per id, e.g. derived from the dataset index) gives independent
    draws for different purposes or datasets; salt 0 leaves the id unchanged.
    """
    ids = np.asarray(sample_ids, np.uint64)
    salt = np.asarray(salt, np.uint64)
    if np.any(salt):
        ids = ids ^ (salt * np.uint64(0xD6E8FEB86659FD93))
    key = np.uint64(((seed * 1_000_003 + epoch) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1))
    mixed = (ids * np.uint64(0x9E3779B97F4A7C15)) ^ key
    mixed ^= mixed >> np.uint64(31)
    mixed *= np.uint64(0x94D049BB133111EB)
    mixed ^= mixed >> np.uint64(29)
    return (mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53)
