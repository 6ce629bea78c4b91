"""The filter language (manifests/filters) against polars' own SQL, which every --where went through before and
which a user with a parquet manifest would reach for (``df.filter(pl.sql_expr(...))``): the same filters over
the same frame, CPU time per row.

    python benchmarks/filters.py                       # 2M and 20M rows, 3 rounds
    python benchmarks/filters.py --sizes 200000,1000000 --rounds 1   # quicker

The frame has a manifest's and its annotations' columns (width, height int32, a 60-character caption, bucket,
aesthetic float32 with 5% nulls, duplicate bool with 5% nulls). Per filter and size, each tool parses and
evaluates the filter ``--repeats`` times and keeps its median CPU seconds (user + system of every thread: polars
evaluates on a pool); the figure is the **marginal** CPU nanoseconds per row between the two sizes, so parsing
and start-up drop out, and their ratio ours / polars SQL. The parse alone (text to expression, no rows) is
timed apart, in microseconds. Results: ``benchmarks/results/filters.json`` (``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.results import Run  # noqa: E402
from manifests.filters import parse_filter  # noqa: E402

FILTERS = {
    "score, duplicate, pixels": "aesthetic > 5.5 AND NOT duplicate AND width * height >= 1000000",
    "score, duplicate, pixels, 32-bit": "aesthetic > 5.5 AND NOT duplicate AND width * height >= 1000000",
    "bucket IN 6": "bucket IN ('1024x1024', '832x1216', '1216x832', '896x1152', '1152x896', '768x1344')",
    "bucket IN 40": "bucket IN (" + ", ".join([f"'{w}x{h}'" for w in range(512, 2048, 64) for h in (768, 1024)][:40])
                    + ")",
    "caption ILIKE": "caption ILIKE '%cat%' AND aesthetic > 5",
    "CASE weight": "CASE WHEN aesthetic > 8 THEN 0 ELSE COALESCE(aesthetic, 1) END",
}
BUCKETS = ["1024x1024", "832x1216", "1216x832", "896x1152", "1152x896", "768x1344", "1344x768", "640x1536",
           "1024x768", "1216x768"]
WORDS = ["a", "cat", "dog", "on", "the", "red", "sofa", "photo", "of", "street", "at", "night", "blue", "sky"]


def frame(rows: int, seed: int = 0):
    import polars as pl

    rng = np.random.default_rng(seed)
    captions = [" ".join(rng.choice(WORDS, 12)) for _ in range(5000)]  # ~60 characters, 5,000 distinct
    aesthetic = rng.uniform(0, 10, rows).astype(np.float32)
    return pl.DataFrame({
        "width": rng.integers(512, 2048, rows, dtype=np.int32), "height": rng.integers(512, 2048, rows, dtype=np.int32),
        "caption": pl.Series(captions).gather(rng.integers(0, len(captions), rows)),
        "bucket": pl.Series(BUCKETS).gather(rng.integers(0, len(BUCKETS), rows)),
        "aesthetic": pl.Series(aesthetic).scatter(rng.choice(rows, rows // 20, replace=False), None),
        "duplicate": pl.Series(rng.random(rows) < 0.3).scatter(rng.choice(rows, rows // 20, replace=False), None),
    })  # fmt: skip


def seconds(fn, repeats: int) -> float:
    """Median CPU seconds of ``repeats`` calls of ``fn``."""
    out = []
    for _ in range(repeats):
        started = time.process_time()  # every thread of this process
        fn()
        out.append(time.process_time() - started)
    return statistics.median(out)


def ours(df, text: str):
    return parse_filter(text).values(df)  # what every command runs: parse, build with the frame's schema, evaluate


def polars_sql(df, text: str):
    import polars as pl

    return df.select(pl.sql_expr(text).alias("v")).to_series()


# ours computes width * height (int32 columns) in 64 bits; polars' SQL in 32, wrapping past 2**31 pixels. The
# alternative that gives our answer on every manifest casts them itself; the "32-bit" row times it without
SAME_ANSWER = {"score, duplicate, pixels": "aesthetic > 5.5 AND NOT duplicate AND "
                                           "CAST(width AS BIGINT) * CAST(height AS BIGINT) >= 1000000"}


def one_round(run: Run, frames: dict, repeats: int) -> None:
    import polars as pl

    small, large = sorted(frames)
    for name, text in FILTERS.items():
        theirs = SAME_ANSWER.get(name, text)
        a, b = ours(frames[small], text), polars_sql(frames[small], theirs)
        if a.dtype == pl.Boolean:  # the same rows (IS NOT TRUE aside, which none of these uses)
            assert a.fill_null(False).equals(b.cast(pl.Boolean).fill_null(False)), name
        per_row = {}
        for tool, fn, said in (("ours", ours, text), ("polars SQL", polars_sql, theirs)):
            cost = {n: seconds(lambda: fn(frames[n], said), repeats) for n in (small, large)}
            per_row[tool] = (cost[large] - cost[small]) / (large - small) * 1e9
            run.add(f"{name}: {tool}, CPU ns per row", per_row[tool], unit="ns")
        target = "" if name.endswith("32-bit") else "<= 1.2"  # a wrong answer on large images is no target
        run.add(f"{name}: ours / polars SQL", per_row["ours"] / per_row["polars SQL"], unit="x", target=target)
        for tool, parse in (("ours", lambda: parse_filter(text).expr()), ("polars SQL", lambda: pl.sql_expr(theirs))):
            started = time.perf_counter()
            for _ in range(200):
                parse()
            run.add(f"{name}: {tool}, parse", (time.perf_counter() - started) / 200 * 1e6, unit="µs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2000000,20000000", help="two row counts: the marginal rate between them")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, both tools in each; the median is published")
    parser.add_argument("--repeats", type=int, default=11, help="evaluations per tool, filter and size (median)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if len(sizes) != 2 or sizes[0] >= sizes[1]:
        parser.error("--sizes takes two row counts, the smaller first")
    frames = {n: frame(n) for n in sizes}
    run = Run("filters", "python benchmarks/filters.py" + "".join(f" {a}" for a in sys.argv[1:]), tools=["polars"])
    for r in range(args.rounds):
        with run.round():
            one_round(run, frames, args.repeats)
        print(f"round {r + 1} of {args.rounds} done", flush=True)
    run.save()


if __name__ == "__main__":
    main()
