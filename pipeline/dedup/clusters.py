"""Duplicate clusters: connected components of the edges, one keeper per cluster.

The keeper rule (:func:`choose_keepers`), in order: the most pixels (``width * height`` from the
manifest), then the best ``aesthetic`` score where the annotations have one (a missing score ranks
last), then the lowest sample id. Every other member of a cluster is a duplicate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.dedup.edges import Edges

__all__ = ["Clusters", "connected_components", "choose_keepers", "cluster"]


def connected_components(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(n,) component label of each of ``n`` nodes given edges ``(a[i], b[i])``: the smallest node index
    of its component. Vectorised union-find: hook each edge's larger root under its smaller one, then
    compress paths fully, until every edge's ends share a root (a few rounds for duplicate graphs)."""
    parent = np.arange(n, dtype=np.int64)
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    while len(a):
        ra, rb = parent[a], parent[b]
        split = ra != rb
        if not split.any():
            break
        lo, hi = np.minimum(ra[split], rb[split]), np.maximum(ra[split], rb[split])
        np.minimum.at(parent, hi, lo)  # hi is a root: it now points at a smaller root, so no cycle forms
        while True:  # compress: every node points at its root
            grand = parent[parent]
            if np.array_equal(grand, parent):
                break
            parent = grand
        a, b = a[split], b[split]
    return parent


def choose_keepers(labels: np.ndarray, pixels: np.ndarray, aesthetic: np.ndarray,
                   sample_ids: np.ndarray) -> np.ndarray:  # fmt: skip
    """(n,) row index of each row's cluster keeper: most ``pixels``, then highest ``aesthetic`` (NaN last),
    then lowest ``sample_ids``."""
    score = np.where(np.isnan(aesthetic), -np.inf, aesthetic)
    order = np.lexsort((sample_ids, -score, -pixels.astype(np.float64), labels))  # last key sorts first
    sorted_labels = labels[order]
    starts = np.r_[True, sorted_labels[1:] != sorted_labels[:-1]][: len(labels)]
    keeper_of_label = np.empty(len(labels), np.int64)
    keeper_of_label[sorted_labels[starts]] = order[starts]
    return keeper_of_label[labels]


@dataclass(frozen=True)
class Clusters:
    """Per row: its keeper's row, its cluster's smallest sample id, and its strongest edge (NaN: none)."""

    keeper: np.ndarray  # (n,) int64 row index
    cluster_id: np.ndarray  # (n,) uint64 smallest sample id of the cluster (stable under the keeper rule)
    similarity: np.ndarray  # (n,) float32, NaN for a row with no edge
    size: np.ndarray  # (n,) int64 members of the row's cluster

    @property
    def duplicate(self) -> np.ndarray:
        return self.keeper != np.arange(len(self.keeper))


def cluster(edges: Edges, sample_ids: np.ndarray, pixels: np.ndarray, aesthetic: np.ndarray) -> Clusters:
    """The clusters of ``edges`` over rows ``0..len(sample_ids)-1`` (:func:`connected_components`) and
    their keepers (:func:`choose_keepers`)."""
    n = len(sample_ids)
    labels = connected_components(n, edges.a, edges.b)
    keeper = choose_keepers(labels, pixels, aesthetic, sample_ids)
    smallest = np.full(n, np.iinfo(np.uint64).max, np.uint64)
    np.minimum.at(smallest, labels, sample_ids.astype(np.uint64))
    size = np.bincount(labels, minlength=n)[labels]
    similarity = np.full(n, -np.inf, np.float32)
    np.maximum.at(similarity, edges.a, edges.similarity)
    np.maximum.at(similarity, edges.b, edges.similarity)
    similarity[np.isneginf(similarity)] = np.nan
    return Clusters(keeper=keeper, cluster_id=smallest[labels], similarity=similarity, size=size)
