"""Shuffle quality of ``plan --shuffle window[:SIZE]`` against the full shuffle, and the requests it saves.

    python benchmarks/shuffle_quality.py                                  # 100k samples, 8 ranks x 16
    python benchmarks/shuffle_quality.py --samples 1000000 --windows 256,4096

One bucket of ``--samples`` samples whose cache records are in id order (as embed writes loose files:
:func:`pipeline.embed.work.cut_units`), planned by :func:`manifests.plan.schedule.plan_epoch` with each
shuffle, side by side. Per shuffle, over two epochs:

- **displacement**: how far a sample's place in the epoch is from its place in the cache, as a fraction
  of the dataset (|epoch position / n - cache position / n|; a uniform shuffle gives a median of ~0.29);
- **consecutive distance**: the distance in the cache between consecutive samples of one rank (records;
  a uniform shuffle: ~n/3);
- **batch span**: the fraction of the cache one global batch's samples spread over (max - min position);
- **epoch correlation**: Spearman correlation of the sample order of epoch 0 and epoch 1 (0: unrelated);
- **GETs per sample** of rank 0, as :class:`manifests.cache.CacheReader` makes them: one per record
  (``read_in_chunks`` off, the full shuffle's reads: neighbours are never within ``MAX_GAP``), or
  with ``read_in_chunks`` (aligned ``--chunk-mb`` chunks, an LRU of ``--budget-mb``, what the trainer
  switches on for a window plan), modelled with records of ``--record-kb`` each (SDXL-512: ~330 KB).

Pure numpy, no storage: seconds. Prints one line per shuffle and a JSON summary, and writes every round's
figures to ``benchmarks/results/shuffle_quality.json`` (``benchmarks/results.py``): the figures are a pure
function of the arguments, so the rounds agree; the rounds record that, and the seconds each plan took.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import OrderedDict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from manifests.plan.rows import rank_table  # noqa: E402
from manifests.plan.schedule import PlanConfig, group_samples, plan_epoch  # noqa: E402

from benchmarks.results import Run  # noqa: E402


def chunk_gets(positions: np.ndarray, record: int, chunk: int, budget: int) -> int:
    """GETs to read records at ``positions`` (in order) through an LRU of ``budget`` bytes of aligned
    ``chunk``-byte chunks (records laid end to end, ``record`` bytes each)."""
    held: OrderedDict[int, None] = OrderedDict()
    gets = 0
    for p in positions.tolist():
        for c in range(p * record // chunk, ((p + 1) * record - 1) // chunk + 1):
            if c in held:
                held.move_to_end(c)
                continue
            gets += 1
            held[c] = None
            while len(held) * chunk > budget:
                held.popitem(last=False)
    return gets


def measure(n: int, shuffle: str, world: int, batch: int, record: int, chunk: int, budget: int) -> dict:
    """The figures of one shuffle (see the module docstring)."""
    samples = group_samples(np.arange(n, dtype=np.uint64), ["512x512"] * n)  # id = cache position
    config = PlanConfig(world_size=world, batch_size=batch, seed=1, shuffle=shuffle)
    epochs = [plan_epoch(samples, config, e) for e in (0, 1)]
    order = epochs[0].ids.astype(np.int64)  # (slots,) epoch order of cache positions
    moved = np.abs(np.arange(len(order)) / n - order / n)
    rank0 = np.concatenate([np.asarray(b, np.int64) for b in rank_table(epochs[0], world, 0)
                            .column("sample_ids").to_pylist()])  # fmt: skip
    gaps = np.abs(np.diff(rank0))
    spans = np.ptp(order.reshape(-1, world * batch), axis=1) / n  # (steps,)
    place = np.empty(n, np.int64)
    place0 = place.copy()
    place0[order] = np.arange(len(order))
    place[epochs[1].ids.astype(np.int64)] = np.arange(len(epochs[1].ids))
    both = np.intersect1d(order, epochs[1].ids.astype(np.int64))
    corr = float(np.corrcoef(place0[both], place[both])[0, 1])
    per_record = len(rank0)
    return {"shuffle": shuffle, "displacement_median": float(np.median(moved)),
            "displacement_p90": float(np.quantile(moved, 0.9)), "consecutive_median": float(np.median(gaps)),
            "consecutive_within_8": float(np.mean(gaps <= 8)), "batch_span_median": float(np.median(spans)),
            "epoch_correlation": corr, "gets_per_sample_one_per_record": 1.0,
            "gets_per_sample_chunked": chunk_gets(rank0, record, chunk, budget) / per_record}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--windows", default="64,256,1024", help="window sizes to compare with the full shuffle")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--record-kb", type=int, default=330)
    p.add_argument("--chunk-mb", type=int, default=8)
    p.add_argument("--budget-mb", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    shuffles = ["full"] + [f"window:{w}" for w in a.windows.split(",")]
    run = Run("shuffle_quality", "python benchmarks/shuffle_quality.py" + "".join(f" {x}" for x in sys.argv[1:]))
    for _ in range(a.rounds):
        with run.round():
            out = []
            for s in shuffles:
                t = time.process_time()
                m = measure(a.samples, s, a.world_size, a.batch_size, a.record_kb << 10, a.chunk_mb << 20,
                            a.budget_mb << 20)  # fmt: skip
                out.append(m)
                run.add(f"{s}: displacement, median", m["displacement_median"])
                run.add(f"{s}: consecutive distance, median", m["consecutive_median"], "records")
                run.add(f"{s}: batch span, median", m["batch_span_median"])
                run.add(f"{s}: epoch 0 vs 1 correlation", m["epoch_correlation"])
                run.add(f"{s}: GETs per sample, chunked reads", m["gets_per_sample_chunked"])
                run.add(f"{s}: CPU s to plan and measure", time.process_time() - t, "s")
    print(f"{a.samples:,} samples, {a.world_size} ranks x batch {a.batch_size}; rank 0's GETs with records of "
          f"{a.record_kb} KB, {a.chunk_mb} MB chunks, {a.budget_mb} MB held")
    for m in out:
        print(f"{m['shuffle']:>12}: displacement median {m['displacement_median']:.3f} (p90 "
              f"{m['displacement_p90']:.3f}), consecutive distance median {m['consecutive_median']:,.0f} records "
              f"({m['consecutive_within_8']:.0%} within 8), batch span {m['batch_span_median']:.4f}, epoch "
              f"correlation {m['epoch_correlation']:+.3f}, GETs/sample chunked {m['gets_per_sample_chunked']:.3f} "
              f"(one per record: 1)")  # fmt: skip
    print(json.dumps(out))
    run.save()


if __name__ == "__main__":
    main()
