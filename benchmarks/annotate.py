"""Annotate benchmark: `bucketeer annotate --task caption` end to end against the model alone.

    python benchmarks/annotate.py [--images 64,256] [--batch-size 8] [--max-new-tokens 16] [--model small]

In one run, on this machine's CPU, with a random-weight Llava built here (``--model tiny``: the embedded
default, 32 wide; ``small``: 256 wide, 4 layers, 112-pixel vision input, closer to a real captioner's
share of compute per image):
1. end to end (after a warm-up run on a few images): ``run(AnnotateJob(...))`` (manifest pass, fetch,
   decode, generate, parts written, the commit), one CPU actor with ``--threads`` torch threads, for each
   of two dataset sizes;
2. the model alone: ``TransformersCaptioner.caption`` (processor + batched greedy ``generate``) on the same
   images decoded beforehand, the same batch size and threads, for the same two sizes.
Rates are **marginal** over the two sizes ((n2 - n1) / (t2 - t1)), so Ray's start, the model loads and
the first batch drop out; the ratio end-to-end / model alone is the pipeline's efficiency (target >= 0.9).
Wall-clock on a shared machine: the load average is printed beside the figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MODELS = {"tiny": {"width": 32, "layers": 2, "image": 28}, "small": {"width": 256, "layers": 4, "image": 112}}


def make_dataset(root: str, manifest: str, n: int) -> None:
    import pyarrow as pa
    from PIL import Image

    from manifests.buckets import BucketSpec
    from manifests.manifest import apply_buckets, write_manifest
    from manifests.schema import ERRORS_SCHEMA, sample_ids

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    w, h = 320, 256
    yy, xx = np.mgrid[0:h, 0:w]
    names = []
    for i in range(n):
        base = np.stack([(xx * (i % 7 + 1)) % 256, (yy * (i % 5 + 1)) % 256, (xx + yy + 17 * i) % 256], -1)
        img = np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)
        name = f"img_{i:05d}.jpg"
        Image.fromarray(img).save(os.path.join(root, name), quality=90)
        names.append(name)
    sizes = [os.path.getsize(os.path.join(root, n_)) for n_ in names]
    table = pa.table({"sample_id": pa.array(sample_ids(names), pa.uint64()), "filename": names,
                      "width": pa.array([w] * n, pa.int32()), "height": pa.array([h] * n, pa.int32()),
                      "caption": [None] * n, "size": pa.array(sizes, pa.int64())})  # fmt: skip
    spec = BucketSpec(buckets=((256, 256),))
    samples, _ = apply_buckets(table, spec)
    write_manifest(manifest, samples, ERRORS_SCHEMA.empty_table(), source=root, spec=spec)


def end_to_end(manifest: str, out: str, model: str, args) -> tuple[float, float]:
    """Seconds of one annotate run over the whole manifest, and its own steady-state images/s."""
    from pipeline import AnnotateJob, run

    start = time.perf_counter()
    result = run(AnnotateJob(manifest=manifest, out=out, model=model, max_new_tokens=args.max_new_tokens,
                             batch_size=args.batch_size, unit_rows=args.batch_size * 4, device="cpu", workers=1,
                             torch_threads=args.threads, image_size=args.image_size))  # fmt: skip
    return time.perf_counter() - start, result.images_per_second or 0.0


def model_alone(root: str, n: int, path: str, args) -> float:
    """Seconds of captioning ``n`` pre-decoded images with the model alone (after its load and one warm-up batch)."""
    from pipeline.annotate.engines import CaptionSpec, TransformersCaptioner
    from pipeline.annotate.workers import decode_for_caption

    spec = CaptionSpec(model=path, max_new_tokens=args.max_new_tokens, image_size=args.image_size)
    captioner = TransformersCaptioner(spec, "cpu", args.threads)
    names = sorted(os.listdir(root))[:n]
    images = [decode_for_caption(open(os.path.join(root, f), "rb").read(), 320, 256, args.image_size, 1 << 30, f)
              for f in names]  # fmt: skip
    captioner.caption(images[: args.batch_size])  # warm-up
    start = time.perf_counter()
    for at in range(0, len(images), args.batch_size):
        captioner.caption(images[at : at + args.batch_size])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", default="64,256", help="the two dataset sizes (marginal rate between them)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=768)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--model", choices=tuple(MODELS), default="small")
    args = parser.parse_args()
    n1, n2 = (int(x) for x in args.images.split(","))
    from pipeline.ray_setup import loopback_only

    loopback_only()
    import ray
    import torch

    from pipeline.annotate.default_model import build_default_model

    torch.set_num_threads(args.threads)
    base = tempfile.mkdtemp(prefix="bucketeer-annotate-bench-")
    os.environ.setdefault("BUCKETEER_HOME", os.path.join(base, "home"))
    try:
        model = str(build_default_model(os.path.join(base, "model"), **MODELS[args.model]))
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
        e2e, alone, steady = {}, {}, {}
        warm_root, warm_manifest = os.path.join(base, "images-warm"), os.path.join(base, "manifest-warm")
        make_dataset(warm_root, warm_manifest, args.batch_size * 2)  # Ray Data's and the workers' first start
        end_to_end(warm_manifest, os.path.join(base, "out-warm"), model, args)
        for n in (n1, n2):
            root, manifest = os.path.join(base, f"images-{n}"), os.path.join(base, f"manifest-{n}")
            make_dataset(root, manifest, n)
            e2e[n], steady[n] = end_to_end(manifest, os.path.join(base, f"out-{n}"), model, args)
            alone[n] = model_alone(root, n, model, args)
            print(f"{n} images: end to end {e2e[n]:.1f}s (its steady state {steady[n]:.2f} images/s), "
                  f"model alone {alone[n]:.1f}s; load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        pipeline_rate = (n2 - n1) / (e2e[n2] - e2e[n1])
        model_rate = (n2 - n1) / (alone[n2] - alone[n1])
        print(f"model {args.model} ({MODELS[args.model]}), batch {args.batch_size}, {args.max_new_tokens} new "
              f"tokens, {args.threads} torch thread(s)")
        print(f"marginal captions/s: end to end {pipeline_rate:.2f}, model alone {model_rate:.2f}: "
              f"ratio {pipeline_rate / model_rate:.2f} (target >= 0.9); load {os.getloadavg()[0]:.1f}")
    finally:
        ray.shutdown()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
