"""Duplicate edges from hashes: exact (equal ``sha256``) and perceptual (``phash`` Hamming distance).

An edge is a pair of row indices and a similarity in [0, 1] (:class:`Edges`); the clustering
(:mod:`pipeline.dedup.clusters`) takes the union of every kind's edges.

Perceptual duplicates use multi-index hashing (Norouzi et al., "Fast search in Hamming space with
multi-index hashing", CVPR 2012): split the 64 bits into ``m > t`` bands; two hashes within Hamming
distance ``t`` agree exactly on at least ``m - t`` of them (pigeonhole), so the candidates are the pairs
equal on some ``m - t`` bands, found by sorting the hashes on each such combination of bands, and each
candidate is verified by its full distance (``m`` grows with N: :func:`band_count`).
Work is O(N log N) per band plus the candidate pairs, not O(N^2): equal hashes are collapsed first (an
exact group of k images costs k - 1 edges, not k^2 / 2 candidates).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Edges", "exact_edges", "hamming", "phash_edges", "MAX_PHASH_THRESHOLD", "near_pairs", "band_count"]

MAX_PHASH_THRESHOLD = 15  # t + 1 = 16 bands of 4 bits: past this a band matches a sixteenth of everything


@dataclass(frozen=True)
class Edges:
    """Pairs ``(a[i], b[i])`` of row indices with ``a < b``, and their similarity (1.0 = identical)."""

    a: np.ndarray  # (E,) int64
    b: np.ndarray  # (E,) int64
    similarity: np.ndarray  # (E,) float32

    @classmethod
    def empty(cls) -> Edges:
        return cls(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float32))

    def __len__(self) -> int:
        return len(self.a)

    @classmethod
    def concat(cls, parts: list[Edges]) -> Edges:
        if not parts:
            return cls.empty()
        return cls(np.concatenate([p.a for p in parts]), np.concatenate([p.b for p in parts]),
                   np.concatenate([p.similarity for p in parts]))  # fmt: skip


def _star_edges(codes: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Edges joining each row to the first row of its group of equal ``codes`` (k - 1 edges for k rows)."""
    if len(codes) == 0:
        return rows, rows
    order = np.argsort(codes, kind="stable")
    codes, rows = codes[order], rows[order]
    starts = np.r_[True, codes[1:] != codes[:-1]]  # (n,) a new group begins here
    first = rows[np.flatnonzero(starts)][np.cumsum(starts) - 1]  # (n,) the first row of each row's group
    keep = ~starts
    return first[keep], rows[keep]


def exact_edges(codes: np.ndarray, valid: np.ndarray) -> Edges:
    """Edges between rows whose ``codes`` (e.g. dictionary codes of sha256 strings) are equal; rows with
    ``valid`` False take part in none. Similarity 1.0."""
    rows = np.flatnonzero(valid)
    a, b = _star_edges(codes[rows], rows)
    return Edges(np.minimum(a, b), np.maximum(a, b), np.ones(len(a), np.float32))


def hamming(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(n,) number of differing bits between uint64 arrays ``x`` and ``y``."""
    z = np.bitwise_xor(x, y)
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        return np.bitwise_count(z).astype(np.int64)
    # numpy 1.x: a byte lookup table. z: (n,) -> (n, 8) bytes
    table = np.array([bin(i).count("1") for i in range(256)], np.uint8)
    return table[z.view(np.uint8).reshape(-1, 8)].sum(axis=1, dtype=np.int64)


def band_count(n: int, t: int) -> int:
    """How many bands ``m`` (t + 1 .. t + 3) to split 64 bits into for ``n`` distinct hashes and distance ``t``.
    Pairs within ``t`` agree on at least ``m - t`` whole bands, so each of the C(m, t) combinations of
    ``m - t`` bands is one sort of the ``n`` hashes, whose candidates are the pairs equal on a key of
    ``64 (m - t) / m`` bits: ~n^2 / 2 / 2^bits of them for uniform hashes. More bands, more sorts but
    wider keys: at t = 4, 5 bands (13-bit keys) to ~500k hashes, 6 (21-bit keys: 15 sorts) past that."""
    def cost(m: int) -> float:
        return math.comb(m, t) * (n * math.log2(max(n, 2)) + n * n / 2 / 2 ** (64 * (m - t) / m))

    return min(range(t + 1, t + 4), key=cost)


def _band_masks(m: int) -> list[int]:
    """Bit masks of ``m`` bands covering the 64 bits as evenly as possible."""
    widths = [64 // m + (1 if i < 64 % m else 0) for i in range(m)]
    shifts = np.cumsum([0, *widths[:-1]])
    return [((1 << w) - 1) << int(s) for s, w in zip(shifts, widths)]


def _key_pairs(hashes: np.ndarray, key: np.ndarray, t: int) -> np.ndarray:
    """(P,) pair keys ``lo * n + hi`` of distinct hashes with equal ``key`` and within distance ``t``."""
    n = len(hashes)
    order = np.argsort(key, kind="stable")
    key = key[order]
    ends = np.r_[np.flatnonzero(key[1:] != key[:-1]) + 1, n]  # exclusive end of each run of equal keys
    remaining = ends[np.searchsorted(ends, np.arange(n), side="right")] - np.arange(n) - 1  # later rows in the run
    active = np.flatnonzero(remaining >= 1)
    found = []
    k = 1
    while len(active):  # compare each row with the row k places later in its run; runs shrink as k grows
        i, j = order[active], order[active + k]
        close = hamming(hashes[i], hashes[j]) <= t
        lo, hi = np.minimum(i[close], j[close]), np.maximum(i[close], j[close])
        found.append(lo.astype(np.int64) * n + hi)
        k += 1
        active = active[remaining[active] >= k]
    return np.concatenate(found) if found else np.empty(0, np.int64)


def near_pairs(hashes: np.ndarray, t: int, bands: int | None = None) -> np.ndarray:
    """(P,) pair keys ``lo * n + hi`` (each once) of the distinct ``hashes`` within Hamming distance ``t``
    (1 <= t), by multi-index hashing over ``bands`` bands (default :func:`band_count`)."""
    m = bands or band_count(len(hashes), t)
    masks = _band_masks(m)
    found = [_key_pairs(hashes, hashes & np.uint64(sum(masks[b] for b in combo)), t)
             for combo in itertools.combinations(range(m), m - t)]  # fmt: skip
    return np.unique(np.concatenate(found))


def phash_edges(phash: np.ndarray, valid: np.ndarray, threshold: int) -> Edges:
    """Edges between rows whose 64-bit ``phash`` values differ in at most ``threshold`` bits; similarity
    ``1 - distance / 64``. Rows with ``valid`` False take part in none. Raises ValueError for a threshold
    outside 0..MAX_PHASH_THRESHOLD."""
    if not 0 <= threshold <= MAX_PHASH_THRESHOLD:
        raise ValueError(f"phash threshold {threshold} is outside 0..{MAX_PHASH_THRESHOLD} bits")
    rows = np.flatnonzero(valid)
    values = phash[rows].astype(np.uint64)
    # 1. equal hashes: star edges, distance 0; then search among the distinct hashes only
    unique, first, inverse = np.unique(values, return_index=True, return_inverse=True)
    a, b = _star_edges(inverse.ravel(), rows)
    parts = [Edges(np.minimum(a, b), np.maximum(a, b), np.ones(len(a), np.float32))]
    if threshold > 0 and len(unique) > 1:
        # 2. distinct hashes within the threshold: candidates share bands; pair keys over unique indices
        keys = near_pairs(unique, threshold)
        lo, hi = keys // len(unique), keys % len(unique)
        distance = hamming(unique[lo], unique[hi])
        ra, rb = rows[first[lo]], rows[first[hi]]  # each distinct hash's first row stands for its group
        parts.append(Edges(np.minimum(ra, rb), np.maximum(ra, rb), (1.0 - distance / 64.0).astype(np.float32)))
    return Edges.concat(parts)
