"""Embed a manifest into a cache: VAE latents and text embeddings, gzip'd safetensors records (Ray job).

    bucketeer embed MANIFEST --out CACHE --family sdxl|sd3|flux|pixart --model ID|PATH [--dtype bf16]
    bucketeer embed MANIFEST --out CACHE [--vae ID|PATH] [--text-encoder ID|PATH ...]   # generic encoders
    ray job submit --working-dir . -- python -m pipeline.embed MANIFEST --out s3://bucket/cache --device cuda ...

    from pipeline import EmbedJob, run
    cache = run(EmbedJob(manifest="manifest/", out="cache/", family="sdxl", model="path/to/sdxl-pipeline"))

:class:`EmbedJob` is the options, validated where it is built (:func:`job_from_args` is the one place the
command line becomes one); :func:`run` runs it and returns an :class:`EmbedResult`.

What the cache holds per model family (the text exactly as the family's diffusers pipeline encodes
it, the latents as the VAE's posterior) is :mod:`pipeline.embed.encoders` and
:mod:`pipeline.embed.families`. Besides the captions of the samples, the empty caption (for caption
dropout) and the ``--validation-prompts`` are embedded, and listed in ``_cache.json``
(:mod:`pipeline.embed.prompts`).

The recipe: (1) one streaming pass over the manifest's row groups decides the work against the
committed index (:mod:`pipeline.embed.work`): rows to embed, captions without a text record (each
once, the empty caption and validation prompts among them), a few files to probe the storage
with; (2) a VAE is loaded once on a CPU worker for its description (a bad ``--vae`` fails here,
before any work); (3) the captions pipeline encodes the new captions on text-encoder actors, (4)
the images pipeline fetches, decodes (up to the
manifest's ``max_pixels``) and crops units of one bucket on CPU tasks and encodes them on VAE
actors (:mod:`pipeline.embed.dataflow`, Ray Data). A caption that only one sample has (most
datasets) skips (3): the VAE actor encodes it too, into that sample's record, so the trainer reads
each such sample with one request (:mod:`manifests.cache.layout`); shared captions, the empty
caption and the validation prompts keep one text record each. Workers write the shards; the driver receives
only index rows and commits them (:mod:`pipeline.embed.driver`, :class:`manifests.cache.CacheCommitter`) every
``--commit-seconds`` and at the end of each phase, text records before any sample refers to them,
so a killed job resumes from what was committed. Each phase reports captions/s or images/s, ETA
and MB written (:class:`manifests.progress.Progress`: a bar on a terminal, a line in a Ray job's log).

Encoders run where ``--device`` says (GPU actors are requested as resources: an autoscaler adds GPU
nodes for them); text and VAE phases run one after the other and never wait on each other for a
device. The driver holds no Python object per manifest row: positions per row group, a sorted
array of caption keys, the committed index as a sorted lookup (a few bytes per row).

A rerun embeds what is missing and what **changed**: a row whose source key (size, etag or mtime,
caption, bucket; see :mod:`manifests.cache.freshness`) differs from the one its record was made
from is re-embedded, and the new record supersedes the old; so is a ``read_failed`` error row
(storage did not deliver the bytes that time), while an error row about the image itself (not an
image, truncated, ...) is not retried. Reads retry transient storage errors per file; when none of
a few images spread over the job can be read at all (bucket gone, access denied, endpoint down)
the job stops before loading any model or writing anything. Records of samples no longer in the
manifest stay (plans are drawn from the manifest). Without encoder options the embedded tiny
random-weight defaults are used (see :mod:`pipeline.embed.encoders`): good for trying the
pipeline, useless for training a real model. The summary line and ``_cache.json`` give the bytes
per caption and per sample.

A manifest of pairs (``scan --conditioning``) gets each conditioning image encoded with its image's
exact resize and crop, into the same record (``cond_latent``). ``--flip`` and ``--crops K`` store
variants (K crops, each also mirrored) in the record, recorded in ``_cache.json`` settings
(:mod:`pipeline.embed.settings`); the
trainer picks one per (seed, epoch, sample) (:func:`train.data.variant_choice`).
``--features dinov2`` also stores DINOv2 patch features of every variant's crop in its record, for the
trainer's REPA term (:mod:`pipeline.embed.features`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from manifests.lock import writer_lock
from manifests.cache import SHARD_RECORDS, CacheMeta, EmbedSummary, IndexLookup, index_lookup
from manifests.cache.records import GZIP_BACKEND, RECORD_LAYOUT
from manifests.cache.writer import COMMIT_SECONDS
from manifests.errors import UsageError
from manifests.manifest import read_manifest_meta
from manifests.manifest_meta import ManifestMeta
from manifests.progress import human_bytes
from manifests.throttles import counting_throttles
from manifests.schema import MAX_PIXELS
from manifests.storage import parse_storage_options, redact
from pipeline.embed.clips import MAX_CLIPS, refuse_for_video
from pipeline.embed.dataflow import DEVICES, EXECUTORS
from pipeline.embed.driver import EmbedDriver
from pipeline.embed.loading import LATENTS, STORAGE_DTYPES
from pipeline.embed.families import FAMILIES, qwen_image_edit
from pipeline.embed.prompts import committed_prompts, missing_texts, prompt_texts, read_validation_prompts
from pipeline.embed.settings import check_early, request_settings
from pipeline.ray_setup import init_ray

__all__ = ["EmbedJob", "EmbedResult", "add_arguments", "job_from_args", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", help="manifest folder (local path or URL) written by `bucketeer scan`")
    parser.add_argument("--out", required=True, help="cache folder (local path or URL); resumed if it exists")
    g = parser.add_argument_group("encoders")
    g.add_argument("--family", choices=tuple(FAMILIES), default="generic",
                   help="model family: the cached text equals what its diffusers pipeline computes in encode_prompt "
                        "(docs/embed.md: Model families); generic: the encoders of --vae/--text-encoder, real tokens "
                        "masked, for bucketeer's own trainer")
    g.add_argument("--model", default=None, metavar="ID|PATH",
                   help="diffusers pipeline folder or hub id of --family: VAE and text encoders from its subfolders "
                        "(vae, text_encoder, text_encoder_2, ...); 'default' = a tiny random-weight one")
    g.add_argument("--vae", default=None,
                   help="AutoencoderKL hub id or local folder (replaces --model's); without --family and --model: "
                        "'default', a tiny random-weight VAE for trying the pipeline")
    g.add_argument("--vae-subfolder", default=None, help="subfolder of --vae, e.g. 'vae' for a pipeline repo")
    g.add_argument("--text-encoder", action="append", default=None, metavar="ID|PATH",
                   help="text encoder hub id or folder; repeat for several (order kept; with --family: all of the "
                        "family's, in its order, replacing --model's); default without --family: tiny CLIP")
    g.add_argument("--text-encoder-subfolder", action="append", default=None,
                   help="subfolder per --text-encoder (same order), e.g. text_encoder / text_encoder_2; "
                        "the tokenizer is read from the matching tokenizer* subfolder")
    g.add_argument("--text-layer", choices=("last", "penultimate"), default=None,
                   help="without --family: hidden state stored, last (default) or penultimate; "
                        "a --family takes each encoder's layer as its pipeline does")
    g.add_argument("--max-text-tokens", type=int, default=None, metavar="N",
                   help="T5 sequence length, lower than the family's default (sd3 256, flux 512, pixart 120, "
                        "pixart-sigma 300): T5 at 512 tokens is 4 MB per caption in bf16; without --family: "
                        "the most tokens kept per encoder")
    g.add_argument("--latents", choices=LATENTS, default="mean",
                   help="mean: the VAE posterior mean; posterior: its std too, to sample latents per step in training")
    g.add_argument("--validation-prompts", default=None, metavar="FILE",
                   help="text file (local path or URL), one prompt per line: embedded into the cache and listed "
                        "in _cache.json, so the trainer samples validation images without text encoders")
    g.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="stored tensor dtype")
    g.add_argument("--features", choices=("dinov2",), default=None,
                   help="also store DINOv2 patch features of each variant's crop (float16, beside the latent) for "
                        "the trainer's repa: config (docs/embed.md: REPA)")
    g.add_argument("--features-model", default="default", metavar="ID|PATH",
                   help="the DINOv2 model of --features, e.g. facebook/dinov2-base; 'default': a tiny random one")
    g = parser.add_argument_group("images")
    g.add_argument("--crop", choices=("center", "random"), default="center", help="crop after resize-to-cover")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of --crop random and --crops (per sample: seed + sample id)")
    g.add_argument("--flip", action="store_true",
                   help="also store each crop mirrored left-right as a variant (its crop box mirrored as SDXL "
                        "expects); the trainer picks one variant per (seed, epoch, sample)")
    g.add_argument("--crops", type=int, default=1, metavar="K",
                   help="store K random crops per image as variants, reproducible from --seed and the sample id "
                        "(default 1: the --crop policy's one crop); variants = crops x (2 with --flip)")
    g.add_argument("--source", default=None, help="dataset root, if it moved since the scan (default: the manifest's)")
    g.add_argument("--reference-resolution", type=int, default=None, metavar="N",
                   help="--family qwen-image-edit: the area (N x N) its pipeline resizes each reference image to "
                        "(default 1024, QwenImageEditPipeline's; lower only for trials: its __call__ uses 1024)")
    g.add_argument("--max-clips", type=int, default=MAX_CLIPS, metavar="N",
                   help="video manifests: embed at most N of a video's clips, evenly spaced, each a variant of its "
                        "record (the trainer takes one per epoch); record bytes grow with N (docs/video.md: Embed)")
    g = parser.add_argument_group("job")
    g.add_argument("--storage-options", default=None, help="JSON fsspec options for all URLs, e.g. an endpoint_url")
    g.add_argument("--batch-size", type=int, default=16, help="images per VAE forward pass (one bucket each)")
    g.add_argument("--text-batch-size", type=int, default=128, help="captions per text-encoder forward pass")
    g.add_argument("--shard-records", type=int, default=SHARD_RECORDS,
                   help="most sample records per shard object (fewer for large buckets: a unit's pixels stay "
                        "near 128 MB)")
    g.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the encoders run: cuda (one GPU per encoder actor, requested from Ray: the job waits "
                        "for GPU nodes), cpu, or auto: cuda when the cluster has GPUs or its autoscaler reports it "
                        "can add some, else cpu")
    g.add_argument("--vae-workers", type=int, default=None,
                   help="most encoder actors per phase (text, then VAE) (default: one per GPU the cluster has or "
                        "can add, or 1 on CPU)")
    g.add_argument("--torch-threads", type=int, default=None,
                   help="torch threads per CPU encoder actor (default: half the CPUs of a node)")
    g.add_argument("--commit-seconds", type=float, default=COMMIT_SECONDS,
                   help="seconds between commits of finished work to _cache.json: what a killed job loses at most")
    g.add_argument("--executor", choices=EXECUTORS, default="ray",
                   help="ray: Ray Data on the cluster (or a local Ray started here); local: everything in this "
                        "process without Ray, one device, decoding on threads (a GPU box without Ray)")
    g.add_argument("--ray-address", default=None, help="Ray cluster address (default: start Ray on this machine)")


@dataclass(frozen=True, kw_only=True)
class EmbedJob:
    """One ``bucketeer embed``: the options of :func:`add_arguments` (same names, same defaults; the
    repeatable ``--text-encoder``/``--text-encoder-subfolder`` are the tuples ``text_encoders``/
    ``text_encoder_subfolders``), ``storage_options`` already parsed. Raises UsageError when built
    with a bad combination, naming the option to change."""

    manifest: str
    out: str
    family: str = "generic"
    model: str | None = None
    vae: str | None = None
    vae_subfolder: str | None = None
    text_encoders: tuple[str, ...] | None = None
    text_encoder_subfolders: tuple[str | None, ...] | None = None
    text_layer: str | None = None  # last | penultimate
    max_text_tokens: int | None = None
    latents: str = "mean"  # mean | posterior
    validation_prompts: str | None = None  # a file, one prompt a line
    dtype: str = "bf16"  # bf16 | fp16 | fp32
    features: str | None = None  # dinov2: DINOv2 patch features in every record (REPA)
    features_model: str = "default"
    crop: str = "center"  # center | random
    seed: int = 0
    flip: bool = False
    crops: int = 1
    max_clips: int = MAX_CLIPS  # video manifests: clips per video, evenly spaced, one variant each
    reference_resolution: int | None = None  # a reference family's reference area, squared (None: its pipeline's)
    source: str | None = None  # dataset root, if it moved since the scan
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    batch_size: int = 16
    text_batch_size: int = 128
    shard_records: int = SHARD_RECORDS
    device: str = "auto"  # auto | cuda | cpu
    vae_workers: int | None = None
    torch_threads: int | None = None
    commit_seconds: float = COMMIT_SECONDS
    executor: str = "ray"  # ray | local (pipeline.embed.local: this process, no Ray)
    ray_address: str | None = None

    def __post_init__(self) -> None:
        choices = (("--family", self.family, tuple(FAMILIES)), ("--latents", self.latents, LATENTS),
                   ("--executor", self.executor, EXECUTORS),
                   ("--dtype", self.dtype, tuple(STORAGE_DTYPES)), ("--device", self.device, DEVICES),
                   ("--crop", self.crop, ("center", "random")),
                   ("--text-layer", self.text_layer, (None, "last", "penultimate")))  # fmt: skip
        for option, value, allowed in choices:
            if value not in allowed:
                raise UsageError(f"{option} {value!r}: choose one of {', '.join(c for c in allowed if c)}")
        if self.batch_size < 1 or self.shard_records < 1 or self.text_batch_size < 1:
            raise UsageError("--batch-size, --text-batch-size and --shard-records must be >= 1")
        if self.commit_seconds < 0 or (self.vae_workers is not None and self.vae_workers < 1):
            raise UsageError("--commit-seconds must be >= 0 and --vae-workers >= 1")
        for option, value in (("--crops", self.crops), ("--max-clips", self.max_clips)):
            if value < 1:
                raise UsageError(f"{option} must be >= 1, got {value}")
        if self.features not in (None, "dinov2"):
            raise UsageError(f"--features {self.features!r}: choose dinov2")
        if self.executor == "local" and (self.ray_address is not None or (self.vae_workers or 1) > 1):
            raise UsageError("--executor local runs in this process on one device: drop --ray-address and "
                             "--vae-workers, or use --executor ray")  # fmt: skip
        qwen_image_edit.check_options(self)  # what a text that needs each sample's reference image cannot take
        if (self.crops > 1 or self.flip) and self.latents == "posterior":
            raise UsageError("--latents posterior stores one posterior std per sample, not per --flip/--crops "
                             "variant; use one or the other")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class EmbedResult:
    """What a run did. ``meta``: the cache's ``_cache.json`` as committed at the end (the existing one
    when there was nothing to embed, ``up_to_date``); ``fingerprint``: its settings' fingerprint.
    Rates are None when the phase did not run."""

    url: str
    fingerprint: str
    meta: CacheMeta
    seconds: float
    up_to_date: bool = False
    embedded: int = 0
    errors: int = 0
    skipped: int = 0
    changed: int = 0
    retried: int = 0
    new_captions: int = 0
    shards: int = 0
    texts_per_second: float | None = None
    images_per_second: float | None = None  # steady state (start-up and model loading excluded)


def job_from_args(args: argparse.Namespace) -> EmbedJob:
    """The :class:`EmbedJob` of parsed ``bucketeer embed`` options (UsageError for a bad combination)."""
    tuple_or_none = lambda values: None if values is None else tuple(values)  # noqa: E731
    return EmbedJob(
        manifest=args.manifest, out=args.out, family=args.family, model=args.model, vae=args.vae,
        vae_subfolder=args.vae_subfolder, text_encoders=tuple_or_none(args.text_encoder),
        text_encoder_subfolders=tuple_or_none(args.text_encoder_subfolder), text_layer=args.text_layer,
        max_text_tokens=args.max_text_tokens, latents=args.latents, validation_prompts=args.validation_prompts,
        dtype=args.dtype, features=args.features, features_model=args.features_model, crop=args.crop, seed=args.seed,
        flip=args.flip, crops=args.crops, max_clips=args.max_clips, reference_resolution=args.reference_resolution,
        source=args.source,
        storage_options=parse_storage_options(args.storage_options), batch_size=args.batch_size,
        text_batch_size=args.text_batch_size, shard_records=args.shard_records, device=args.device,
        vae_workers=args.vae_workers, torch_threads=args.torch_threads, commit_seconds=args.commit_seconds,
        executor=args.executor, ray_address=args.ray_address,
    )  # fmt: skip


def _specs(job: EmbedJob):
    """The encoder specs (:class:`~pipeline.embed.latents.LatentSpec`, ``TextSpec``) the options ask for."""
    from pipeline.embed.encoders import encoder_specs

    from pipeline.embed.features import FeatureSpec

    home = os.environ.get("BUCKETEER_HOME")
    latent, text = encoder_specs(family=job.family, model=job.model, vae=job.vae, vae_subfolder=job.vae_subfolder,
                                 text_encoders=None if job.text_encoders is None else list(job.text_encoders),
                                 text_subfolders=None if job.text_encoder_subfolders is None
                                 else list(job.text_encoder_subfolders),
                                 max_tokens=job.max_text_tokens, layer=job.text_layer, latents=job.latents,
                                 home=home)  # fmt: skip
    if job.features:  # run on the VAE's worker, on the same pixels
        latent = dataclasses.replace(latent, features=FeatureSpec(job.features, job.features_model, home))
    return latent, text


def request_settings_of(job: EmbedJob, manifest: ManifestMeta) -> dict[str, Any]:
    latent, text = _specs(job)
    return request_settings(latent, text, dtype=STORAGE_DTYPES[job.dtype], bucket_spec=manifest.bucket_spec.to_json(),
                            crop=job.crop, seed=job.seed, crops=job.crops, flip=job.flip,
                            conditioning=manifest.conditioning is not None, masks=manifest.masks is not None,
                            max_clips=job.max_clips if manifest.frame_ladder is not None else None,
                            reference=qwen_image_edit.reference_area(job))  # fmt: skip


def _factories(job: EmbedJob, dtype: str):
    """The encoders as picklable ``(use_gpu=bool) -> Encoder`` factories (the specs' ``load``): what
    the workers build."""
    latent, text = _specs(job)
    return functools.partial(latent.load, dtype=dtype), functools.partial(text.load, dtype=dtype)


def image_column(manifest: ManifestMeta) -> str | None:
    """The column of image bytes of a parquet-sourced manifest (``scan --format parquet``), else None."""
    return manifest.summary.image_column if manifest.summary.source_format == "parquet" else None


def _image_options(job: EmbedJob, manifest: ManifestMeta, source: str) -> dict[str, Any]:
    """What the image workers take (:func:`pipeline.embed.dataflow.image_pipeline`)."""
    return {"batch_size": job.batch_size, "shard_records": job.shard_records, "crop": job.crop, "seed": job.seed,
            "crops": job.crops, "flip": job.flip, "conditioning": _conditioning_root(manifest, source),
            "max_pixels": int(manifest.max_pixels or MAX_PIXELS), "text_batch_size": job.text_batch_size,
            "image_column": image_column(manifest), "reference": qwen_image_edit.reference_area(job),
            "max_clips": job.max_clips if manifest.frame_ladder is not None else None}  # fmt: skip


def run(job: EmbedJob) -> EmbedResult:
    """Embed what ``job.manifest`` has and ``job.out`` lacks (or holds stale); prints what ``bucketeer
    embed`` prints. Raises UsageError (CacheError: a cache of other settings; WriterBusyError: another
    embed writes ``out``) for what the user must fix."""
    with writer_lock(job.out, job.storage_options, "embed"), counting_throttles():
        return _embed(job)


def decide_work(job: EmbedJob, manifest: ManifestMeta, request: dict[str, Any]):
    """``(committed meta or None, work, prompts, validation prompts)``: what a run of ``job`` embeds, decided by one
    look at ``--out``'s committed index (UsageError/CacheError where its settings differ from ``request``). Stale
    rows (changed image bytes, caption or bucket since they were embedded), read failures and missing ones are
    embedded; fresh records and error rows about the image itself stay. ``bucketeer estimate`` prices this work."""
    from pipeline.embed.work import find_work

    so = dict(job.storage_options)
    reference = FAMILIES[job.family].reference  # its text: of each sample's instruction and reference image
    committed = check_early(job.out, so, request)
    lookup, done_texts = index_lookup(job.out, so, committed) if committed else (IndexLookup.empty(), [])
    # besides the captions: the empty caption (caption dropout) and the validation prompts, once each;
    # a caption equal to one of them is encoded as that one, not twice
    validation = committed_prompts(committed) if job.validation_prompts is None else \
        read_validation_prompts(job.validation_prompts, so)  # fmt: skip
    # a reference family has no text of a caption alone: not even the empty caption's
    prompts = {} if reference else missing_texts(prompt_texts(validation), done_texts)
    done_texts = np.concatenate([np.asarray(done_texts, np.uint64), np.fromiter(prompts, np.uint64, len(prompts))])
    work = find_work(job.manifest, manifest, so, lookup, done_texts, per_sample_text=job.family if reference else None)
    return committed, work, prompts, validation


def _embed(job: EmbedJob) -> EmbedResult:
    from pipeline.embed.encoders import DEFAULT_NOTICE
    from pipeline.embed.workers import check_source, describe_encoder

    so = dict(job.storage_options)
    manifest = read_manifest_meta(job.manifest, so)
    if manifest.frame_ladder is not None:
        refuse_for_video(job, manifest)
    source = job.source or manifest.source
    request = request_settings_of(job, manifest)
    start = time.time()
    committed, work, prompts, validation = decide_work(job, manifest, request)
    if not work.todo and not prompts and validation == committed_prompts(committed):
        print(f"bucketeer embed: {redact(job.out)} already holds every sample of the manifest, all up to date; "
              "nothing to embed")  # fmt: skip
        return EmbedResult(url=job.out, fingerprint=committed.fingerprint, meta=committed, up_to_date=True,
                           seconds=round(time.time() - start, 2), skipped=work.samples)  # fmt: skip
    # a bucket that is gone or denied would otherwise cost a model load and an error row per sample
    check_source(source, so, work.probe, image_column=image_column(manifest))
    latent_spec, text_spec = _specs(job)
    if latent_spec.source.is_default or any(t.is_default for t in text_spec.sources):
        print(DEFAULT_NOTICE, file=sys.stderr, flush=True)

    make_vae, make_text = _factories(job, STORAGE_DTYPES[job.dtype])
    t0 = time.time()
    if job.executor == "local":
        from pipeline.embed.local import local_placement

        placement = local_placement(job.device, job.torch_threads)
        vae = describe_encoder(make_vae)
    else:
        ray, _ = init_ray(job.ray_address)  # a CLI process: Ray stops when it exits
        from pipeline.embed.dataflow import configure_ray_data, place_encoders

        configure_ray_data()
        placement = place_encoders(ray, job.device, job.vae_workers, job.torch_threads)
        t0 = time.time()
        vae = describe_encoder(make_vae, ray)
    if (manifest.frame_ladder is not None) != (vae.get("temporal_factor") is not None):  # a --vae of the other kind
        raise UsageError(f"bucketeer embed {redact(job.manifest)}: a {'video' if manifest.frame_ladder else 'n image'} "
                         f"manifest and a {vae['class']} VAE: scan --frames for video VAEs, --family wan for clips")
    embed = EmbedDriver(job.manifest, job.out, so, request, committed, vae, placement, validation, job.commit_seconds)
    counts, new_captions = work.counts, work.new_captions + work.inline_captions + len(prompts)
    print(f"bucketeer embed: {work.samples} samples in the manifest, {counts['fresh'] + counts['failed']} already "
          f"cached, {counts['stale']} changed since embedded (re-embedding), {counts['retry']} read failures "
          f"(retrying), {counts['missing']} new: {work.todo} to embed; {new_captions} new captions; "
          f"{placement.summary()}; records {RECORD_LAYOUT}, read back via {GZIP_BACKEND}", flush=True)  # fmt: skip
    embed.mark_visible()
    text_start = time.time()
    embed.captions(work, prompts, make_text, job.text_batch_size)
    text_seconds = time.time() - text_start
    if work.todo:
        embed.images(work, source, make_vae, _image_options(job, manifest, source), make_text)
    seconds, image_seconds = time.time() - t0, embed.steady_seconds
    summary = EmbedSummary(
        embedded=embed.embedded, errors=embed.errors, skipped=work.samples - work.todo, changed=counts["stale"],
        retried=counts["retry"], new_captions=new_captions,
        # this run's records, compressed: what a caption and a sample cost in this cache
        bytes_per_caption=embed.bytes_per("texts"), bytes_per_sample=embed.bytes_per("samples"),
        seconds=round(seconds, 2),
        # steady state: from the first image result to the last (start-up and model loading
        # excluded); with fewer than 3 results (units), the whole image phase
        image_seconds=round(image_seconds, 2),
        images_per_second=round(embed.steady_images / image_seconds, 2) if image_seconds else None,
        device=placement.device, encoder_nodes=len(embed.nodes), shards=embed.shards, redone=embed.committer.redone,
        throttled=embed.throttles.total,  # storage answers that asked for fewer requests, every process's
    )  # fmt: skip
    meta = embed.committer.finish(manifest.fingerprint, summary)
    embed.unmark_visible()
    print(f"bucketeer embed: {embed.embedded} embedded, {embed.errors} error rows, {counts['stale']} changed, "
          f"{counts['retry']} retried, {summary.skipped} skipped in {seconds:.1f}s -> {redact(job.out)} "
          f"({meta.counts.samples} samples, {meta.counts.texts} captions; {embed.shards} shards "
          f"written; {human_bytes(meta.bytes.per_sample)} per sample, {human_bytes(meta.bytes.per_caption)} per "
          f"caption){f'; storage throttled {summary.throttled:,} requests (retried)' if summary.throttled else ''}",
          flush=True)  # fmt: skip
    return EmbedResult(url=job.out, fingerprint=meta.fingerprint, meta=meta, seconds=summary.seconds,
                       embedded=embed.embedded, errors=embed.errors, skipped=summary.skipped, changed=counts["stale"],
                       retried=counts["retry"], new_captions=new_captions, shards=embed.shards,
                       texts_per_second=round(new_captions / text_seconds, 2) if new_captions and text_seconds
                       else None, images_per_second=summary.images_per_second)  # fmt: skip


def _conditioning_root(manifest: ManifestMeta, source: str) -> str | None:
    """Where the manifest's ``conditioning`` paths are: its conditioning root, or (a --captions column)
    the source root, ``--source`` when the dataset moved. None for a manifest without pairs."""
    pairing = manifest.conditioning
    if pairing is None:
        return None
    return source if pairing.column else pairing.root
