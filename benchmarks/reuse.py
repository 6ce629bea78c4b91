"""``embed --reuse`` against embedding a second dataset from scratch, on this machine's CPU (the tiny default models).

    python benchmarks/reuse.py                                # sdxl, 512² images, 64 -> 256 images of B; 3 rounds
    python benchmarks/reuse.py --family flux --rounds 1       # quicker, another family

A user with a second dataset that shares half its images with a first (other names) either embeds it from scratch,
what every trainer's cache does, or, here, ``embed --reuse`` the first's cache. Per round: dataset A (``--sizes``'s
larger count of smooth JPEGs of ``--side``² pixels, each with its own caption) is embedded; then two sizes of B (half
of them A's images under other names with A's captions, half new ones) are embedded both ways, ``--executor local``.
Reported, median of the rounds: the **marginal** seconds per image of B (the larger run minus the smaller over the
images between them: start-up and model loading drop out), from scratch over with ``--reuse``; the images each
encoded; the bytes taken from A; that each taken latent is A's bit for bit; and how many latent elements differ from
a fresh encode of B, against how many differ between two fresh encodes at batch 16 and 8 (a VAE's output for an image
moves by a few bf16 ulps with the other images of its batch: the same noise, not reuse's). On a GPU the
ratio is larger: the device time saved is the VAE's, which a tiny CPU model understates against the decode, which
is saved too. Results: ``benchmarks/results/reuse.json`` (``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.estimate import dataset  # noqa: E402
from benchmarks.results import Run  # noqa: E402


def second(a_root: str, a_manifest: str, root: str, manifest: str, n: int, seed: int, side: int) -> None:
    """B: ``n // 2`` of A's images copied under other names with their captions, and ``n - n // 2`` new ones."""
    import pyarrow as pa

    from manifests.manifest import apply_buckets, read_manifest, write_manifest
    from manifests.schema import ERRORS_SCHEMA, sample_ids

    dataset(root, manifest + "-new", n - n // 2, seed, side=side)
    new = read_manifest(manifest + "-new").samples
    old = read_manifest(a_manifest).samples.sort_by("filename").slice(0, n // 2)
    names = [f"copy_{i:05d}.jpg" for i in range(old.num_rows)]
    for name, src in zip(names, old.column("filename").to_pylist()):
        shutil.copyfile(os.path.join(a_root, src), os.path.join(root, name))
    table = pa.table({"sample_id": pa.array(sample_ids(names), pa.uint64()), "filename": names,
                      **{c: old.column(c) for c in ("width", "height", "caption", "size")}})  # fmt: skip
    both = pa.concat_tables([table, new.select(table.column_names).cast(table.schema)])
    meta = read_manifest(manifest + "-new").meta
    samples, _ = apply_buckets(both, meta.bucket_spec)
    write_manifest(manifest, samples, ERRORS_SCHEMA.empty_table(), source=root, spec=meta.bucket_spec)


def embed(manifest: str, out: str, family: str, reuse: tuple[str, ...] = (), batch_size: int = 16):
    from pipeline import EmbedJob, run

    t0 = time.perf_counter()
    result = run(EmbedJob(manifest=manifest, out=out, family=family, model="default", executor="local", reuse=reuse,
                          batch_size=batch_size))  # fmt: skip
    return result, time.perf_counter() - t0


def compare(source: str | None, cache: str, fresh: str) -> tuple[float, float]:
    """``(share of cache's records taken from source whose latent is source's bit for bit, share of cache's latent
    elements that differ from fresh's)``: the same samples, the same image in source by content."""
    import numpy as np

    from tests.embed_data import records_by_id

    mine, other = records_by_id(cache), records_by_id(fresh)
    held = {r.content: r for r in records_by_id(source).values()} if source else {}
    taken = [r for r in mine.values() if r.content in held]
    same = sum(np.array_equal(r.latent, held[r.content].latent) for r in taken) / max(len(taken), 1)
    moved = sum(int((mine[k].latent != other[k].latent).sum()) for k in mine)
    return same, moved / sum(r.latent.size for r in mine.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="sdxl")
    parser.add_argument("--sizes", type=lambda t: tuple(int(x) for x in t.split(",")), default=(64, 256),
                        help="two sizes of B (images); A holds the larger")  # fmt: skip
    parser.add_argument("--side", type=int, default=512, help="images of side² pixels, buckets of that area")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", default=None, help="folder for the datasets and caches (default: a temporary one)")
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="bench-reuse-")
    run = Run("reuse", "python benchmarks/reuse.py" + "".join(f" {a}" for a in sys.argv[1:]))
    for r in range(args.rounds):
        with run.round():
            measure(run, args, os.path.join(work, f"round-{r}"), seed=1000 * r)
        print(f"round {r + 1} of {args.rounds} done", flush=True)
    run.save()


def measure(run: Run, args, base: str, seed: int) -> None:
    from manifests.cache import read_index

    n1, n2 = args.sizes
    dataset(f"{base}/warm", f"{base}/mwarm", 8, seed + 1, side=args.side)  # the model built, kernels warmed
    embed(f"{base}/mwarm", f"{base}/cwarm", args.family)
    dataset(f"{base}/a", f"{base}/ma", n2, seed + 2, side=args.side)
    embed(f"{base}/ma", f"{base}/ca", args.family)
    seconds, encoded, taken_bytes = {}, {}, 0
    for n in (n1, n2):
        second(f"{base}/a", f"{base}/ma", f"{base}/b{n}", f"{base}/mb{n}", n, seed + 3 + n, args.side)
        fresh, seconds["fresh", n] = embed(f"{base}/mb{n}", f"{base}/fresh{n}", args.family)
        taken, seconds["reuse", n] = embed(f"{base}/mb{n}", f"{base}/reuse{n}", args.family, (f"{base}/ca",))
        encoded["fresh", n], encoded["reuse", n] = fresh.embedded, taken.embedded - taken.reused_samples
        copied, moved = compare(f"{base}/ca", f"{base}/reuse{n}", f"{base}/fresh{n}")
        run.add(f"{args.family}: taken latents equal to the cache's they came from ({n} images)", copied, "",
                target=">= 1", note="share of the taken records, bit for bit")  # fmt: skip
        embed(f"{base}/mb{n}", f"{base}/fresh{n}-b8", args.family, batch_size=8)
        noise = compare(None, f"{base}/fresh{n}-b8", f"{base}/fresh{n}")[1]
        run.add(f"{args.family}: latent elements unlike a fresh encode, with --reuse / fresh at batch 8 ({n} images)",
                moved / noise if noise else float(moved == 0), "x",
                note=f"with --reuse {moved:.1e}, a fresh encode at batch 8 instead of 16 {noise:.1e} of the elements: "
                "the VAE's batch-composition noise, not reuse's")  # fmt: skip
        if n == n2:
            rows = read_index(f"{base}/reuse{n}")["samples"]
            taken_bytes = sum(rows.column("length").to_pylist()) * taken.reused_samples // max(rows.num_rows, 1)
    per = {k: (seconds[k, n2] - seconds[k, n1]) / (n2 - n1) for k in ("fresh", "reuse")}
    run.add(f"{args.family}: marginal s/image of B, from scratch / with --reuse (half shared, {args.side}²)",
            per["fresh"] / per["reuse"], "x", note=f"from scratch {per['fresh'] * 1e3:.1f} ms, with --reuse "
            f"{per['reuse'] * 1e3:.1f} ms per image")  # fmt: skip
    run.add(f"{args.family}: images encoded with --reuse / from scratch ({n2} images)",
            encoded["reuse", n2] / encoded["fresh", n2], "x", note="half of B is A's images")  # fmt: skip
    run.add(f"{args.family}: record bytes taken from A instead of encoded ({n2} images)", taken_bytes / 1e6, "MB",
            note="mean compressed record x records taken; written again into B")  # fmt: skip
    print(f"{args.family}: from scratch {per['fresh'] * 1e3:.1f} ms/image, with --reuse {per['reuse'] * 1e3:.1f} "
          f"ms/image; encoded {encoded}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
