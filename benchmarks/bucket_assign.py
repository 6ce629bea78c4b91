"""Assign 10M synthetic (w, h) pairs to buckets: bucketeer's vectorised assignment vs a per-row loop.

The loop is how popular trainers assign buckets: for each image, compute its aspect ratio and
take the bucket with the nearest one (``min`` over the bucket list). It runs on a 200k-row slice
(10M rows would take minutes) and both are reported as rows/s. ``--rounds`` rounds, both methods in each;
the figures go to ``benchmarks/results/bucket_assign.json`` (:mod:`benchmarks.results`).

    python benchmarks/bucket_assign.py [--rows 10000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import Run  # noqa: E402
from manifests.buckets import BucketSpec, assign_buckets, bucket_list, bucket_names  # noqa: E402


def per_row_loop(spec: BucketSpec, widths, heights) -> list[tuple[int, int]]:
    buckets = [tuple(b) for b in bucket_list(spec).tolist()]
    out = []
    for w, h in zip(widths, heights):
        aspect = w / h
        out.append(min(buckets, key=lambda b: abs(b[0] / b[1] - aspect)))
    return out


def one_round(run: Run, spec: BucketSpec, w: np.ndarray, h: np.ndarray, loop_rows: int) -> None:
    """Time the vectorised assignment, the names and the per-row loop once each; add them to ``run``."""
    t0 = time.perf_counter()
    bw, bh, _ = assign_buckets(spec, w, h)
    t_vec = time.perf_counter() - t0
    t0 = time.perf_counter()
    names = bucket_names(bw, bh)
    t_names = time.perf_counter() - t0

    n = min(loop_rows, len(w))
    t0 = time.perf_counter()
    per_row_loop(spec, w[:n].tolist(), h[:n].tolist())
    t_loop = time.perf_counter() - t0

    vec_rate, loop_rate = len(w) / t_vec, n / t_loop
    print(f"bucketeer assign_buckets : {len(w):,} rows in {t_vec:.2f} s = {vec_rate:,.0f} rows/s")
    print(f"  + 'WxH' names          : {t_names:.2f} s ({len(names):,} strings)")
    print(f"per-row Python loop      : {n:,} rows in {t_loop:.2f} s = {loop_rate:,.0f} rows/s")
    print(f"ratio (vectorised / loop): {vec_rate / loop_rate:,.0f}x", flush=True)
    run.add("bucketeer assign_buckets (numpy, nearest log aspect)", vec_rate, "rows/s")
    run.add(f"+ formatting {len(w):,} 'WxH' names (Arrow dictionary decode)", t_names, "s")
    run.add("per-row Python loop (min over buckets per image)", loop_rate, "rows/s")
    run.add("vectorised / loop", vec_rate / loop_rate, "x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--loop-rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, both methods in each; the median is published")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    w = rng.integers(64, 8192, args.rows)
    h = rng.integers(64, 8192, args.rows)
    spec = BucketSpec()
    run = Run("bucket_assign", "python benchmarks/bucket_assign.py" + "".join(f" {a}" for a in sys.argv[1:]))
    for _ in range(args.rounds):
        with run.round():
            one_round(run, spec, w, h, args.loop_rows)
    run.save()


if __name__ == "__main__":
    main()
