"""The report's score and duplicate sections on big annotations folders, against a pandas notebook.

    python benchmarks/report_scores.py                          # 200,000 and 1,000,000 samples
    python benchmarks/report_scores.py --sizes 20000,100000     # quicker
    python benchmarks/report_scores.py --rounds 3                # rounds (default 3), medians published

Per size: a synthetic manifest, a score folder (the 8 float scores, ``grayscale`` and a 64-d float16
``embedding`` the report must not read) and a dedup folder (``duplicate``, ``cluster_id``,
``keeper_id``, ``similarity``; 5% of the samples in clusters of 2 to 6), written with the
annotations writers in parts of 100,000 rows. Each measure runs in a fresh child process (its peak
memory is its own ``VmHWM``):

- ``bucketeer``: :func:`pipeline.report.scores.score_parts` (read, join on sample_id, histograms,
  the 8 lowest and highest per score, the 6 largest clusters, every figure rendered to PNG);
- ``pandas``: what a user would write in a notebook: ``pd.read_parquet`` of every part of both
  folders, merge on sample_id, then per score ``np.histogram``, ``nsmallest(8)``, ``nlargest(8)``,
  and ``groupby("cluster_id").size().nlargest(6)``; no figure drawn (which favours it).

The manifest's images do not exist: each shown sample's read fails at once (reading and decoding the
~180 thumbnails is a cost that does not grow with the folder). CPU seconds (user + system, of the
child), wall seconds and peak memory; the marginal CPU seconds per million samples from the two
sizes (start-up and imports drop out) and their ratio. The inputs are written once; each of ``--rounds`` rounds
runs both tools at both sizes, and the medians are published from ``benchmarks/results/report_scores.json``
(:mod:`benchmarks.results`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.results import Run  # noqa: E402

FLOATS = ("aesthetic", "safety", "watermark", "luminance", "contrast", "colourfulness", "sharpness",
          "border_fraction")  # fmt: skip
PART_ROWS = 100_000
DIM = 64


def write_folder(url: str, manifest, task: str, columns: dict, ids: np.ndarray, names: list[str]) -> None:
    import pyarrow as pa

    from manifests.annotations import (AnnotationsCounts, AnnotationsMeta, TaskSettings, part_name,
                                       settings_fingerprint, write_annotations_meta, write_part)  # fmt: skip
    from manifests.storage import open_url

    settings = (TaskSettings(task=task, model="default", weight_sha256="0" * 64),)
    fingerprint = settings_fingerprint(settings)
    fs, root = open_url(url)
    parts = []
    for start in range(0, len(ids), PART_ROWS):
        end = min(start + PART_ROWS, len(ids))
        table = pa.table({"sample_id": pa.array(ids[start:end], pa.uint64()), "filename": names[start:end],
                          "source_key": pa.array(np.ones(end - start, np.uint64)),
                          "written_at": pa.array(np.ones(end - start)),
                          **{k: v.slice(start, end - start) for k, v in columns.items()}})  # fmt: skip
        name = part_name(fingerprint, ids[start:end], np.ones(end - start, np.uint64))
        write_part(fs, root, "parts", name, table, fingerprint)
        parts.append(name)
    counts = AnnotationsCounts(samples=len(ids), annotated=len(ids), errors=0)
    write_annotations_meta(url, None, AnnotationsMeta(
        manifest=manifest.url, manifest_fingerprint=manifest.fingerprint, tasks=settings,
        settings_fingerprint=fingerprint, engine="transformers", counts=counts, parts=tuple(parts), fingerprint=""))


def make_inputs(root: str, n: int) -> None:
    import pyarrow as pa

    from manifests.buckets import BucketSpec
    from manifests.manifest import read_manifest, write_manifest
    from tests.factories import manifest_tables

    samples, errors = manifest_tables(n, seed=1)
    os.makedirs(f"{root}/images", exist_ok=True)
    write_manifest(f"{root}/manifest", samples, errors, source=f"{root}/images", spec=BucketSpec())
    manifest = read_manifest(f"{root}/manifest")
    ids = manifest.samples.column("sample_id").to_numpy()
    names = manifest.samples.column("filename").to_pylist()
    n = len(ids)
    rng = np.random.default_rng(0)
    scores = {k: pa.array(rng.random(n, np.float32)) for k in FLOATS}
    scores["grayscale"] = pa.array(rng.random(n) < 0.05)
    flat = pa.array(rng.standard_normal(n * DIM).astype(np.float16))
    scores["embedding"] = pa.FixedSizeListArray.from_arrays(flat, DIM)
    write_folder(f"{root}/scores", manifest, "stats", scores, ids, names)
    # 5% of the samples in clusters of 2..6: the first of each cluster is its keeper
    cluster, keeper, similarity = ids.copy(), ids.copy(), np.ones(n, np.float32)
    at = 0
    while at < n // 20:
        size = int(rng.integers(2, 7))
        members = slice(at, min(at + size, n))
        cluster[members], keeper[members] = ids[at], ids[at]
        similarity[at + 1:members.stop] = rng.uniform(0.9, 1.0, members.stop - at - 1)
        at += size
    dedup = {"duplicate": pa.array(keeper != ids), "cluster_id": pa.array(cluster), "keeper_id": pa.array(keeper),
             "similarity": pa.array(similarity)}  # fmt: skip
    write_folder(f"{root}/dedup", manifest, "dedup", dedup, ids, names)


def measure_bucketeer(root: str) -> None:
    from manifests.manifest import read_manifest
    from pipeline.report import plots
    from pipeline.report.scores import score_parts

    manifest = read_manifest(f"{root}/manifest")
    parts = score_parts([f"{root}/scores", f"{root}/dedup"], manifest, plots)
    assert [p.title.split(":")[0] for p in parts] == ["Scores", "Duplicates"]


def measure_pandas(root: str) -> None:
    import glob

    import pandas as pd

    samples = pd.read_parquet(f"{root}/manifest/samples", columns=["sample_id", "filename", "width", "height"])
    scores = pd.concat([pd.read_parquet(p) for p in sorted(glob.glob(f"{root}/scores/parts/*.parquet"))])
    dedup = pd.concat([pd.read_parquet(p) for p in sorted(glob.glob(f"{root}/dedup/parts/*.parquet"))])
    df = samples.merge(scores.drop(columns=["filename"]), on="sample_id", how="left")
    df = df.merge(dedup[["sample_id", "duplicate", "cluster_id", "keeper_id", "similarity"]], on="sample_id")
    for name in FLOATS:
        np.histogram(df[name].dropna(), bins=40)
        df.nsmallest(8, name)[["filename", name]]
        df.nlargest(8, name)[["filename", name]]
    df["grayscale"].value_counts(dropna=False)
    sizes = df.groupby("cluster_id").size()
    top = sizes[sizes > 1].nlargest(6)
    df[df["cluster_id"].isin(top.index)].sort_values(["cluster_id", "similarity"], ascending=[True, False])


def child(measure: str, root: str) -> None:
    started, cpu = time.perf_counter(), time.process_time()
    {"bucketeer": measure_bucketeer, "pandas": measure_pandas}[measure](root)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
    print(json.dumps({"wall": time.perf_counter() - started, "cpu": time.process_time() - cpu,
                      "cpu_all": usage.ru_utime + usage.ru_stime, "peak_mib": peak / 1024}))  # fmt: skip


def run_child(measure: str, root: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", measure, root], capture_output=True, text=True,
                          check=True, env={**os.environ, "PYTHONPATH": os.path.dirname(HERE)})  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="200000,1000000", help="two manifest sizes (samples)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, both tools at both sizes in each")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    sizes = [int(s) for s in args.sizes.split(",")]
    if len(sizes) != 2:
        raise SystemExit("benchmarks/report_scores.py: --sizes takes two sizes, e.g. --sizes 200000,1000000")
    run = Run("report_scores", "python benchmarks/report_scores.py" + "".join(f" {a}" for a in sys.argv[1:]),
              tools=["pandas"])
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            make_inputs(f"{tmp}/n{n}", n)
        for _ in range(args.rounds):
            with run.round():
                one_round(run, tmp, sizes)
    run.save()


def one_round(run: Run, tmp: str, sizes: list[int]) -> None:
    """Both tools at both sizes, each in a fresh child; their figures and the marginal ratio added to ``run``."""
    results: dict[str, list[dict]] = {"bucketeer": [], "pandas": []}
    for n in sizes:
        for measure in results:
            r = run_child(measure, f"{tmp}/n{n}")
            results[measure].append(r)
            print(f"{n:>10,} samples  {measure:<9}  {r['cpu']:7.2f} CPU s (measure)  {r['cpu_all']:7.2f} CPU s "
                  f"(process)  {r['wall']:7.2f} s wall  peak {r['peak_mib']:7.0f} MiB", flush=True)  # fmt: skip
            run.add(f"{n:,} samples: {measure} CPU", r["cpu"], "s")
            run.add(f"{n:,} samples: {measure} wall", r["wall"], "s")
            run.add(f"{n:,} samples: {measure} peak", r["peak_mib"], "MiB")
    per_million = {m: (rs[1]["cpu"] - rs[0]["cpu"]) / (sizes[1] - sizes[0]) * 1e6 for m, rs in results.items()}
    for m, v in per_million.items():
        print(f"marginal: {m:<9} {v:6.2f} CPU s per million samples")
        run.add(f"marginal: {m}, CPU s per million samples", v, "s")
    print(f"ratio pandas / bucketeer (marginal CPU): {per_million['pandas'] / per_million['bucketeer']:.2f}x")
    run.add("pandas / bucketeer, marginal CPU", per_million["pandas"] / per_million["bucketeer"], "x")


if __name__ == "__main__":
    main()
