"""Annotate benchmark: `bucketeer annotate --task caption` end to end against the model alone.

    python benchmarks/annotate.py [--images 64,576] [--batch-size 8] [--max-new-tokens 16] [--model small]
    python benchmarks/annotate.py --tasks embedding,aesthetic,phash,stats [--images 128,1152] [--model small]

``--tasks`` other than ``caption``: the same two sides, where "the model alone" is the tasks' own work
on the images decoded beforehand (``ImageEmbedder``: the CLIP processor, the vision tower, the heads;
``phash`` and ``image_stats`` per image), and the CLIP model is a random-weight
``CLIPVisionModelWithProjection`` built here (``tiny``: the embedded default, 32 wide at 32 px;
``small``: 384 wide, 6 layers, 224 px in 32-px patches, ViT-B/32's geometry at half its width and depth).

In one run, on this machine's CPU, with a random-weight Llava built here (``--model tiny``: the embedded
default, 32 wide; ``small``: 256 wide, 4 layers, 112-pixel vision input, closer to a real captioner's
share of compute per image):
1. end to end (after a warm-up run on a few images): ``run(AnnotateJob(...))`` (manifest pass, fetch,
   decode, generate, parts written, the commit), one CPU actor, which runs two units at a time with
   ``--threads`` torch threads each (``pipeline.annotate.dataflow.units_at_once``), for each of two dataset sizes;
2. the model alone: ``TransformersCaptioner.caption`` (processor + batched greedy ``generate``) on the same
   images decoded beforehand, the same batch size, run as the actor runs it: two batches at a time, in two
   threads of ``--threads`` torch threads each, for the same two sizes.
Within a round the sides go end to end, alone (n1), alone, end to end (n2), so that a load rising or falling
through the round weighs on both; the alone side waits for the job's actor process to exit (``actor_gone``).
Rates are **marginal** over the two sizes ((n2 - n1) / (t2 - t1)), so Ray's start, the model loads and the first
batch drop out; the ratio end-to-end / model alone is the pipeline's efficiency (target >= 0.9). The actor's units
alone (from the first unit's start to the last unit's end, ``AnnotateResult.units_seconds``) are timed too: the
same work without the start-up whose length the load varies most.
Wall-clock on a shared machine: the load average is printed beside the figures. CPU time, which the load changes
less, is measured too: the actor processes' while they ran units (``AnnotateResult.worker_cpu_seconds``, each
process counted once) against this process's around the model alone. Each of ``--rounds`` rounds
(default 3; the datasets, the model and the warm-up made once) measures both sides at both sizes, and every
round's figures go to ``benchmarks/results/annotate.json`` (``--tasks caption``) or ``annotate-vision.json``
(other tasks; ``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.results import Run  # noqa: E402

MODELS = {"tiny": {"width": 32, "layers": 2, "image": 28}, "small": {"width": 256, "layers": 4, "image": 112}}
EMBEDDERS = {"tiny": {"width": 32, "layers": 2, "image": 32, "patch": 8},
             "small": {"width": 384, "layers": 6, "image": 224, "patch": 32}}
AT_ONCE = 2  # units an annotate actor runs at a time (pipeline.annotate.dataflow.units_at_once): the alone sides too


def two_at_once(work, batches: list) -> None:
    """``work(batch)`` for every batch, ``AT_ONCE`` at a time in as many threads, as the actor runs its units."""
    with ThreadPoolExecutor(AT_ONCE) as pool:
        list(pool.map(work, batches))


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


def end_to_end(manifest: str, out: str, model: str, args) -> tuple[float, float, float]:
    """Seconds of one annotate run over the whole manifest, the CPU seconds of its actor's process while it ran
    units, and the seconds from its first unit's start to its last unit's end."""
    from pipeline import AnnotateJob, run

    start = time.perf_counter()
    if args.tasks != ("caption",):
        result = run(AnnotateJob(manifest=manifest, out=out, tasks=args.tasks, embedding_model=model,
                                 batch_size=args.batch_size, unit_rows=args.batch_size * 4, device="cpu", workers=1,
                                 torch_threads=args.threads, image_size=args.image_size))  # fmt: skip
    else:
        result = run(AnnotateJob(manifest=manifest, out=out, model=model, max_new_tokens=args.max_new_tokens,
                                 batch_size=args.batch_size, unit_rows=args.batch_size * 4, device="cpu", workers=1,
                                 torch_threads=args.threads, image_size=args.image_size))  # fmt: skip
    return time.perf_counter() - start, result.worker_cpu_seconds, result.units_seconds or 0.0


def actor_gone(timeout: float = 60.0) -> None:
    """Wait until the job's actor process has exited: it goes after ``run`` returns, and its exit (about a CPU
    second, measured) would otherwise be timed with the alone side that follows."""
    deadline = time.monotonic() + timeout
    while os.path.isdir("/proc") and time.monotonic() < deadline:
        alive = False
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    alive = alive or b"AnnotateWriter" in f.read()
            except OSError:  # gone meanwhile
                continue
        if not alive:
            return
        time.sleep(0.1)


def tasks_alone(root: str, n: int, path: str, args) -> tuple[float, float]:
    """Seconds and CPU seconds of the tasks' own work on ``n`` pre-decoded images, two batches at a time (after the
    model's load and one warm-up batch)."""
    import numpy as np

    from pipeline.annotate.image_stats import image_stats, phash
    from pipeline.annotate.vision import HEAD_TASKS, ImageEmbedder, VisionSpec
    from pipeline.annotate.workers import decode_for_caption

    heads = tuple((t, "default") for t in args.tasks if t in HEAD_TASKS)
    embedder = ImageEmbedder(VisionSpec(model=path, heads=heads), "cpu") if any(
        t in ("embedding", *HEAD_TASKS) for t in args.tasks) else None  # fmt: skip
    names = sorted(os.listdir(root))[:n]
    images = [decode_for_caption(open(os.path.join(root, f), "rb").read(), 320, 256, args.image_size, 1 << 30, f)
              for f in names]  # fmt: skip
    if embedder:
        embedder(images[: args.batch_size])  # warm-up

    def tasks(batch: list) -> None:
        if embedder:
            embedder(batch)
        for im in batch:
            if "phash" in args.tasks:
                phash(im)
            if "stats" in args.tasks:
                image_stats(np.asarray(im))

    start, cpu = time.perf_counter(), time.process_time()
    two_at_once(tasks, [images[at : at + args.batch_size] for at in range(0, len(images), args.batch_size)])
    return time.perf_counter() - start, time.process_time() - cpu


def writer_alone(root: str, manifest: str, n: int, path: str, args) -> float:
    """CPU seconds of ``AnnotateWriter.unit`` (fetch, decode, the tasks, the part written) over ``n`` images in
    this process, one unit at a time, without Ray: the actor's own work."""
    import pyarrow as pa

    from manifests.annotations import image_key
    from manifests.manifest import read_manifest
    from pipeline.annotate.tasks import TaskPlan
    from pipeline.annotate.vision import HEAD_TASKS, VisionSpec
    from pipeline.annotate.workers import UNIT_COLUMNS, AnnotateWriter

    heads = tuple((t, "default") for t in args.tasks if t in HEAD_TASKS)
    plan = TaskPlan(tasks=args.tasks, caption=None, vision=VisionSpec(model=path, heads=heads),
                    image_size=args.image_size)  # fmt: skip
    writer = AnnotateWriter(plan=plan, device="cpu", threads=args.threads, out=f"{root}-writer", storage_options=None,
                            source=root, max_pixels=1 << 30, image_column=None, settings="bench",
                            batch_size=args.batch_size)  # fmt: skip
    rows = read_manifest(manifest).samples
    rows = rows.select([c for c in UNIT_COLUMNS if c in rows.column_names])
    for c in UNIT_COLUMNS:
        if c not in rows.column_names:
            rows = rows.append_column(c, pa.nulls(rows.num_rows))
    rows = rows.select(UNIT_COLUMNS).append_column("source_key", pa.array(image_key(rows), pa.uint64()))
    writer.unit(rows.slice(0, args.batch_size))  # warm-up
    cpu, unit = time.process_time(), args.batch_size * 4
    for at in range(0, n, unit):
        writer.unit(rows.slice(at, unit))
    return time.process_time() - cpu


def model_alone(root: str, n: int, path: str, args) -> tuple[float, float]:
    """Seconds and CPU seconds of captioning ``n`` pre-decoded images with the model alone, two batches at a time
    (after its load and one warm-up batch)."""
    from pipeline.annotate.engines import CaptionSpec, TransformersCaptioner
    from pipeline.annotate.workers import decode_for_caption

    spec = CaptionSpec(model=path, max_new_tokens=args.max_new_tokens, image_size=args.image_size)
    captioner = TransformersCaptioner(spec, "cpu", args.threads)
    names = sorted(os.listdir(root))[:n]
    images = [decode_for_caption(open(os.path.join(root, f), "rb").read(), 320, 256, args.image_size, 1 << 30, f)
              for f in names]  # fmt: skip
    captioner.caption(images[: args.batch_size])  # warm-up
    start, cpu = time.perf_counter(), time.process_time()
    two_at_once(captioner.caption, [images[at : at + args.batch_size] for at in range(0, len(images), args.batch_size)])
    return time.perf_counter() - start, time.process_time() - cpu


def annotate_round(run: Run, args: argparse.Namespace, base: str, model: str, n1: int, n2: int, r: int) -> None:
    """Round ``r``: end to end and alone at both sizes, their marginal rates and ratio added to ``run``."""
    vision = args.tasks != ("caption",)
    e2e, alone, actor_cpu, alone_cpu, writer_cpu, units = {}, {}, {}, {}, {}, {}
    for n in (n1, n2):
        root, manifest = os.path.join(base, f"images-{n}"), os.path.join(base, f"manifest-{n}")

        def job() -> None:
            e2e[n], actor_cpu[n], units[n] = end_to_end(manifest, os.path.join(base, f"out-{n}-{r}"), model, args)
            actor_gone()

        def by_itself() -> None:
            if vision:
                alone[n], alone_cpu[n] = tasks_alone(root, n, model, args)
                writer_cpu[n] = writer_alone(root, manifest, n, model, args)
            else:
                alone[n], alone_cpu[n] = model_alone(root, n, model, args)

        # ABBA (end to end, alone, alone, end to end): a load that rises or falls through the round weighs on both
        for side in (job, by_itself) if n == n1 else (by_itself, job):
            side()
        print(f"round {r + 1}, {n} images: end to end {e2e[n]:.1f}s (units {units[n]:.1f}s, actor CPU "
              f"{actor_cpu[n]:.2f}s), alone "
              f"{alone[n]:.1f}s (CPU {alone_cpu[n]:.2f}s); load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    pipeline_rate = (n2 - n1) / (e2e[n2] - e2e[n1])
    units_rate = (n2 - n1) / (units[n2] - units[n1])
    model_rate = (n2 - n1) / (alone[n2] - alone[n1])
    if vision:
        print(f"tasks {','.join(args.tasks)}, CLIP {args.model} ({EMBEDDERS[args.model]}), batch "
              f"{args.batch_size}, {AT_ONCE} at a time x {args.threads} torch thread(s)")
    else:
        print(f"model {args.model} ({MODELS[args.model]}), batch {args.batch_size}, {args.max_new_tokens} new "
              f"tokens, {AT_ONCE} at a time x {args.threads} torch thread(s)")
    what = "images" if vision else "captions"
    label = "the tasks alone" if vision else "the model alone"
    print(f"marginal {what}/s: end to end {pipeline_rate:.2f}, the actor's units {units_rate:.2f}, {label} "
          f"{model_rate:.2f}: ratios {pipeline_rate / model_rate:.2f} (target >= 0.9), {units_rate / model_rate:.2f}; "
          f"load {os.getloadavg()[0]:.1f}")
    for n in (n1, n2):
        run.add(f"{n} images: end to end", e2e[n], "s")
        run.add(f"{n} images: {label}", alone[n], "s")
    run.add(f"marginal {what}/s, wall clock: end to end", pipeline_rate, f"{what}/s")
    run.add(f"marginal {what}/s, wall clock: the actor's units (first start to last end)", units_rate, f"{what}/s")
    run.add(f"marginal {what}/s, wall clock: {label}", model_rate, f"{what}/s")
    run.add(f"wall clock: end to end / {label}", pipeline_rate / model_rate, "x", ">= 0.9")
    run.add(f"wall clock: the actor's units / {label}", units_rate / model_rate, "x")
    # CPU time: what the load average changes less (the actor's process, every thread, while it ran units)
    worker, own = (n2 - n1) / (actor_cpu[n2] - actor_cpu[n1]), (n2 - n1) / (alone_cpu[n2] - alone_cpu[n1])
    print(f"marginal images per CPU second: the Ray actor's process during its units {worker:.2f} (ratio "
          f"{worker / own:.2f}); {label} {own:.2f}", flush=True)
    run.add("images per CPU second: the Ray actor's whole process during its units", worker, "images/CPU-s")
    run.add(f"images per CPU second: {label}{' on pre-decoded images' if vision else ''}", own, "images/CPU-s")
    run.add(f"CPU: the Ray actor / {label}", worker / own, "x", ">= 0.9")
    if vision:
        unit = (n2 - n1) / (writer_cpu[n2] - writer_cpu[n1])
        print(f"AnnotateWriter.unit without Ray (fetch, decode, tasks, parts) {unit:.2f} images per CPU second "
              f"(ratio {unit / own:.2f})", flush=True)
        run.add("images per CPU second: AnnotateWriter.unit in the driver without Ray (a diagnostic)", unit,
                "images/CPU-s")  # fmt: skip
        run.add("CPU: AnnotateWriter.unit without Ray / the tasks alone", unit / own, "x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", default="64,576", help="the two dataset sizes (marginal rate between them)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=768)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of each unit the actor runs and of each batch alone (two at a time)")
    parser.add_argument("--model", choices=tuple(MODELS), default="small")
    parser.add_argument("--tasks", default="caption", help="annotate's --task (caption, or embedding,phash,...)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    command = "python benchmarks/annotate.py" + "".join(f" {a}" for a in sys.argv[1:])
    args.tasks = tuple(args.tasks.split(","))
    vision = args.tasks != ("caption",)
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
        if vision:
            from pipeline.annotate.vision import build_default_embedder

            model = os.path.join(base, "embedder")
            build_default_embedder(model, **EMBEDDERS[args.model])
        else:
            model = str(build_default_model(os.path.join(base, "model"), **MODELS[args.model]))
        # Ray starts its workers at nice 15 (its worker_niceness), this process runs the alone side at 0: on a shared
        # machine the other processes would then take the actor's CPU first, and the two sides would not compare
        os.environ["RAY_worker_niceness"] = "0"
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
        warm_root, warm_manifest = os.path.join(base, "images-warm"), os.path.join(base, "manifest-warm")
        make_dataset(warm_root, warm_manifest, args.batch_size * 2)  # Ray Data's and the workers' first start
        end_to_end(warm_manifest, os.path.join(base, "out-warm"), model, args)
        for n in (n1, n2):
            make_dataset(os.path.join(base, f"images-{n}"), os.path.join(base, f"manifest-{n}"), n)
        run = Run("annotate-vision" if vision else "annotate", command, ["ray", "transformers"])
        for r in range(args.rounds):
            with run.round():
                annotate_round(run, args, base, model, n1, n2, r)
        run.save()
    finally:
        ray.shutdown()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
