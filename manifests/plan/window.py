"""The window shuffle's orders (``bucketeer plan --shuffle window[:SIZE]``), apart from the schedule they feed.

:func:`window_order` permutes a bucket's samples window by window; with several ranks, :func:`rank_runs` deals
each rank its own contiguous run of that order and :func:`run_of` names the runs, so that a rank's reads fall
on whole chunks of the cache that no other rank fetches (:mod:`manifests.plan.schedule` explains the plan).
Pure numpy.
"""

from __future__ import annotations

import numpy as np

__all__ = ["concat_ranges", "window_order", "rank_runs", "run_of"]


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each (s, n), vectorised: (sum(lengths),) int64."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    return np.repeat(np.asarray(starts, dtype=np.int64) - (ends - lengths), lengths) + np.arange(total, dtype=np.int64)


def window_order(rng: np.random.Generator, order: np.ndarray, window: int, runs: np.ndarray | None = None
                 ) -> np.ndarray:  # fmt: skip
    """``order`` (n,) (the samples in storage order) permuted by a window shuffle: (n,) int64.

    Cut into windows of ``window`` consecutive samples; the windows' order shuffled; that sequence cut
    into blocks of random sizes in ``[window // 2, window + window // 2]`` (whose edges fall inside windows,
    so a block mixes the ends of neighbouring windows) and the samples shuffled within each block. A sample
    moves at most ~1.5 windows from its window's new place; a run of a block's samples covers a few
    contiguous ranges of storage. ``runs`` (n,) ascending, given: the blocks are those runs instead (several
    ranks: each rank's share, :func:`run_of`).
    """
    n = len(order)
    wins = -(-n // window)
    starts = rng.permutation(wins).astype(np.int64) * window  # (wins,) shuffled window starts
    seq = order[concat_ranges(starts, np.minimum(window, n - starts))]  # (n,) windows in shuffled order
    if runs is not None:
        return seq[np.lexsort((rng.random(n), runs))].astype(np.int64)
    low = max(window // 2, 1)
    sizes = rng.integers(low, window + window // 2 + 1, size=n // low + 1)  # enough blocks to cover n
    block = np.searchsorted(np.cumsum(sizes), np.arange(n), side="right")  # (n,) block of each place
    return seq[np.lexsort((rng.random(n), block))].astype(np.int64)


def rank_runs(q: np.ndarray, index: np.ndarray, batches: np.ndarray, size: np.ndarray, world: int,
               window: int) -> np.ndarray:
    """Window shuffle: positions ``q`` (sum(sizes),) in a bucket's window order re-dealt so that each rank reads
    its own contiguous run of it. Per slot: ``index`` its global batch's index in the bucket, ``batches`` the
    bucket's global batches, ``size`` the global batch size. The bucket's global batches are taken in groups of
    ``m = ceil(window / b)`` (``b`` the per-rank batch); a group covers ``m * size`` consecutive positions and
    rank ``r`` gets the ``r``-th ``1 / world`` of them (about a window), ``b`` per step. A bijection within each
    group, so every position is still dealt once: (sum(sizes),) int64."""
    b = size // world
    m = np.maximum(-(-window // b), 1)  # steps per group
    group, step = index // m, index % m
    in_group = np.minimum(m, batches - group * m)  # the bucket's last group may be shorter
    t = q - index * size  # slot within the global batch
    rank, j = t // b, t % b
    return group * m * size + rank * in_group * b + step * b + j


def run_of(position: np.ndarray, batches: int, size: int, world: int, window: int) -> np.ndarray:
    """The run (a rank's share of a group of steps, :func:`rank_runs`) of each ``position`` of one bucket's
    sequence of ``batches`` global batches of ``size``: (len(position),) int64, ascending with position;
    positions past the batches (the dropped leftover) form one run."""
    b = size // world
    m = max(-(-window // b), 1)
    group = np.minimum(position // (m * size), max(-(-batches // m), 1))
    in_group = np.maximum(np.minimum(m, batches - group * m), 1)
    rank = np.minimum((position - group * m * size) // (in_group * b), world - 1)
    return group * world + rank
