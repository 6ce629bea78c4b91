"""Shard plans at cluster scale: 10M samples, 40 buckets, 1,024 ranks x batch 4, 100 epochs.

    python benchmarks/plan.py                                   # the full run (~8 GB written to a temp folder)
    python benchmarks/plan.py --epochs 10 --samples 1000000     # smaller
    python benchmarks/plan.py --mix --world-size 64 --epochs 3  # mixture: 3 manifests vs one of the same size

Measures, each in a fresh child process so that its peak RSS (``VmHWM``) is its own:

- making the plan (``write_plan``: group, plan and write every epoch): seconds, seconds per epoch,
  peak memory; then objects and bytes written, bytes per sample-epoch (per planned sample slot
  and per manifest sample);
- one rank starting (``_plan.json`` + the first epoch's footer and row group, what the trainer's
  :class:`train.data.RankSteps` reads) and reading one more epoch: seconds and peak memory, with
  the interpreter and pyarrow's own baseline memory shown apart.

Side by side, in the same run, the alternatives a user would otherwise have: the previous layout
(one parquet file per (epoch, rank), ids not delta-encoded: one epoch written that way, extrapolated
to every epoch), and the loop popular trainers run at start-up on every rank (a dict of per-bucket
lists, ``random.shuffle``, ``batches[rank::world]``; run on a subsample and extrapolated linearly, on
ready-made Python lists, which favours it; it writes nothing and does not give equal steps).

``--mix``: a plan of 3 manifests (10M, 1M, 10k samples by default, ``--mix-sizes``) with ``--weights
0.6,0.3,0.1`` (an epoch of as many slots as the three hold together: the 10k dataset repeated 110x)
against today's one-manifest plan of the same total size, same world shape, each in a fresh
process: seconds per epoch and peak memory, and their ratio (target <= 1.5x).

The inputs are made once; each of ``--rounds`` rounds (default 3) measures every side again, and the medians are
published from ``benchmarks/results/plan.json`` (``--mix``: ``plan-mix.json``) by :mod:`benchmarks.results`.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.results import Run  # noqa: E402
from manifests.buckets import SDXL_BUCKETS  # noqa: E402


def make_inputs(n: int, buckets: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random uint64 ids (full 64 bits, as sample ids are) and a skewed (Zipf 1.2) bucket per sample."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
    p = 1.0 / np.arange(1, buckets + 1) ** 1.2
    codes = rng.choice(buckets, size=n, p=p / p.sum()).astype(np.int32)
    return ids, codes


def bucket_array(codes: np.ndarray, buckets: int):
    import pyarrow as pa

    names = pa.array([f"{w}x{h}" for w, h in SDXL_BUCKETS[:buckets]], pa.string())
    return pa.DictionaryArray.from_arrays(pa.array(codes), names).cast(pa.string())  # as read from a manifest


def maxrss_mib() -> float:
    """This process's peak resident memory in MiB.

    ``VmHWM``, not ``ru_maxrss``: Linux carries the parent's peak RSS into a child's ``ru_maxrss``
    across ``execve``, so a child of this benchmark (which holds the 10M inputs) would report the
    parent's memory as its own.
    """
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_seconds() -> float:
    """User + system CPU seconds of this process: next to wall time on a machine shared with other jobs."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child_plan(inputs: str, out: str, world: int, batch: int, buckets: int, epochs: int) -> dict:
    from manifests.plan import DatasetSamples, write_plan
    from manifests.plan.schedule import PlanConfig

    data = np.load(inputs)
    ids, names = data["ids"], bucket_array(data["codes"], buckets)
    rss0 = maxrss_mib()
    config = PlanConfig(world_size=world, batch_size=batch, seed=0, epochs=epochs)
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    meta = write_plan(out, [DatasetSamples(ids, names, manifest_fingerprint="bench")], config)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    dropped = meta.epochs[0].dropped_total
    return {"seconds": seconds, "cpu_s": cpu, "steps": meta.steps_per_epoch, "dropped_per_epoch": dropped,
            "maxrss_mib": maxrss_mib(), "inputs_rss_mib": rss0}  # fmt: skip


def child_mix(inputs: str, out: str, world: int, batch: int, buckets: int, epochs: int) -> dict:
    """The mixture plan: group the datasets, apply the rule, plan and write every epoch."""
    from manifests.plan import DatasetSamples, MixRule, write_plan
    from manifests.plan.schedule import PlanConfig

    data = np.load(inputs)
    sets = sorted(int(k[3:]) for k in data.files if k.startswith("ids"))
    inputs_ = [(data[f"ids{d}"], bucket_array(data[f"codes{d}"], buckets)) for d in sets]
    rss0 = maxrss_mib()
    config = PlanConfig(world_size=world, batch_size=batch, seed=0, epochs=epochs)
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    datasets = [DatasetSamples(ids, names, None, f"m{d}", manifest_fingerprint=f"bench{d}", manifest=f"m{d}")
                for d, (ids, names) in enumerate(inputs_)]  # fmt: skip
    meta = write_plan(out, datasets, config, rule=MixRule.parse("weights", "0.6,0.3,0.1", len(inputs_)))
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    return {"seconds": seconds, "cpu_s": cpu, "steps": meta.steps_per_epoch, "maxrss_mib": maxrss_mib(),
            "inputs_rss_mib": rss0, "per_epoch": [d.per_epoch for d in meta.mix.datasets],
            "bytes": sum(e.bytes for e in meta.epochs)}  # fmt: skip


def mix_main(a: argparse.Namespace, shape: list[str], run: Run) -> None:
    """Mixture vs one manifest of the same total size, same world shape, each in a fresh process."""
    sizes = [int(x) for x in a.mix_sizes.split(",")]
    parts = [make_inputs(n, a.buckets, seed=d + 1) for d, n in enumerate(sizes)]
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        mixed, single = os.path.join(tmp, "mixed.npz"), os.path.join(tmp, "single.npz")
        np.savez(mixed, **{f"ids{d}": ids for d, (ids, _) in enumerate(parts)},
                 **{f"codes{d}": codes for d, (_, codes) in enumerate(parts)})  # fmt: skip
        np.savez(single, ids=np.concatenate([ids for ids, _ in parts]),
                 codes=np.concatenate([codes for _, codes in parts]))  # fmt: skip
        del parts
        epochs = ["--epochs", str(a.epochs)]
        for r in range(a.rounds):
            with run.round():
                one = run_child(["--child", "plan", "--inputs", single, "--out", os.path.join(tmp, f"one{r}"),
                                 *epochs, *shape])  # fmt: skip
                mix = run_child(["--child", "mix", "--inputs", mixed, "--out", os.path.join(tmp, f"mix{r}"),
                                 *epochs, *shape])  # fmt: skip
                shutil.rmtree(os.path.join(tmp, f"one{r}")), shutil.rmtree(os.path.join(tmp, f"mix{r}"))
                mix_report(run, a, sizes, one, mix)
    run.save()


def mix_report(run: Run, a: argparse.Namespace, sizes: list[int], one: dict, mix: dict) -> None:
    """Print one round of ``--mix`` and add its figures to ``run``."""
    total = sum(sizes)
    print(f"mixture of {len(sizes)} manifests ({', '.join(f'{n:,}' for n in sizes)} samples; --weights 0.6,0.3,0.1 "
          f"-> {', '.join(f'{k:,}' for k in mix['per_epoch'])} per epoch) vs one manifest of {total:,}; "
          f"{a.buckets} buckets, {a.world_size} ranks x batch {a.batch_size}, {a.epochs} epochs")
    for name, r in (("one manifest", one), ("mixture", mix)):
        print(f"  {name:<14} {r['seconds'] / a.epochs:7.2f} s per epoch (CPU {r['cpu_s'] / a.epochs:.2f} s), "
              f"peak memory {r['maxrss_mib']:6.0f} MiB (inputs loaded {r['inputs_rss_mib']:.0f} MiB), "
              f"{r['steps']} steps per epoch")
    print(f"  ratio mixture / one manifest: time {mix['seconds'] / one['seconds']:.2f}x (CPU "
          f"{mix['cpu_s'] / one['cpu_s']:.2f}x), peak memory {mix['maxrss_mib'] / one['maxrss_mib']:.2f}x "
          "(target <= 1.5x)", flush=True)
    for name, r in (("one manifest", one), ("mixture", mix)):
        run.add(f"{name}: wall seconds per epoch", r["seconds"] / a.epochs, "s")
        run.add(f"{name}: CPU seconds per epoch", r["cpu_s"] / a.epochs, "s")
        run.add(f"{name}: peak memory", r["maxrss_mib"], "MiB")
    run.add("mixture / one manifest: wall time", mix["seconds"] / one["seconds"], "x", target="<= 1.5")
    run.add("mixture / one manifest: CPU time", mix["cpu_s"] / one["cpu_s"], "x", target="<= 1.5")
    run.add("mixture / one manifest: peak memory", mix["maxrss_mib"] / one["maxrss_mib"], "x", target="<= 1.5")


def child_old_layout(inputs: str, world: int, batch: int, buckets: int) -> dict:
    """One epoch in the previous layout: a parquet file per rank, ids stored plain (no compression)."""
    import pyarrow.parquet as pq

    from manifests.plan.rows import rank_table
    from manifests.plan.schedule import PlanConfig, group_samples, plan_epoch

    data = np.load(inputs)
    samples = group_samples(data["ids"], bucket_array(data["codes"], buckets))
    schedule = plan_epoch(samples, PlanConfig(world_size=world, batch_size=batch), 0)
    t0 = time.perf_counter()
    size = 0
    for rank in range(world):
        buf = io.BytesIO()
        pq.write_table(rank_table(schedule, world, rank), buf, row_group_size=1 << 20,
                       compression={"epoch": "zstd", "step": "zstd", "rank": "zstd", "bucket": "zstd",
                                    "sample_ids": "none"})  # fmt: skip
        size += len(buf.getvalue())
    return {"encode_s": time.perf_counter() - t0, "bytes": size}


def child_rank(out: str, rank: int) -> dict:
    t0 = time.perf_counter()
    from manifests.plan import read_plan_meta, read_plan_rows

    t1 = time.perf_counter()
    base = maxrss_mib()
    meta = read_plan_meta(out)
    first = read_plan_rows(out, [0], [rank], meta=meta).table()  # what a rank needs to take its first step
    t2 = time.perf_counter()
    start_rss = maxrss_mib()
    second = read_plan_rows(out, [1], [rank], meta=meta).table() if len(meta.epochs) > 1 else first
    t3 = time.perf_counter()
    return {"import_s": t1 - t0, "start_s": t2 - t1, "epoch_s": t3 - t2, "rows": first.num_rows,
            "ids": len(second.column("sample_ids").combine_chunks().values), "baseline_mib": base,
            "start_mib": start_rss, "maxrss_mib": maxrss_mib()}  # fmt: skip


def python_bucket_sampler(ids: list, buckets: list, world: int, batch: int, seed: int, epoch: int) -> list:
    """The per-sample loop a user would otherwise run on every rank at start-up."""
    rnd = random.Random(seed * 1000003 + epoch)
    by_bucket: dict = defaultdict(list)
    for i, b in zip(ids, buckets):
        by_bucket[b].append(i)
    batches = []
    for items in by_bucket.values():
        rnd.shuffle(items)
        for s in range(0, len(items) - batch + 1, batch):
            batches.append(items[s : s + batch])
    rnd.shuffle(batches)
    per_rank = [batches[r::world] for r in range(world)]
    steps = min(len(p) for p in per_rank)
    return [p[:steps] for p in per_rank]


def run_child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--buckets", type=int, default=40)
    ap.add_argument("--world-size", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--baseline-samples", type=int, default=1_000_000)
    ap.add_argument("--dir", default=None, help="where to write the plan (default: a temp folder, removed after)")
    ap.add_argument("--mix", action="store_true", help="benchmark a mixture plan against one manifest")
    ap.add_argument("--mix-sizes", default="10000000,1000000,10000", help="--mix: samples of each manifest")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, every side in each; the medians are published")
    ap.add_argument("--child", choices=["plan", "old", "rank", "mix"])
    ap.add_argument("--inputs")
    ap.add_argument("--out")
    a = ap.parse_args()
    shape = ["--world-size", str(a.world_size), "--batch-size", str(a.batch_size), "--buckets", str(a.buckets)]
    if a.child == "plan":
        print(json.dumps(child_plan(a.inputs, a.out, a.world_size, a.batch_size, a.buckets, a.epochs)))
        return
    if a.child == "mix":
        print(json.dumps(child_mix(a.inputs, a.out, a.world_size, a.batch_size, a.buckets, a.epochs)))
        return
    command = "python benchmarks/plan.py" + "".join(f" {x}" for x in sys.argv[1:])
    if a.mix:
        mix_main(a, shape, Run("plan-mix", command))
        return
    if a.child == "old":
        print(json.dumps(child_old_layout(a.inputs, a.world_size, a.batch_size, a.buckets)))
        return
    if a.child == "rank":
        print(json.dumps(child_rank(a.out, 517 % a.world_size)))
        return

    ids, codes = make_inputs(a.samples, a.buckets)
    m = min(a.baseline_samples, a.samples)
    names = [f"{w}x{h}" for w, h in SDXL_BUCKETS[: a.buckets]]
    sub_ids, sub_buckets = ids[:m].tolist(), [names[c] for c in codes[:m].tolist()]
    run = Run("plan", command)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        inputs, out = os.path.join(tmp, "inputs.npz"), os.path.join(tmp, "plan")
        np.savez(inputs, ids=ids, codes=codes)
        for _ in range(a.rounds):
            with run.round():
                plan = run_child(["--child", "plan", "--inputs", inputs, "--out", out, "--epochs", str(a.epochs),
                                  *shape])  # fmt: skip
                files = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs]
                size = sum(os.path.getsize(f) for f in files)
                plan_json = os.path.getsize(os.path.join(out, "_plan.json"))
                rank = run_child(["--child", "rank", "--out", out, *shape])
                old = run_child(["--child", "old", "--inputs", inputs, *shape])
                shutil.rmtree(out)
                report(run, a, plan, rank, old, files, size, plan_json, sub_ids, sub_buckets, m)
    run.save()


def report(run: Run, a: argparse.Namespace, plan: dict, rank: dict, old: dict, files: list[str], size: int,
           plan_json: int, sub_ids: list, sub_buckets: list, m: int) -> None:
    """Time the Python loop, print one round and add its figures to ``run``."""
    t0 = time.perf_counter()
    python_bucket_sampler(sub_ids, sub_buckets, a.world_size, a.batch_size, 0, 0)
    loop_s = (time.perf_counter() - t0) * a.samples / m

    slots = plan["steps"] * a.world_size * a.batch_size * a.epochs  # sample ids written
    per_epoch = plan["seconds"] / a.epochs
    print(f"{a.samples:,} samples, {a.buckets} buckets (Zipf 1.2), {a.world_size} ranks x batch {a.batch_size}, "
          f"{a.epochs} epochs: {plan['steps']} steps per epoch, {plan['dropped_per_epoch']:,} dropped per epoch")
    print("make the plan (write_plan, every epoch)")
    print(f"  seconds                                 {plan['seconds']:9.1f} s  "
          f"({per_epoch:.2f} s per epoch; target <= 5)")
    print(f"  CPU seconds (user + system)             {plan['cpu_s']:9.1f} s  "
          f"({plan['cpu_s'] / a.epochs:.2f} s per epoch; the wall time above includes waiting for a core "
          "on a shared machine)")
    print(f"  peak memory (VmHWM)                     {plan['maxrss_mib']:9.0f} MiB (inputs loaded: "
          f"{plan['inputs_rss_mib']:.0f} MiB)")
    print(f"  objects written                         {len(files):9d}    "
          f"(target <= 200; _plan.json {plan_json / 1e3:.0f} kB)")
    print(f"  bytes written                           {size / 1e9:9.2f} GB")
    print(f"  bytes per sample-epoch                  {size / slots:9.2f}    per planned sample slot (target <= 8); "
          f"{size / (a.samples * a.epochs):.2f} per manifest sample")
    print(f"one rank (rank {517 % a.world_size}), fresh process")
    print(f"  start: _plan.json + epoch 0's rows      {rank['start_s']:9.3f} s  ({rank['rows']} rows; imports "
          f"{rank['import_s']:.2f} s; target <= 2)")
    print(f"  read one more epoch                     {rank['epoch_s']:9.3f} s  ({rank['ids']:,} sample ids)")
    print(f"  peak memory (VmHWM)                     {rank['maxrss_mib']:9.0f} MiB (after imports: "
          f"{rank['baseline_mib']:.0f} MiB; target <= 200)")
    old_size = old["bytes"] * a.epochs
    print("the alternatives, same run")
    print(f"  previous layout: a file per (epoch, rank) {a.world_size * a.epochs:7d} objects, "
          f"{old_size / 1e9:.2f} GB ({old['bytes'] / (slots / a.epochs):.2f} bytes per slot), "
          f"encoding {old['encode_s']:.2f} s per epoch (one epoch written, x{a.epochs})")
    print(f"  per-sample Python bucket sampler loop   {loop_s:9.2f} s per epoch on every rank "
          f"(measured on {m:,}, x{a.samples / m:g}; no write, no equal steps)")
    print(f"  ratios: objects {a.world_size * a.epochs / len(files):.0f}x fewer, bytes {old_size / size:.2f}x fewer; "
          f"loop / plan per epoch {loop_s / per_epoch:.1f}x", flush=True)
    run.add("make the plan: wall seconds per epoch", per_epoch, "s", target="<= 5")
    run.add("make the plan: CPU seconds per epoch", plan["cpu_s"] / a.epochs, "s")
    run.add("make the plan: peak memory", plan["maxrss_mib"], "MiB")
    run.add("make the plan: inputs loaded", plan["inputs_rss_mib"], "MiB")
    run.add("objects written", len(files), target="<= 200")
    run.add("_plan.json", plan_json, "B")
    run.add("bytes written", size / 1e9, "GB")
    run.add("bytes per sample-epoch (per planned sample slot)", size / slots, "B", target="<= 8")
    run.add("one rank starts (_plan.json + epoch 0's footer and row group)", rank["start_s"], "s", target="<= 2")
    run.add("one rank: imports", rank["import_s"], "s")
    run.add("one rank reads one more epoch", rank["epoch_s"], "s")
    run.add("one rank: peak memory", rank["maxrss_mib"], "MiB", target="<= 200")
    run.add("one rank: memory after imports", rank["baseline_mib"], "MiB")
    run.add("previous layout (a file per (epoch, rank)): objects", a.world_size * a.epochs)
    run.add("previous layout: bytes", old_size / 1e9, "GB")
    run.add("previous layout: bytes per slot", old["bytes"] / (slots / a.epochs), "B")
    run.add("previous layout / plan: objects", a.world_size * a.epochs / len(files), "x")
    run.add("previous layout / plan: bytes", old_size / size, "x")
    run.add(f"per-sample Python bucket-sampler loop, per epoch ({m:,} measured, extrapolated)", loop_s, "s")
    run.add("loop / plan, per epoch (wall)", loop_s / per_epoch, "x")


if __name__ == "__main__":
    main()
