"""Embed a manifest into a cache: VAE latents and text embeddings, gzip'd safetensors records (Ray job).

    bucketeer embed MANIFEST --out CACHE --family sdxl|sd3|flux|pixart --model ID|PATH [--dtype bf16]
    bucketeer embed MANIFEST --out CACHE [--vae ID|PATH] [--text-encoder ID|PATH ...]   # generic encoders
    ray job submit --working-dir . -- python -m pipeline.embed MANIFEST --out s3://bucket/cache --device cuda ...

    from pipeline import EmbedJob, run
    cache = run(EmbedJob(manifest="manifest/", out="cache/", family="sdxl", model="path/to/sdxl-pipeline"))

:class:`EmbedJob` is the options (:mod:`pipeline.embed.options`), validated where it is built
(:func:`job_from_args` is the one place the command line becomes one); :func:`run` runs it and returns an
:class:`EmbedResult`.

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

import dataclasses
import functools
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from manifests.lock import writer_lock
from manifests.cache import CacheMeta, EmbedSummary, IndexLookup, index_lookup
from manifests.cache.records import GZIP_BACKEND, RECORD_LAYOUT
from manifests.errors import UsageError
from manifests.manifest import read_manifest_meta
from manifests.manifest_meta import ManifestMeta
from manifests.progress import human_bytes
from manifests.throttles import counting_throttles
from manifests.schema import MAX_PIXELS
from manifests.storage import redact
from pipeline.embed.clips import refuse_for_video
from pipeline.embed.driver import EmbedDriver
from pipeline.embed.loading import STORAGE_DTYPES
from pipeline.embed.families import FAMILIES, qwen_image_edit
from pipeline.embed.options import EmbedJob, add_arguments, job_from_args
from pipeline.embed.prompts import committed_prompts, missing_texts, prompt_texts, read_validation_prompts
from pipeline.embed.settings import check_early, request_settings
from pipeline.ray_setup import init_ray

__all__ = ["EmbedJob", "EmbedResult", "add_arguments", "job_from_args", "run"]


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
    reused_samples: int = 0  # records copied from --reuse caches (of ``embedded``, ``new_captions``), not encoded
    reused_texts: int = 0
    refused: int = 0  # records found in a --reuse cache that failed a check, encoded instead
    texts_per_second: float | None = None
    images_per_second: float | None = None  # steady state (start-up and model loading excluded)


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
    return dataclasses.replace(latent, compile=job.compile_vae), text  # how it runs: not in the settings


def request_settings_of(job: EmbedJob, manifest: ManifestMeta) -> dict[str, Any]:
    latent, text = _specs(job)
    return request_settings(latent, text, dtype=STORAGE_DTYPES[job.dtype], bucket_spec=manifest.bucket_spec.to_json(),
                            crop=job.crop, seed=job.seed, crops=job.crops, flip=job.flip,
                            conditioning=manifest.conditioning is not None, masks=manifest.masks is not None,
                            max_clips=job.max_clips if manifest.frame_ladder is not None else None,
                            reference=qwen_image_edit.reference_area(job),
                            compact=None if job.text_dtype == "exact" else job.text_dtype)  # fmt: skip


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
            "max_clips": job.max_clips if manifest.frame_ladder is not None else None,
            "compact": None if job.text_dtype == "exact" else job.text_dtype}  # fmt: skip


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
    reuse = _reuse(job, request, vae) if job.reuse else None
    embed = EmbedDriver(job.manifest, job.out, so, request, committed, vae, placement, validation, job.commit_seconds,
                        reuse)  # fmt: skip
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
        embed.images(work, source, make_vae, {**_image_options(job, manifest, source), "reuse": reuse}, make_text)
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
        **({"reused_samples": embed.taken["samples"], "reused_texts": embed.taken["texts"],
            "refused": embed.taken["refused"], "reused_from": tuple(redact(u) for u in job.reuse)}
           if job.reuse else {}),
    )  # fmt: skip
    meta = embed.committer.finish(manifest.fingerprint, summary)
    embed.unmark_visible()
    print(f"bucketeer embed: {embed.embedded} embedded, {embed.errors} error rows, {counts['stale']} changed, "
          f"{counts['retry']} retried, {summary.skipped} skipped in {seconds:.1f}s -> {redact(job.out)} "
          f"({meta.counts.samples} samples, {meta.counts.texts} captions; {embed.shards} shards "
          f"written; {human_bytes(meta.bytes.per_sample)} per sample, {human_bytes(meta.bytes.per_caption)} per "
          f"caption){f'; storage throttled {summary.throttled:,} requests (retried)' if summary.throttled else ''}",
          flush=True)  # fmt: skip
    if job.reuse:
        taken = embed.taken
        refused = f"; {taken['refused']} records found failed a check and were encoded" if taken["refused"] else ""
        print(f"bucketeer embed: --reuse: {taken['samples']} sample records and {taken['texts']} text records taken "
              f"from {', '.join(redact(u) for u in job.reuse)}; {embed.embedded - taken['samples']} images and "
              f"{new_captions - taken['texts']} captions encoded{refused}", flush=True)  # fmt: skip
    return EmbedResult(url=job.out, fingerprint=meta.fingerprint, meta=meta, seconds=summary.seconds,
                       embedded=embed.embedded, errors=embed.errors, skipped=summary.skipped, changed=counts["stale"],
                       retried=counts["retry"], new_captions=new_captions, shards=embed.shards,
                       texts_per_second=round(new_captions / text_seconds, 2) if new_captions and text_seconds
                       else None, images_per_second=summary.images_per_second, reused_samples=embed.taken["samples"],
                       reused_texts=embed.taken["texts"], refused=embed.taken["refused"])  # fmt: skip


def _reuse(job: EmbedJob, request: dict[str, Any], vae: dict[str, Any]):
    """The :class:`~pipeline.embed.reuse.ReuseTable` of ``--reuse``, each cache's part said in one line."""
    from pipeline.embed.reuse import build_reuse
    from pipeline.embed.settings import vae_settings

    reuse, sources = build_reuse(job.reuse, dict(job.storage_options), vae_settings(request, vae), request,
                                 FAMILIES[job.family].reference)  # fmt: skip
    for source in sources:
        takes = [what for what, ok in (("latents", source.latents), ("text records", source.texts)) if ok]
        why = f" ({'; '.join(source.why_not[:3])})" if source.why_not else ""
        print(f"bucketeer embed: --reuse {redact(source.url)}: "
              f"{'takes its ' + ' and '.join(takes) if takes else 'takes nothing'}{why}", flush=True)  # fmt: skip
    print(f"bucketeer embed: --reuse: {reuse.latents:,} sample records and {reuse.texts:,} text records to take "
          "where this run's images and captions match", flush=True)  # fmt: skip
    return reuse


def _conditioning_root(manifest: ManifestMeta, source: str) -> str | None:
    """Where the manifest's ``conditioning`` paths are: its conditioning root, or (a --captions column)
    the source root, ``--source`` when the dataset moved. None for a manifest without pairs."""
    pairing = manifest.conditioning
    if pairing is None:
        return None
    return source if pairing.column else pairing.root
