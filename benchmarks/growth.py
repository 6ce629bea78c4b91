"""How the driver's cost grows with the dataset: time and memory per item at each size, plotted.

    python benchmarks/growth.py                                   # every step at its default sizes, 3 rounds
    python benchmarks/growth.py --steps plan --sizes plan=1e6,1e7 --rounds 1

A user with 100M samples reads off what a step costs from a curve, not from one point. Each (step, size) runs
in a fresh child process (so that its peak memory is its own), the steps interleaved within a round:

- ``listing``: :func:`pipeline.sources.listing.list_source` over an in-memory object store of N image keys
  (half with a ``.txt`` sidecar), through the same split-range ListObjectsV2 walk as S3 (``list_page``, 1,000
  keys a page): the listing and its classification, what the scan's driver holds before any task starts;
- ``plan``: :func:`manifests.plan.write_plan` of N samples (random 64-bit ids, 40 buckets, Zipf-skewed), 64
  ranks, batch 16, one epoch, to a local folder: the inputs as the plan job holds them, then the plan;
- ``phash``: :func:`pipeline.dedup.edges.phash_edges` of N 64-bit hashes at Hamming threshold 4 (5% planted
  near-copies): multi-index hashing;
- ``embedding``: :func:`pipeline.dedup.semantic.embedding_edges` of N 512-d unit embeddings at cosine 0.95
  (5% planted; ``benchmarks/dedup.py``'s data), IVF with fp16 codes above its exact-search size.

Per item: CPU microseconds of the child (user + system: what the load changes least) and wall microseconds of the
step itself, and the child's peak resident memory above its memory after imports (``VmHWM`` after
``clear_refs``), in bytes per item: the inputs the step needs in memory count, as they do in the real job.
Results: ``benchmarks/results/growth.json`` (:mod:`benchmarks.results`; ``--name growth-X``: a separate run, e.g.
one large size, saved after every round) and ``benchmarks/growth.png``, which draws every ``growth*.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.results import RESULTS, Run  # noqa: E402

SIZES = {
    "listing": [10_000, 100_000, 1_000_000],
    "plan": [1_000_000, 10_000_000, 20_000_000],
    "phash": [1_000_000, 3_000_000, 10_000_000],
    "embedding": [100_000, 300_000, 1_000_000],
}
UNIT = {"listing": "key", "plan": "sample", "phash": "hash", "embedding": "embedding"}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> int:
    """Reset the peak RSS to the RSS now (Linux ``clear_refs`` 5) and return it in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


class MemoryS3:
    """N sorted keys answering ``list_page`` as S3's ListObjectsV2 does (StartAfter, MaxKeys, IsTruncated)."""

    call_s3 = None  # list_source takes the S3 walk for a filesystem that has it

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    def list_page(self, bucket: str, prefix: str, page_size: int, after: str | None) -> dict:
        import bisect

        start = bisect.bisect_right(self.keys, after) if after is not None else 0
        page = self.keys[start : start + page_size]
        contents = [{"Key": k, "Size": 1000 + i, "ETag": '"e"', "LastModified": None} for i, k in enumerate(page)]
        return {"Contents": contents, "IsTruncated": start + page_size < len(self.keys)}


def child(step: str, n: int) -> dict:
    """Run one step at size ``n`` in this process: its CPU, wall and peak memory above the imports'."""
    import resource

    tmp = tempfile.mkdtemp(prefix=f"bench-growth-{step}-")
    try:
        if step == "listing":
            from pipeline.sources.listing import list_source

            keys = sorted([f"data/{i // 10_000:04d}/img_{i:08d}.jpg" for i in range(n)]
                          + [f"data/{i // 10_000:04d}/img_{i:08d}.txt" for i in range(0, n, 2)])  # fmt: skip
            store = MemoryS3(keys)
            base = _reset_peak()  # the store's keys are the server's memory, not the driver's
            run = lambda: list_source(store, "bucket/data")  # noqa: E731
            check = lambda got: len(got.images) == n  # noqa: E731
        elif step == "plan":
            from benchmarks.plan import bucket_array, make_inputs
            from manifests.plan import DatasetSamples, write_plan
            from manifests.plan.schedule import PlanConfig

            base = _reset_peak()
            ids, codes = make_inputs(n, 40)
            names = bucket_array(codes, 40)
            del codes
            config = PlanConfig(world_size=64, batch_size=16, seed=0, epochs=1)
            run = lambda: write_plan(f"{tmp}/plan", [DatasetSamples(ids, names, manifest_fingerprint="b")], config)  # noqa: E731,E501
            check = lambda meta: meta.steps_per_epoch > 0  # noqa: E731
        elif step == "phash":
            from pipeline.dedup.edges import phash_edges

            base = _reset_peak()
            rng = np.random.default_rng(0)
            hashes = rng.integers(0, 2**64 - 1, n, dtype=np.uint64)
            k = n // 20
            hashes[n - k :] = hashes[:k] ^ (np.uint64(1) << rng.integers(0, 64, k).astype(np.uint64))
            run = lambda: phash_edges(hashes, np.ones(n, bool), 4)  # noqa: E731
            check = lambda edges: len(edges) >= k  # noqa: E731
        elif step == "embedding":
            import faiss  # noqa: F401  imported before the baseline: the search's memory, not the library's

            from benchmarks.dedup import THRESHOLD, make_embeddings
            from pipeline.dedup.semantic import embedding_edges

            base = _reset_peak()
            x, src, dup = make_embeddings(n)
            run = lambda: embedding_edges(x, np.ones(n, bool), THRESHOLD)  # noqa: E731
            check = lambda got: len(got[0]) >= 0.9 * len(src)  # noqa: E731
        else:
            raise SystemExit(f"unknown step {step}")
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu0, wall0 = usage.ru_utime + usage.ru_stime, time.perf_counter()
        got = run()
        wall = time.perf_counter() - wall0
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = usage.ru_utime + usage.ru_stime - cpu0
        assert check(got), f"{step} at {n}: an unexpected result"
        peak = _status_kib("VmHWM") - base
        return {"step": step, "n": n, "cpu_s": cpu, "wall_s": wall, "peak_mib": peak / 1024,
                "load": os.getloadavg()[0]}  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_child(step: str, n: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", step, str(n)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{step} at {n:,} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _label(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def _runs() -> list[dict]:
    """results/growth.json and the separate large-size runs beside it (``--name growth-...``)."""
    paths = [RESULTS / "growth.json", *sorted(RESULTS.glob("growth-*.json"))]
    return [json.loads(p.read_text()) for p in paths if p.exists()]


def plot(path: Path, docs: list[dict]) -> None:
    """Two panels, CPU microseconds and peak bytes per item against the size, one line per step (log-log x).

    The rows of every run are drawn together (a size measured in two runs: the later run's row).
    """
    doc = {"rows": [r for d in docs for r in d["rows"]], "rounds": [r for d in docs for r in d["rounds"]],
           "started": max(d["started"] for d in docs)}  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for step in SIZES:
        rows = {r["measure"]: r for r in doc["rows"]}
        points = sorted(((int(m.split(" at ")[1].split(":")[0].replace(",", "")), r) for m, r in rows.items()
                         if m.startswith(step + " at ")), key=lambda p: p[0])  # fmt: skip
        for ax, what in zip(axes, ("CPU us", "peak bytes")):
            xs = [n for n, r in points if r["measure"].endswith(what + " per " + UNIT[step])]
            ys = [r["median"] for n, r in points if r["measure"].endswith(what + " per " + UNIT[step])]
            if xs:
                ax.plot(xs, ys, "o-", label=f"{step} (per {UNIT[step]})")
    for ax, title in zip(axes, ("CPU microseconds per item", "peak driver memory per item (bytes)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("items")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    loads = [x for r in doc["rounds"] for x in (r["load_before"], r["load_after"])]
    fig.suptitle(f"bucketeer: cost per item by size ({doc['started'][:10]}, load {min(loads):.1f}-{max(loads):.1f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default=",".join(SIZES))
    p.add_argument("--sizes", default="", help="per step, e.g. 'plan=1e6,1e7;phash=1e6' (default: SIZES)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--name", default="growth", help="results/NAME.json (a separate run, e.g. one large size)")
    p.add_argument("--plot", action="store_true", help="only draw growth.png again from results/growth*.json")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.plot:
        return plot(HERE / "growth.png", _runs())
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return
    sizes = dict(SIZES)
    for part in filter(None, args.sizes.split(";")):
        step, _, values = part.partition("=")
        sizes[step] = [int(float(v)) for v in values.split(",")]
    steps = args.steps.split(",")
    run = Run(args.name, "python benchmarks/growth.py" + "".join(f" {a}" for a in sys.argv[1:]), tools=["faiss-cpu"])
    for r in range(args.rounds):
        with run.round():
            for step in steps:
                for n in sizes[step]:
                    got = run_child(step, n)
                    unit = UNIT[step]
                    run.add(f"{step} at {n:,}: CPU us per {unit}", got["cpu_s"] / n * 1e6, "us")
                    run.add(f"{step} at {n:,}: wall us per {unit}", got["wall_s"] / n * 1e6, "us")
                    run.add(f"{step} at {n:,}: peak bytes per {unit}", got["peak_mib"] * 2**20 / n, "B")
                    print(f"round {r + 1} {step} {_label(n)}: {got['cpu_s']:.1f} CPU-s, {got['wall_s']:.1f} s wall, "
                          f"peak {got['peak_mib']:,.0f} MiB (load {got['load']:.1f})", flush=True)  # fmt: skip
        path = run.save()  # after every round: a run stopped early keeps the rounds it finished
    print(f"wrote {path}")
    plot(HERE / "growth.png", _runs())


if __name__ == "__main__":
    main()
