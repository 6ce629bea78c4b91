"""Semantic and perceptual dedup at scale: ``bucketeer dedup``'s search against brute force, in the same run.

    python benchmarks/dedup.py        # brute force at 20k and 50k, ours up to 1M, phash to 4M (~1 h on 2 loaded cores)
    python benchmarks/dedup.py --brute-sizes 20000 --sizes 20000,50000 --phash-sizes 100000
    python benchmarks/dedup.py --rounds 3   # rounds (default 3), every child in each; results/dedup.json

Data: N synthetic 512-d embeddings, float16 and L2-normalised as the annotations store them, drawn
around 1,000 topic centres (cosine ~0.5 within a topic, as CLIP embeddings of one kind of picture are),
with 5% of the rows planted near-duplicates of another row (cosine 0.96-0.995). Threshold 0.95.

Each measurement runs in a fresh child process: the data is generated in the child first, the peak RSS is
reset (Linux ``/proc/self/clear_refs``), and ``peak_rss_mib`` is the process's peak while searching (the data
included), ``index_mib`` that peak minus the RSS before the search:

- ``ours``: :func:`pipeline.dedup.semantic.embedding_edges` with ``index="auto"`` (what ``bucketeer dedup
  --by embedding`` runs: exact ``IndexFlatIP`` below 10k rows, IVF with fp16 codes above);
- ``flat``: ``ours`` forced to ``index="flat"`` (exact), to measure the crossover at small N;
- ``brute``: what a user writes with faiss alone: ``IndexFlatIP`` (float32) filled and range-searched
  in batches converted from the float16 rows (exact; every pair);
- ``brute-memory``: ``brute``'s full index at a size too large to search (1M), searched for 2,048 rows
  only: its peak RSS (its time is not a figure).

Recall: of the planted pairs (every method, every size), and of *all* pairs >= the threshold against brute
force: at the brute-force sizes on every pair; at the other sizes on 2,000 random query rows searched
exactly against all N (labelled "sampled"). CPU seconds are ``time.process_time`` of the child (all of
faiss's threads); wall seconds depend on the load, which is printed beside them. Brute force is
quadratic: its 1M figure is extrapolated as ``c * N^2`` from the two measured sizes (labelled).

``--e2e-sizes``: the whole command (``run(DedupJob)``, default ``--by sha256,phash``) over a written
manifest and annotations folder: read, search, cluster, write; its CPU seconds and peak RSS.

``--phash-sizes``: multi-index-hashing near-duplicate search over 64-bit hashes (threshold 4), with
5% planted near copies, against the numpy all-pairs loop a user would write (only at the smallest size).

Each of ``--rounds`` rounds runs every child again; the medians are published from
``benchmarks/results/dedup.json`` by :mod:`benchmarks.results`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.results import Run  # noqa: E402

DIM = 512
THRESHOLD = 0.95
PLANTED = 0.05
SAMPLED_QUERIES = 2000
MEMORY_PROBE_QUERIES = 2048  # brute-memory: the full index, but only these queries (its peak RSS, not its time)


def make_embeddings(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x, src, dup)``: (n, 512) float16 unit rows; row ``dup[i]`` is a planted near copy of ``src[i]``."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((1000, DIM)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = np.empty((n, DIM), np.float16)
    n_dup = int(n * PLANTED)
    n_base = n - n_dup
    for start in range(0, n_base, 65536):  # in blocks: float32 only for one block at a time
        stop = min(n_base, start + 65536)
        block = centres[rng.integers(0, 1000, stop - start)]
        block += rng.standard_normal((stop - start, DIM)).astype(np.float32) / np.sqrt(DIM)
        x[start:stop] = block / np.linalg.norm(block, axis=1, keepdims=True)
    src = rng.choice(n_base, n_dup, replace=False)
    for start in range(0, n_dup, 65536):
        s = src[start:start + 65536]
        eps = rng.uniform(0.1, 0.28, (len(s), 1)).astype(np.float32)
        block = x[s].astype(np.float32) + eps * rng.standard_normal((len(s), DIM)).astype(np.float32) / np.sqrt(DIM)
        x[n_base + start:n_base + start + len(s)] = block / np.linalg.norm(block, axis=1, keepdims=True)
    return x, src, np.arange(n_base, n)


def brute_force_pairs(x: np.ndarray, queries: int | None = None) -> np.ndarray:
    """(P, 2) pairs i < j with inner product >= THRESHOLD: faiss IndexFlatIP over float32, range_search.
    ``queries``: search only the first that many rows (the memory probe at sizes too large to search)."""
    import faiss

    index = faiss.IndexFlatIP(DIM)  # holds the rows as float32: (n, 512) x 4 bytes
    for start in range(0, len(x), 65536):  # float32 copies one block at a time, as a careful user would
        index.add(x[start:start + 65536].astype(np.float32))
    found = []
    for start in range(0, len(x) if queries is None else queries, 8192):
        batch = x[start:start + 8192 if queries is None else min(start + 8192, queries)]
        lims, _, ids = index.range_search(batch.astype(np.float32), THRESHOLD)
        query = np.repeat(np.arange(start, start + len(batch)), np.diff(lims).astype(np.int64))
        later = ids > query
        found.append(np.stack([query[later], ids[later]], axis=1))
    return np.concatenate(found)


def _pair_keys(pairs: np.ndarray, n: int) -> np.ndarray:
    return np.unique(pairs[:, 0].astype(np.int64) * n + pairs[:, 1])


def sampled_recall(x: np.ndarray, keys: np.ndarray) -> float:
    """Of all pairs >= THRESHOLD that touch SAMPLED_QUERIES random rows (found exactly against all rows),
    the fraction in ``keys``."""
    rng = np.random.default_rng(1)
    n = len(x)
    queries = np.sort(rng.choice(n, min(n, SAMPLED_QUERIES), replace=False))
    q = x[queries].astype(np.float32)
    want = []
    for start in range(0, n, 65536):  # (queries, block) exact inner products
        sims = q @ x[start:start + 65536].astype(np.float32).T
        qi, j = np.nonzero(sims >= THRESHOLD)
        j = j + start
        i = queries[qi]
        other = i != j
        want.append(np.minimum(i, j)[other].astype(np.int64) * n + np.maximum(i, j)[other])
    want_keys = np.unique(np.concatenate(want))
    return float(np.isin(want_keys, keys).mean()) if len(want_keys) else 1.0


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> int:
    """Reset the peak RSS (``VmHWM``) to the RSS now (Linux: ``clear_refs`` 5), and return it in KiB: the
    peak measured after this is the search's own, not the data generation's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


def _child(method: str, n: int) -> dict:
    import faiss  # noqa: F401  both methods' imports are in the baseline, so "index memory" is the search's own

    from pipeline.dedup.semantic import embedding_edges

    x, src, dup = make_embeddings(n)
    base_rss = _reset_peak()
    cpu, wall = time.process_time(), time.perf_counter()
    if method in ("brute", "brute-memory"):
        pairs, index = brute_force_pairs(x, MEMORY_PROBE_QUERIES if method == "brute-memory" else None), "flat"
    else:
        edges, index = embedding_edges(x, np.ones(n, bool), THRESHOLD, index="auto" if method == "ours" else method)
        pairs = np.stack([edges.a, edges.b], axis=1)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    peak = _status_kib("VmHWM")
    keys = _pair_keys(pairs, n)
    planted = np.minimum(src, dup).astype(np.int64) * n + np.maximum(src, dup)
    out = {"method": method, "n": n, "index": index, "cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
           "load": round(os.getloadavg()[0], 1), "data_mib": round(x.nbytes / 2**20),
           "peak_rss_mib": round(peak / 1024), "index_mib": round((peak - base_rss) / 1024),
           "pairs": int(len(keys)), "planted_recall": round(float(np.isin(planted, keys).mean()), 5)}  # fmt: skip
    if method not in ("brute", "brute-memory"):
        out["sampled_recall"] = round(sampled_recall(x, keys), 5)
    np.save(f"/tmp/bucketeer_dedup_{method}_{n}.npy", keys)
    return out


def _phash_child(n: int) -> dict:
    from pipeline.dedup.edges import hamming, phash_edges

    rng = np.random.default_rng(0)
    hashes = rng.integers(0, 2**64 - 1, n, dtype=np.uint64)
    n_dup = int(n * PLANTED)
    flips = np.zeros(n_dup, np.uint64)
    for _ in range(4):  # up to 4 random bits flipped (a bit flipped twice cancels: fewer is fine)
        flips |= np.uint64(1) << rng.integers(0, 64, n_dup).astype(np.uint64)
    hashes[n - n_dup:] = hashes[:n_dup] ^ flips
    cpu, wall = time.process_time(), time.perf_counter()
    edges = phash_edges(hashes, np.ones(n, bool), 4)
    out = {"method": "phash-mih", "n": n, "cpu_s": round(time.process_time() - cpu, 2),
           "wall_s": round(time.perf_counter() - wall, 2), "load": round(os.getloadavg()[0], 1),
           "edges": len(edges), "planted_recall": round(float(np.isin(np.arange(n_dup) * n + np.arange(n - n_dup, n),
                                                                     edges.a * n + edges.b).mean()), 5)}  # fmt: skip
    if n <= 20_000:  # the all-pairs loop a user would write: one row against all later rows
        cpu = time.process_time()
        pairs = sum(int((hamming(hashes[i + 1:], np.full(n - i - 1, hashes[i])) <= 4).sum()) for i in range(n - 1))
        out.update(all_pairs_cpu_s=round(time.process_time() - cpu, 2), all_pairs_edges=pairs)
    return out


def _e2e_child(n: int) -> dict:
    """``run(DedupJob(--by sha256,phash))`` end to end over a written n-row manifest and annotations folder
    (2.5% sha256 pairs, 5% phash pairs with one bit flipped): the whole command's time and peak RSS."""
    import tempfile

    import pyarrow as pa

    from manifests.annotations import (AnnotationsCounts, AnnotationsMeta, TaskSettings, settings_fingerprint,
                                       write_annotations_meta, write_part)  # fmt: skip
    from manifests.buckets import BucketSpec
    from manifests.manifest import apply_buckets, write_manifest
    from manifests.schema import sample_ids
    from manifests.storage import open_url
    from pipeline import DedupJob, run

    root = tempfile.mkdtemp(prefix="bucketeer_dedup_")
    rng = np.random.default_rng(0)
    names = [f"d{i % 997}/img_{i:08d}.jpg" for i in range(n)]
    rows = pa.table({"sample_id": pa.array(sample_ids(names), pa.uint64()), "filename": names,
                     "width": pa.array(rng.integers(256, 4096, n), pa.int32()),
                     "height": pa.array(rng.integers(256, 4096, n), pa.int32()), "caption": pa.nulls(n, pa.string()),
                     "size": pa.array(rng.integers(1000, 3_000_000, n), pa.int64()), "format": ["JPEG"] * n,
                     "orientation": pa.array(np.ones(n, np.int8))})  # fmt: skip
    samples, small = apply_buckets(rows, BucketSpec())
    manifest = write_manifest(f"{root}/manifest", samples, small, source="/data", spec=BucketSpec())
    samples = samples.sort_by("sample_id")
    n_dup = n // 20
    phash = rng.integers(0, 2**64 - 1, n, dtype=np.uint64)
    phash[n - n_dup:] = phash[:n_dup] ^ (np.uint64(1) << rng.integers(0, 64, n_dup).astype(np.uint64))
    sha = [f"{i:064x}" for i in range(n)]
    for i in range(n_dup // 2):
        sha[n - n_dup - 1 - i] = sha[n_dup + i]
    tasks = tuple(TaskSettings(task=t, model="rule", weight_sha256="") for t in ("sha256", "phash"))
    fingerprint = settings_fingerprint(tasks)
    table = pa.table({"sample_id": samples.column("sample_id"), "filename": samples.column("filename"),
                      "source_key": pa.array(np.arange(n), pa.uint64()), "written_at": pa.array(np.ones(n)),
                      "sha256": pa.array(sha), "phash": pa.array(phash, pa.uint64())})  # fmt: skip
    fs, path = open_url(f"{root}/ann")
    write_part(fs, path, "parts", "p.parquet", table, fingerprint)
    write_annotations_meta(f"{root}/ann", None, AnnotationsMeta(
        manifest=f"{root}/manifest", manifest_fingerprint=manifest.fingerprint, tasks=tasks,
        settings_fingerprint=fingerprint, engine="rule", counts=AnnotationsCounts(samples=n, annotated=n, errors=0),
        parts=("p.parquet",), fingerprint=""))  # fmt: skip
    del table, sha, rows, samples, small
    base = _reset_peak()
    cpu, wall = time.process_time(), time.perf_counter()
    result = run(DedupJob(annotations=(f"{root}/ann",), out=f"{root}/dups"))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    shutil.rmtree(root)
    return {"method": "e2e sha256,phash", "n": n, "cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
            "load": round(os.getloadavg()[0], 1), "rss_before_mib": base // 1024,
            "peak_rss_mib": _status_kib("VmHWM") // 1024, "duplicates": result.duplicates,
            "planted_duplicates": n_dup + n_dup // 2}  # fmt: skip


def _run_child(args: list[str]) -> dict:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="5000,10000,20000,50000,200000,1000000", help="sizes for ours")
    parser.add_argument("--flat-sizes", default="5000,10000", help="sizes for ours forced to flat")
    parser.add_argument("--brute-sizes", default="20000,50000", help="sizes for faiss brute force")
    parser.add_argument("--brute-memory-sizes", default="1000000",
                        help="sizes for the brute-force memory probe (full index, 2,048 queries)")
    parser.add_argument("--phash-sizes", default="20000,1000000,4000000")
    parser.add_argument("--e2e-sizes", default="1000000", help="sizes for the whole command, --by sha256,phash")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, every child in each; medians published")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        method, n = args.child[0], int(args.child[1])
        child = {"phash": _phash_child, "e2e": _e2e_child}.get(method, lambda n: _child(method, n))
        print(json.dumps(child(n)))
        return
    run = Run("dedup", shlex.join(["python", "benchmarks/dedup.py", *sys.argv[1:]]), tools=["faiss-cpu"])  # '' kept
    for _ in range(args.rounds):
        with run.round():
            one_round(run, args)
    run.save()


def one_round(run: Run, args: argparse.Namespace) -> None:
    """Every child once, printed; CPU, memory, recall and the ratios to brute force added to ``run``."""
    results = []
    for method, sizes in (("brute", args.brute_sizes), ("ours", args.sizes), ("phash", args.phash_sizes),
                          ("flat", args.flat_sizes), ("brute-memory", args.brute_memory_sizes),
                          ("e2e", args.e2e_sizes)):  # fmt: skip
        for n in (int(s) for s in sizes.split(",") if s):
            results.append(r := _run_child(["--child", method, str(n)]))
            print(json.dumps(r), flush=True)
            what = f"{r['method']} at {n:,}"
            run.add(f"{what}: CPU", r["cpu_s"], "s")
            if "peak_rss_mib" in r:
                run.add(f"{what}: peak RSS", r["peak_rss_mib"], "MiB")
            if "index_mib" in r:
                run.add(f"{what}: search (peak RSS - RSS before)", r["index_mib"], "MiB")
            if "planted_recall" in r and method != "brute-memory":
                run.add(f"{what}: planted pairs found", r["planted_recall"])
            if "sampled_recall" in r:
                run.add(f"{what}: recall vs exact search (2,000 sampled rows)", r["sampled_recall"])
            if "all_pairs_cpu_s" in r:
                run.add(f"numpy all-pairs loop at {n:,}: CPU", r["all_pairs_cpu_s"], "s")
                run.add(f"numpy all-pairs loop / ours at {n:,}: CPU", r["all_pairs_cpu_s"] / max(r["cpu_s"], 0.01),
                        "x")  # fmt: skip
            if method == "e2e":
                run.add(f"{what}: duplicates found / planted", r["duplicates"] / r["planted_duplicates"])
    brute = {r["n"]: r for r in results if r["method"] == "brute"}
    ours = {r["n"]: r for r in results if r["method"] == "ours"}
    for n in sorted(set(brute) & set(ours)):
        found, want = (np.load(f"/tmp/bucketeer_dedup_{m}_{n}.npy") for m in ("ours", "brute"))
        print(f"n={n}: recall vs brute force {np.isin(want, found).mean():.5f} of {len(want)} pairs; "
              f"CPU brute / ours = {brute[n]['cpu_s'] / max(ours[n]['cpu_s'], 1e-9):.1f}")  # fmt: skip
        run.add(f"ours at {n:,}: recall vs brute force's {len(want):,} pairs", float(np.isin(want, found).mean()))
        run.add(f"brute force / ours at {n:,}: CPU", brute[n]["cpu_s"] / max(ours[n]["cpu_s"], 0.1), "x")
    if len(brute) >= 2:
        (n1, b1), (n2, b2) = sorted(brute.items())[:2]
        c = (b2["cpu_s"] - b1["cpu_s"]) / (n2**2 - n1**2)
        print(f"brute force, marginal c = {c:.3g} CPU-s per N^2; EXTRAPOLATED at 1M: {c * 1e12:.0f} CPU-s")
        run.add("brute force at 1,000,000, EXTRAPOLATED as c N² from its two sizes: CPU", c * 1e12, "s")
    if len(ours) >= 2:
        (n1, o1), (n2, o2) = sorted(ours.items())[-2:]
        print(f"ours, marginal {(o2['cpu_s'] - o1['cpu_s']) / (n2 - n1) * 1e6:.1f} CPU-s per million rows "
              f"between {n1} and {n2}")  # fmt: skip
        run.add(f"ours, marginal between {n1:,} and {n2:,}: CPU per million rows", (o2["cpu_s"] - o1["cpu_s"])
                / (n2 - n1) * 1e6, "s")  # fmt: skip


if __name__ == "__main__":
    main()
