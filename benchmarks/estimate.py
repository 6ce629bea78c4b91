"""``bucketeer estimate`` against the embed run it prices, on this machine's CPU with the tiny default models.

    python benchmarks/estimate.py                                   # sdxl, pixart, qwen-image; 3 rounds
    python benchmarks/estimate.py --families sdxl --rounds 1        # quicker

Per family: the rate is measured at 256² and at 512² images (``--executor local``, the CPU): the marginal seconds
per image between two dataset sizes (``--calibrate``), so start-up and model loading drop out, each image's own
caption counted in it; what ``make gpu-check`` measures on a GPU. With those two points (a power law between
them: :func:`pipeline.estimate.images_per_second`), two sizes of another dataset (``--check``, images of
``--side``² pixels, each caption its own) are estimated and then embedded. Reported per family, median of the
rounds: the estimate's bytes against the tensor bytes the run wrote (read back), and the **marginal** time (the
larger minus the smaller run) estimated over actual, and its error. Results: ``benchmarks/results/estimate.json``
(``benchmarks/results.py``); the median rates are printed in ``pipeline/rates.json``'s form for its ``cpu`` entry.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
from collections import Counter
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.results import Run  # noqa: E402

SIZES = [(256, 256), (320, 192), (192, 320), (288, 224)]  # (w, h) at 256² of area: scaled by the side asked


def dataset(root: str, manifest: str, n: int, seed: int, side: int = 256) -> None:
    """``n`` smooth JPEGs of :data:`SIZES` scaled to ``side``² of area under ``root``, each with a caption of its own,
    and their manifest (buckets of ``side``² area)."""
    import pyarrow as pa
    from PIL import Image

    from manifests.buckets import BucketSpec
    from manifests.manifest import apply_buckets, write_manifest
    from manifests.schema import ERRORS_SCHEMA, sample_ids

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        w, h = (v * side // 256 for v in SIZES[i % len(SIZES)])
        small = Image.fromarray(rng.integers(0, 256, (h // 16, w // 16, 3), dtype=np.uint8))
        buf = io.BytesIO()
        small.resize((w, h), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=90)
        name = f"img_{seed}_{i:05d}.jpg"
        with open(os.path.join(root, name), "wb") as f:
            f.write(buf.getvalue())
        rows.append((name, w, h, f"photo {seed} {i} of a " + " ".join(rng.choice(["red", "cat", "on", "sofa"], 8)),
                     len(buf.getvalue())))  # fmt: skip
    names = [r[0] for r in rows]
    table = pa.table({"sample_id": pa.array(sample_ids(names), pa.uint64()), "filename": names,
                      "width": pa.array([r[1] for r in rows], pa.int32()),
                      "height": pa.array([r[2] for r in rows], pa.int32()),
                      "caption": [r[3] for r in rows], "size": pa.array([r[4] for r in rows], pa.int64())})  # fmt: skip
    spec = BucketSpec(area=side * side, step=32)
    samples, _ = apply_buckets(table, spec)
    write_manifest(manifest, samples, ERRORS_SCHEMA.empty_table(), source=root, spec=spec)


def written(cache: str) -> int:
    from manifests.cache import CacheReader, read_index

    reader = CacheReader(cache)
    latent = sum(r.latent.nbytes for r in reader.read(reader.sample_ids.tolist()))
    keys = read_index(cache)["texts"].column("caption_key").to_pylist()
    return latent + sum(sum(t.nbytes for t in r.tokens) + (0 if r.pooled is None else r.pooled.nbytes)
                        for r in reader.read_texts(keys))  # fmt: skip


def embed(manifest: str, out: str, family: str):
    from pipeline import EmbedJob, run

    job = EmbedJob(manifest=manifest, out=out, family=family, model="default", executor="local")
    t0 = time.perf_counter()
    result = run(job)
    return job, result, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="sdxl,pixart,qwen-image")
    sizes = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    parser.add_argument("--calibrate", type=sizes, default=(64, 256), help="two sizes of the calibration dataset")
    parser.add_argument("--check", type=sizes, default=(128, 512), help="two sizes of the checked dataset")
    parser.add_argument("--side", type=int, default=384, help="the checked dataset's images: side² pixels of area")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", default=None, help="folder for the datasets and caches (default: a temporary one)")
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="bench-estimate-")
    run = Run("estimate", "python benchmarks/estimate.py" + "".join(f" {a}" for a in sys.argv[1:]))
    rates: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        with run.round():
            for family in args.families.split(","):
                rates.setdefault(family, []).append(measure(run, family, work, args, seed=100 * r))
        print(f"round {r + 1} of {args.rounds} done", flush=True)
    run.save()
    cpu = {f: {"default": {"images": [[p, round(statistics.median(x["images"][i][1] for x in v), 3)]
                                      for i, (p, _) in enumerate(v[0]["images"])]}} for f, v in rates.items()}
    print(json.dumps({"cpu": {"families": cpu}}, indent=1))


def measure(run: Run, family: str, work: str, args, seed: int) -> dict:
    """One round of one family: the rate at 256² and at 512² (the marginal seconds per image between two dataset
    sizes: start-up and model loads drop out; each image's own caption counted in it), then two sizes of another
    dataset (``--side``² images) estimated with those rates and run."""
    from pipeline import EmbedJob
    from pipeline.estimate import EstimateJob, device_seconds, estimate
    from manifests.manifest import read_manifest

    base = os.path.join(work, f"{family}-{seed}")
    dataset(f"{base}/warm", f"{base}/mwarm", 8, seed)  # the default model built, imports and kernels warmed
    embed(f"{base}/mwarm", f"{base}/cwarm", family)
    points = []
    for side in (256, 512):
        seconds = {}
        for n in args.calibrate:
            dataset(f"{base}/a{side}-{n}", f"{base}/ma{side}-{n}", n, seed + n + side, side=side)
            _, _, seconds[n] = embed(f"{base}/ma{side}-{n}", f"{base}/ca{side}-{n}", family)
        n1, n2 = args.calibrate
        points.append([side * side, round((n2 - n1) / (seconds[n2] - seconds[n1]), 3)])
    rate = {"images": points}
    est, actual = {}, {}
    for n in args.check:
        dataset(f"{base}/b{n}", f"{base}/mb{n}", n, seed + 7 * n, side=args.side)
        job = EmbedJob(manifest=f"{base}/mb{n}", out=f"{base}/cb{n}", family=family, model="default",
                       executor="local")  # fmt: skip
        bill = estimate(EstimateJob(embed=job, gpu="cpu"))  # before the run, as a user would
        buckets = Counter(read_manifest(job.manifest).samples.column("bucket").to_pylist())
        est[n] = device_seconds(rate, buckets, bill.captions, bill.variants)
        _, _, actual[n] = embed(job.manifest, job.out, family)
        run.add(f"{family}: bytes estimated / written ({n} images)", (bill.latent_bytes + bill.text_bytes)
                / written(job.out), "x", target=">= 0.95", note="before gzip; every tensor read back")  # fmt: skip
    m1, m2 = args.check
    marginal = (est[m2] - est[m1]) / (actual[m2] - actual[m1])
    run.add(f"{family}: marginal time estimated / actual ({m1} -> {m2} images of {args.side}²)", marginal, "x",
            note="rates measured at 256² and 512² on other datasets")  # fmt: skip
    run.add(f"{family}: marginal time error, abs(estimated / actual - 1)", abs(marginal - 1), "", target="<= 0.25")
    print(f"{family}: time estimate / actual {marginal:.2f} (estimated {est}, actual {actual}; rate {rate})",
          flush=True)  # fmt: skip
    return rate


if __name__ == "__main__":
    main()
