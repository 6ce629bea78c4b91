"""Semantic duplicate edges: pairs of L2-normalised embeddings with cosine similarity >= a threshold.

faiss (``pip install 'bucketeer[dedup]'``) range search, exact below :data:`FLAT_BELOW` rows and
approximate above it:

- ``flat``: ``IndexFlatIP``, every pair (N^2 d multiply-adds through BLAS). Exact; it stops paying
  past a few tens of thousands of rows (benchmarks/dedup.py).
- ``ivf``: ``IndexIVFScalarQuantizer`` with ``QT_fp16`` codes, ``nlist ~ 2 sqrt(N)`` k-means cells and
  ``nprobe`` cells visited per query. IVF rather than HNSW because (1) near-duplicates lie far closer
  to each other than to other cells' centroids, so a few probed cells find them (against the exact search on
  planted pairs, 282 cells: recall 1.0 at cosine 0.95 and 0.97 at 0.8 with ``nprobe`` 8, where one cell
  finds 83-92% and half: ``tests/test_dedup.py``), (2) faiss's IVF indexes answer *range* searches (all neighbours above
  the threshold, however many), where HNSW only answers k-NN, and (3) fp16 codes store the annotations'
  float16 embeddings without loss at half the memory of the flat index's float32, with no graph on top
  (HNSW adds 2 M links per row and its build alone is ~ the IVF query time on CPU).

Both read the embeddings in batches of :data:`BATCH` rows, so memory is the index plus one batch.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from manifests.errors import UsageError
from pipeline.dedup.edges import Edges

__all__ = ["FLAT_BELOW", "INDEXES", "embedding_edges"]

log = logging.getLogger("bucketeer.dedup")

FLAT_BELOW = 10_000  # rows: exact flat below (< 2 CPU-s there), ivf at and above (crossover ~5k: benchmarks/dedup.py)
INDEXES = ("auto", "flat", "ivf")
BATCH = 8192  # query rows per range search
NPROBE = 8
TRAIN_PER_CELL = 40  # k-means training rows per cell (faiss warns below 39)
KMEANS_ITERATIONS = 10  # coarse cells need no more (faiss's default is 25)


def _faiss():
    try:
        import faiss
    except ImportError as e:
        if getattr(e, "name", None) in ("faiss", None):
            raise UsageError("--by embedding needs faiss: pip install 'bucketeer[dedup]' (faiss-cpu)") from None
        # e.g. faiss-cpu >= 1.12 under numpy 1.x: it imports numpy._core while its metadata allows numpy>=1.25
        raise UsageError(f"--by embedding: faiss is installed but does not import ({type(e).__name__}: {e}); "
                         "faiss-cpu 1.12 and later need numpy >= 2: pip install 'numpy>=2', or 'faiss-cpu<1.12' "
                         "beside numpy 1.x") from None  # fmt: skip
    return faiss


def _rows(embeddings: np.ndarray, start: int, stop: int) -> np.ndarray:
    return np.ascontiguousarray(embeddings[start:stop], dtype=np.float32)


def _build_ivf(faiss, embeddings: np.ndarray, nprobe: int):
    n, d = embeddings.shape
    nlist = max(1, min(int(2 * math.sqrt(n)), n // TRAIN_PER_CELL))
    quantizer = faiss.IndexFlatIP(d)
    index = faiss.IndexIVFScalarQuantizer(quantizer, d, nlist, faiss.ScalarQuantizer.QT_fp16,
                                          faiss.METRIC_INNER_PRODUCT)  # fmt: skip
    sample = np.random.default_rng(0).choice(n, size=min(n, nlist * TRAIN_PER_CELL), replace=False)
    index.cp.niter = KMEANS_ITERATIONS
    index.train(np.ascontiguousarray(embeddings[np.sort(sample)], dtype=np.float32))
    index.nprobe = min(nprobe, nlist)
    log.info("dedup: ivf index, %d cells, nprobe %d", nlist, index.nprobe)
    return index


def embedding_edges(embeddings: np.ndarray, valid: np.ndarray, threshold: float, index: str = "auto",
                    nprobe: int = NPROBE) -> tuple[Edges, str]:  # fmt: skip
    """Edges between rows of ``embeddings`` ((N, D), L2-normalised) whose inner product is >= ``threshold``;
    similarity is the cosine. Rows with ``valid`` False take part in none. ``index``: ``flat``, ``ivf``, or
    ``auto`` (flat below :data:`FLAT_BELOW` rows). Returns the edges and the index used."""
    faiss = _faiss()
    rows = np.flatnonzero(valid)
    n = len(rows)
    if n < 2:
        return Edges.empty(), "none"
    data = embeddings[rows] if n < len(embeddings) else embeddings  # (n, D) float16, the valid rows
    kind = index if index != "auto" else ("flat" if n < FLAT_BELOW else "ivf")
    ix = faiss.IndexFlatIP(data.shape[1]) if kind == "flat" else _build_ivf(faiss, data, nprobe)
    for start in range(0, n, BATCH):
        ix.add(_rows(data, start, start + BATCH))
    found_a, found_b, found_s = [], [], []
    for start in range(0, n, BATCH):
        queries = _rows(data, start, start + BATCH)
        lims, sims, ids = ix.range_search(queries, float(threshold))
        # (hits,) each hit's query row; an approximate index may find a pair from one end only, so keep
        # both directions here and each pair once below; the row itself is dropped
        query = np.repeat(np.arange(start, start + len(queries)), np.diff(lims).astype(np.int64))
        other = ids != query
        found_a.append(np.minimum(query[other], ids[other]))
        found_b.append(np.maximum(query[other], ids[other]))
        found_s.append(np.minimum(sims[other], 1.0).astype(np.float32))
    a, b, s = np.concatenate(found_a), np.concatenate(found_b), np.concatenate(found_s)
    _, once = np.unique(a * n + b, return_index=True)
    return Edges(rows[a[once]], rows[b[once]], s[once]), kind
