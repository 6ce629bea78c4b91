"""``bucketeer plan --annotations --where [--weight-by]`` against the same plan without selection.

    python benchmarks/plan_select.py                                  # 10M samples (a few GB in a temp folder)
    python benchmarks/plan_select.py --sizes 1000000,10000000 --epochs 1,10   # two sizes: the marginal rate

Builds, per size, a manifest of N samples (40 Zipf-skewed SDXL buckets, real manifest parts) and two
annotations folders written as ``bucketeer annotate`` / ``bucketeer dedup`` write them (``aesthetic``
float32, ``duplicate`` bool, parts of 1M rows). Then, each in a fresh child process (so that its peak RSS,
``VmHWM``, is its own), the whole ``bucketeer plan`` job (``run(PlanJob(...))``: read the manifest, and for
the selection the annotations' two columns, evaluate, plan and write every epoch):

- ``plain``: the plan of every sample, what a user runs without selection;
- ``where``: ``--where "aesthetic > 5.5 AND NOT duplicate AND width * height >= 1000000"`` (keeps about 40%);
- ``weighted``: the same ``--where`` with ``--weight-by aesthetic`` (a mixture plan with per-sample draws);
- ``evaluate``: :func:`manifests.select.evaluate` alone (the selection's own cost).

Reported: wall and CPU seconds (the child's user + system time: the machine is shared, so CPU time is the
figure to compare), peak memory, their ratios to ``plain`` (target <= 1.5x), and with two sizes the marginal
CPU seconds per million samples, so that start-up (imports, reading JSON) drops out. The inputs are built once;
each of ``--rounds`` rounds (default 3) runs every child again, and the medians are published from
``benchmarks/results/plan_select.json`` by :mod:`benchmarks.results`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.results import Run  # noqa: E402
from manifests.buckets import SDXL_BUCKETS  # noqa: E402

WHERE = "aesthetic > 5.5 AND NOT duplicate AND width * height >= 1000000"
SHAPE = dict(world_size=64, batch_size=4, seed=0)
PART_ROWS = 1_000_000


def maxrss_mib() -> float:
    """Peak resident memory of this process (``VmHWM``; ``ru_maxrss`` carries a parent's peak over execve)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def build(root: str, n: int, buckets: int = 40, seed: int = 0) -> dict:
    """A manifest of ``n`` samples and its ``scores`` and ``dups`` annotations under ``root``; their URLs."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from manifests.annotations import (AnnotationsCounts, AnnotationsMeta, TaskSettings, part_name,
                                       write_annotations_meta, write_part)  # fmt: skip
    from manifests.buckets import BucketSpec
    from manifests.manifest import read_manifest_meta, write_manifest
    from manifests.schema import ERRORS_SCHEMA
    from manifests.storage import open_url

    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(0, 2**63 - 1, int(n * 1.01) + 16, dtype=np.int64).astype(np.uint64))
    ids = rng.permutation(ids)[:n]  # (n,) distinct
    p = 1.0 / np.arange(1, buckets + 1) ** 1.2
    codes = rng.choice(buckets, size=n, p=p / p.sum())
    sides = np.asarray(SDXL_BUCKETS[:buckets], np.int32)  # (buckets, 2)
    names = pa.array([f"{w}x{h}" for w, h in SDXL_BUCKETS[:buckets]])
    number = pc.cast(pa.array(np.arange(n)), pa.string())
    samples = pa.table({
        "sample_id": pa.array(ids), "filename": pc.binary_join_element_wise("images/", number, ".jpg", ""),
        "width": pa.array(sides[codes, 0]), "height": pa.array(sides[codes, 1]),
        "caption": pc.binary_join_element_wise("a photo ", number, ""), "bucket": names.take(pa.array(codes)),
        "size": pa.array(rng.integers(10_000, 3_000_000, n)), "format": pa.array(["JPEG"] * n),
    })  # fmt: skip
    manifest = os.path.join(root, "manifest")
    write_manifest(manifest, samples, ERRORS_SCHEMA.empty_table(), source="/data", spec=BucketSpec())
    fingerprint = read_manifest_meta(manifest).fingerprint
    columns = {"scores": ("aesthetic", pa.array(rng.uniform(0, 10, n).astype(np.float32))),
               "dups": ("duplicate", pa.array(rng.random(n) < 0.1))}  # fmt: skip
    for folder, (column, values) in columns.items():
        url = os.path.join(root, folder)
        fs, base = open_url(url, None)
        settings = f"bench-{folder}"
        parts = []
        for start in range(0, n, PART_ROWS):
            m = min(PART_ROWS, n - start)
            rows = slice(start, start + m)
            chunk = pa.table({"sample_id": pa.array(ids[rows]), "filename": samples["filename"][start:start + m],
                              "source_key": pa.array(np.zeros(m, np.uint64)), "written_at": pa.array(np.ones(m)),
                              column: values[start:start + m]})  # fmt: skip
            parts.append(part_name(settings, ids[start:start + m], np.zeros(m, np.uint64)))
            write_part(fs, base, "parts", parts[-1], chunk, settings)
        write_annotations_meta(url, None, AnnotationsMeta(
            manifest=manifest, manifest_fingerprint=fingerprint,
            tasks=(TaskSettings(task=column, model="bench", weight_sha256="0" * 64),), settings_fingerprint=settings,
            engine="transformers", counts=AnnotationsCounts(samples=n, annotated=n, errors=0), parts=tuple(parts),
            fingerprint=""))  # fmt: skip
    return {"manifest": manifest, "scores": os.path.join(root, "scores"), "dups": os.path.join(root, "dups")}


def child(kind: str, paths: dict, out: str, epochs: int) -> dict:
    """One measured run in this (fresh) process."""
    from pipeline import PlanJob, run

    started, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    extra: dict = {}
    planned = None
    with contextlib.redirect_stdout(io.StringIO()):
        if kind == "evaluate":
            from manifests.manifest import read_manifest
            from manifests.select import evaluate

            sel = evaluate([read_manifest(paths["manifest"])], [paths["scores"], paths["dups"]], WHERE)
            planned = sel.selections[0].kept
        else:
            if kind != "plain":
                extra = dict(annotations=(paths["scores"], paths["dups"]), where=WHERE)
            if kind == "weighted":
                extra["weight_by"] = "aesthetic"
            result = run(PlanJob(manifests=(paths["manifest"],), out=out, epochs=epochs, progress=False, **SHAPE,
                                 **extra))  # fmt: skip
            planned = result.planned
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"kind": kind, "wall_s": round(time.perf_counter() - started, 3),
            "cpu_s": round(cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime, 3),
            "peak_mib": round(maxrss_mib(), 1), "planned": planned}  # fmt: skip


def run_child(args: list[str]) -> dict:
    done = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000000", help="samples per manifest, comma-separated (two: marginal)")
    parser.add_argument("--epochs", default="1,10", help="epochs planned, comma-separated (each measured)")
    parser.add_argument("--kinds", default="plain,where,weighted,evaluate")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, every child in each; medians published")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--paths", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        print(json.dumps(child(a.child, json.loads(a.paths), a.out, int(a.epochs))))
        return
    run = Run("plan_select", "python benchmarks/plan_select.py" + "".join(f" {x}" for x in sys.argv[1:]),
              tools=["polars"])
    sizes = [int(s) for s in a.sizes.split(",")]
    with contextlib.ExitStack() as stack:
        built = {}
        for n in sizes:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-plan-select-"))
            t = time.perf_counter()
            built[n] = (tmp, build(tmp, n))
            print(f"# {n:,} samples: inputs built in {time.perf_counter() - t:.1f} s; load {os.getloadavg()}",
                  flush=True)  # fmt: skip
        for _ in range(a.rounds):
            with run.round():
                one_round(run, a, built)
    run.save()


def one_round(run: Run, a: argparse.Namespace, built: dict) -> None:
    """Every (size, epochs, kind) child once; its figures, ratios to ``plain`` and marginal rates added to ``run``."""
    rows = {}
    for n, (tmp, paths) in built.items():
        for epochs in (int(e) for e in a.epochs.split(",")):
            for kind in a.kinds.split(","):
                if kind == "evaluate" and (n, 0, kind) in rows:
                    continue  # the same in every epoch count
                key = (n, 0 if kind == "evaluate" else epochs, kind)
                out = os.path.join(tmp, f"{kind}-{epochs}")
                rows[key] = r = run_child(["--child", kind, "--paths", json.dumps(paths), "--out", out,
                                           "--epochs", str(epochs)])  # fmt: skip
                shutil.rmtree(out, ignore_errors=True)
                base = rows.get((n, epochs, "plain"))
                ratio = "" if base is None or kind == "plain" else (
                    f"  ratio cpu {r['cpu_s'] / base['cpu_s']:.2f}x, peak {r['peak_mib'] / base['peak_mib']:.2f}x")
                print(f"{n:>11,} {key[1]:>3} epochs {kind:>9}: wall {r['wall_s']:8.2f} s  cpu {r['cpu_s']:8.2f} s"
                      f"  peak {r['peak_mib']:8.1f} MiB  planned {r['planned']:,}{ratio}  "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
                what = f"{n / 1e6:g}M, " + ("evaluate alone" if kind == "evaluate" else f"{epochs} epochs, {kind}")
                run.add(f"{what}: CPU", r["cpu_s"], "s")
                run.add(f"{what}: peak", r["peak_mib"], "MiB")
                if base is not None and kind in ("where", "weighted"):
                    target = "<= 1.5" if kind == "where" else ""
                    run.add(f"{what} / plain: CPU", r["cpu_s"] / base["cpu_s"], "x", target=target)
                    run.add(f"{what} / plain: peak", r["peak_mib"] / base["peak_mib"], "x", target=target)
    sizes = sorted({n for n, _, _ in rows})
    if len(sizes) == 2:
        lo, hi = sizes
        for (n, epochs, kind) in sorted(k for k in rows if k[0] == lo):
            if (hi, epochs, kind) in rows:
                low, high = rows[(lo, epochs, kind)], rows[(hi, epochs, kind)]
                rate = (high["cpu_s"] - low["cpu_s"]) / ((hi - lo) / 1e6)
                mem = (high["peak_mib"] - low["peak_mib"]) / ((hi - lo) / 1e6)
                print(f"marginal {epochs:>3} epochs {kind:>9}: {rate:.3f} CPU s and {mem:.0f} MiB per million samples")
                what = "evaluate alone" if kind == "evaluate" else f"{epochs} epochs, {kind}"
                run.add(f"marginal, {what}: CPU s per million samples", rate, "s")
                run.add(f"marginal, {what}: peak MiB per million samples", mem, "MiB")


if __name__ == "__main__":
    main()
