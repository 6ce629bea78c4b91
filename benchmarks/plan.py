"""Shard planning at scale: bucketeer's numpy planner vs a per-sample Python bucket sampler.

    python benchmarks/plan.py                      # 10M samples, 40 skewed buckets, 64 ranks, batch 8
    python benchmarks/plan.py --samples 1000000    # smaller

Measures, for one epoch: seconds and peak memory to plan it and write every rank's parquet file
(bucketeer ``write_plan``, in a fresh child process so that its peak RSS — ``ru_maxrss`` of the
child, which includes the interpreter and the input arrays — is the planning command's own), and
seconds for one rank to read its rows (``read_rank_plan``, another fresh process). The
alternative is the loop popular trainers run at start-up on every rank (a dict of per-bucket
lists, ``random.shuffle``, chunking, ``batches[rank::world]``); it runs on a subsample and is
extrapolated linearly (it is O(n)). It is timed on ready-made Python lists, which favours it,
and it does not write anything nor guarantee equal buckets per step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from manifests.buckets import SDXL_BUCKETS  # noqa: E402


def make_inputs(n: int, buckets: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random uint64 ids and a skewed (Zipf-like, exponent 1.2) bucket index per sample."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 2**63, n, dtype=np.uint64)
    p = 1.0 / np.arange(1, buckets + 1) ** 1.2
    codes = rng.choice(buckets, size=n, p=p / p.sum()).astype(np.int32)
    return ids, codes


def bucket_array(codes: np.ndarray, buckets: int):
    import pyarrow as pa

    names = pa.array([f"{w}x{h}" for w, h in SDXL_BUCKETS[:buckets]], pa.string())
    return pa.DictionaryArray.from_arrays(pa.array(codes), names).cast(pa.string())  # as read from a manifest


def child_plan(inputs: str, out: str, world: int, batch: int, buckets: int) -> dict:
    from manifests.plan import write_plan
    from manifests.plan.schedule import PlanConfig, group_samples, plan_epoch

    data = np.load(inputs)
    ids, names = data["ids"], bucket_array(data["codes"], buckets)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    config = PlanConfig(world_size=world, batch_size=batch, seed=0, epochs=1)
    t0 = time.perf_counter()
    samples = group_samples(ids, names)
    t1 = time.perf_counter()
    plan_epoch(samples, config, 0)
    t2 = time.perf_counter()
    meta = write_plan(out, ids, names, config, manifest_fingerprint="bench")  # group + plan + write, end to end
    t3 = time.perf_counter()
    return {
        "group_s": t1 - t0,
        "plan_epoch_s": t2 - t1,
        "write_plan_s": t3 - t2,
        "steps": meta["steps_per_epoch"],
        "dropped": meta["counts"]["dropped"],
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "inputs_rss_mib": rss0 / 1024,
    }


def child_read(out: str, rank: int) -> dict:
    t0 = time.perf_counter()
    from manifests.plan import read_rank_plan

    t1 = time.perf_counter()
    rows = read_rank_plan(out, rank)
    t2 = time.perf_counter()
    return {"read_s": t2 - t1, "import_s": t1 - t0, "rows": rows.num_rows}


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
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--buckets", type=int, default=40)
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--baseline-samples", type=int, default=1_000_000)
    ap.add_argument("--child", choices=["plan", "read"])
    ap.add_argument("--inputs")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.child == "plan":
        print(json.dumps(child_plan(a.inputs, a.out, a.world_size, a.batch_size, a.buckets)))
        return
    if a.child == "read":
        print(json.dumps(child_read(a.out, 17 % a.world_size)))
        return

    ids, codes = make_inputs(a.samples, a.buckets)
    with tempfile.TemporaryDirectory() as tmp:
        inputs, out = os.path.join(tmp, "inputs.npz"), os.path.join(tmp, "plan")
        np.savez(inputs, ids=ids, codes=codes)
        shape = ["--world-size", str(a.world_size), "--batch-size", str(a.batch_size), "--buckets", str(a.buckets)]
        plan = run_child(["--child", "plan", "--inputs", inputs, "--out", out, *shape])
        read = run_child(["--child", "read", "--out", out, *shape])
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)

    m = min(a.baseline_samples, a.samples)
    names = [f"{w}x{h}" for w, h in SDXL_BUCKETS[: a.buckets]]
    sub_ids, sub_buckets = ids[:m].tolist(), [names[c] for c in codes[:m].tolist()]
    t0 = time.perf_counter()
    python_bucket_sampler(sub_ids, sub_buckets, a.world_size, a.batch_size, 0, 0)
    loop_s = (time.perf_counter() - t0) * a.samples / m

    print(
        f"{a.samples:,} samples, {a.buckets} buckets (Zipf 1.2), {a.world_size} ranks x batch {a.batch_size}, one epoch"
    )
    print(f"  bucketeer group_samples (canonical order)   {plan['group_s']:7.2f} s")
    print(f"  bucketeer plan_epoch (global batches, memory){plan['plan_epoch_s']:7.2f} s")
    print(
        f"  bucketeer write_plan (group+plan+write {a.world_size} files, {size / 2**20:.0f} MiB) "
        f"{plan['write_plan_s']:7.2f} s   -> {plan['steps']} steps, {plan['dropped']} dropped"
    )
    print(
        f"  peak RSS of the planning process (ru_maxrss)  {plan['maxrss_mib']:7.0f} MiB "
        f"(inputs loaded: {plan['inputs_rss_mib']:.0f} MiB)"
    )
    print(f"  one rank reads its rows (read_rank_plan)     {read['read_s']:7.3f} s ({read['rows']} rows)")
    print(
        f"  per-sample Python bucket sampler loop        {loop_s:7.2f} s "
        f"(measured on {m:,}, x{a.samples / m:g}; no write, no equal-bucket steps)"
    )
    print(
        f"  ratio loop / plan_epoch: {loop_s / plan['plan_epoch_s']:.1f}x;  "
        f"loop / write_plan (incl. writing): {loop_s / plan['write_plan_s']:.1f}x"
    )


if __name__ == "__main__":
    main()
