"""Embed a manifest into a cache: VAE latents and text embeddings, gzip'd safetensors records (Ray job).

    bucketeer embed MANIFEST --out CACHE --family sdxl|sd3|flux|pixart --model ID|PATH [--dtype bf16]
    bucketeer embed MANIFEST --out CACHE [--vae ID|PATH] [--text-encoder ID|PATH ...]   # generic encoders
    ray job submit --working-dir . -- python -m pipeline.embed MANIFEST --out s3://bucket/cache ...

What the cache holds per model family (the text exactly as the family's diffusers pipeline encodes
it, the latents as the VAE's posterior) is :mod:`pipeline.embed.encoders` and
:mod:`pipeline.embed.families`. Besides the captions of the samples, the empty caption (for caption
dropout) and the ``--validation-prompts`` are embedded, and listed in ``_cache.json``
(:mod:`pipeline.embed.prompts`).

Phases: (1) every unique caption not yet cached is encoded once by a text-encoder actor; (2) the
samples the cache lacks or holds stale are grouped by bucket into batches; CPU tasks fetch,
decode (up to the manifest's ``max_pixels``, the limit its scan accepted images under) and crop a
batch while VAE actors (``num_gpus=1`` each when the cluster has GPUs, else one
CPU actor) encode earlier ones. The driver packs records into shards and commits ``_cache.json``
after each shard, so a killed job resumes where the last commit left off. Each phase reports its
progress (captions/s; images/s and MB written) through :class:`manifests.progress.Progress`: a bar
on a terminal, a plain line in a Ray job's log. A rerun embeds what is missing and what
**changed**: a row whose source key (size, etag or mtime, caption, bucket; see
:mod:`manifests.cache.freshness`) differs from the one its record was made from is re-embedded,
and the new record supersedes the old; so is a ``read_failed`` error row (storage did not deliver
the bytes that time), while an error row about the image itself (not an image, truncated, ...)
is not retried. Reads retry transient storage errors per file; when none of a few images spread
over the job can be read at all (bucket gone, access denied, endpoint down) the job stops before
loading any model or writing anything. Records of samples no longer in the manifest stay (plans
are drawn from the manifest). Without encoder options the embedded tiny random-weight defaults
are used (see :mod:`pipeline.embed.encoders`): good for trying the pipeline, useless for training a
real model. The summary line and ``_cache.json`` give the bytes per caption and per sample.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from typing import Any

import numpy as np

from manifests.cache import (
    CACHE_FORMAT_VERSION,
    SHARD_RECORDS,
    CacheError,
    CacheMissingError,
    CacheWriter,
    Freshness,
    cache_freshness,
    read_cache_meta,
    read_index,
    settings_diff,
    source_key,
)
from manifests.cache.records import GZIP_BACKEND, caption_key
from manifests.errors import BucketeerError, UsageError
from manifests.progress import Progress
from manifests.storage import parse_storage_options, public_options, redact
from pipeline.embed.encoders import LATENTS
from pipeline.embed.families import FAMILIES
from pipeline.embed.prompts import committed_prompts, missing_texts, prompt_texts, read_validation_prompts
from pipeline.ray_setup import init_ray


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", help="manifest folder (local path or URL) written by `bucketeer scan`")
    parser.add_argument("--out", required=True, help="cache folder (local path or URL); resumed if it exists")
    g = parser.add_argument_group("encoders")
    g.add_argument("--family", choices=tuple(FAMILIES), default="generic",
                   help="model family: the cached text equals what its diffusers pipeline computes in encode_prompt "
                        "(README: Model families); generic: the encoders of --vae/--text-encoder, real tokens "
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
    g = parser.add_argument_group("images")
    g.add_argument("--crop", choices=("center", "random"), default="center", help="crop after resize-to-cover")
    g.add_argument("--seed", type=int, default=0, help="seed of --crop random (per sample: seed + sample id)")
    g.add_argument("--source", default=None, help="dataset root, if it moved since the scan (default: the manifest's)")
    g = parser.add_argument_group("job")
    g.add_argument("--storage-options", default=None, help="JSON fsspec options for all URLs, e.g. an endpoint_url")
    g.add_argument("--batch-size", type=int, default=16, help="images per VAE forward pass (one bucket each)")
    g.add_argument("--text-batch-size", type=int, default=128, help="captions per text-encoder forward pass")
    g.add_argument("--shard-records", type=int, default=SHARD_RECORDS, help="records per shard object")
    g.add_argument("--vae-workers", type=int, default=None, help="VAE actors (default: one per GPU, or 1 on CPU)")
    g.add_argument("--torch-threads", type=int, default=None, help="torch threads per CPU actor (default: CPUs/2)")
    g.add_argument("--ray-address", default=None, help="Ray cluster address (default: start Ray on this machine)")


def _actor_get(ray, refs):
    """``ray.get`` of encoder actors' ``describe()``: an encoder that fails to load (a bad path, a
    missing subfolder: a UsageError; a file ``from_pretrained`` cannot find or fetch: an OSError)
    is reported in one line, not as a task traceback. Other errors (bugs) keep theirs."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, (BucketeerError, OSError)):
            raise UsageError(f"an encoder failed to load: {e.cause}") from None
        raise


def _specs(args: argparse.Namespace):
    """The encoder specs (:class:`~pipeline.embed.encoders.LatentSpec`, ``TextSpec``) the options ask for."""
    from pipeline.embed.encoders import encoder_specs

    return encoder_specs(family=args.family, model=args.model, vae=args.vae, vae_subfolder=args.vae_subfolder,
                         text_encoders=args.text_encoder, text_subfolders=args.text_encoder_subfolder,
                         max_tokens=args.max_text_tokens, layer=args.text_layer, latents=args.latents,
                         home=os.environ.get("BUCKETEER_HOME"))  # fmt: skip


def _request_settings(args: argparse.Namespace, bucket_spec: dict) -> dict[str, Any]:
    """The settings known before any model is loaded (checked first, so a mismatch fails fast)."""
    from pipeline.embed.encoders import STORAGE_DTYPES

    latent, text = _specs(args)
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "family": text.family,
        "dtype": STORAGE_DTYPES[args.dtype],
        "buckets": bucket_spec,
        "crop": args.crop,
        "seed": args.seed if args.crop == "random" else None,
        "resample": "lanczos",
        "pixels": "rgb, [-1, 1], exif-transposed, alpha on white",
        "latent": "posterior_mean" if latent.latents == "mean" else "posterior_mean_std",
        "model": None if text.model is None else text.model.ident,
        "vae": {"id": latent.source.ident, "subfolder": latent.source.subfolder},
        "text": {"layer": text.layer, "max_text_tokens": text.max_tokens,
                 "encoders": [{"id": t.ident, "subfolder": t.subfolder} for t in text.sources]},
    }  # fmt: skip


def _freshness(url: str, manifest, index: dict | None) -> Freshness:
    """What the cache holds for each manifest row (everything missing when there is no cache yet)."""
    if index is not None:
        return cache_freshness(url, manifest, index=index)
    return Freshness.empty_cache(manifest.samples.column("sample_id").to_numpy())


def _check_early(url: str, storage_options: dict, request: dict) -> dict | None:
    """Refuse a cache made with other requested settings; its ``_cache.json``, None when there is no cache."""
    try:
        meta = read_cache_meta(url, storage_options)
    except CacheMissingError:
        return None
    old = meta["settings"]
    diff = settings_diff(old, request, only_new_keys=True)
    if diff:
        raise CacheError(f"{redact(url)} was embedded with other settings:\n  " + "\n  ".join(diff)
                         + "\nUse a new --out for these settings (a cache holds exactly one setting).")  # fmt: skip
    return meta


def _settings(request: dict, vae: dict, text: dict) -> dict[str, Any]:
    settings = {**request}
    settings["vae"] = {**request["vae"], **{k: vae[k] for k in
                       ("class", "weights_sha256", "factor", "channels", "scaling_factor", "shift_factor")}}
    settings["text"] = {**request["text"], "pipeline": text["pipeline"], "pooled_dim": text["pooled_dim"],
                        "layout": text["layout"], "encoders": [
        {**r, **{k: e[k] for k in ("class", "weights_sha256", "max_length", "hidden_size")}}
        for r, e in zip(request["text"]["encoders"], text["encoders"])]}  # fmt: skip
    return settings


def _batches(rows: list[dict[str, Any]], batch_size: int) -> list[tuple[str, list[dict[str, Any]]]]:
    """Rows grouped by bucket (sorted, deterministic) and cut into batches of one bucket each."""
    by_bucket: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: (r["bucket"], r["sample_id"])):
        by_bucket.setdefault(row["bucket"], []).append(row)
    return [(b, group[i : i + batch_size]) for b, group in by_bucket.items() for i in range(0, len(group), batch_size)]


PROBE_FILES = 8  # images read up front to tell an unusable storage from a few bad files


def _probe_files(samples, todo: np.ndarray) -> list[str]:
    """Up to PROBE_FILES filenames of the ``todo`` rows, spread evenly over them (deterministic)."""
    rows = np.flatnonzero(todo)  # (t,)
    if not len(rows):
        return []
    picks = np.unique(np.linspace(0, len(rows) - 1, min(PROBE_FILES, len(rows))).round().astype(int))
    names = samples.column("filename")
    return [names[int(rows[i])].as_py() for i in picks]


def run(args: argparse.Namespace) -> int:
    from manifests.manifest import read_manifest

    from pipeline.embed import workers as w

    if args.batch_size < 1 or args.shard_records < 1 or args.text_batch_size < 1:
        raise UsageError("--batch-size, --text-batch-size and --shard-records must be >= 1")
    so = parse_storage_options(args.storage_options)
    manifest = read_manifest(args.manifest, so)
    source = args.source or manifest.source
    request = _request_settings(args, manifest.meta["bucket_spec"])
    # one look at the committed index decides the work: stale rows (changed image bytes, caption or
    # bucket since they were embedded), read failures and missing ones are embedded; fresh records
    # and error rows about the image itself stay. The writer opens on the same read of the index
    committed = _check_early(args.out, so, request)
    index = read_index(args.out, so, committed) if committed is not None else None
    status = _freshness(args.out, manifest, index)
    # besides the captions: the empty caption (caption dropout) and the validation prompts, once each
    validation = committed_prompts(committed) if args.validation_prompts is None else \
        read_validation_prompts(args.validation_prompts, so)  # fmt: skip
    missing_prompts = missing_texts(prompt_texts(validation), index)
    if not status.todo.any() and not missing_prompts and validation == committed_prompts(committed):
        print(f"bucketeer embed: {redact(args.out)} already holds every sample of the manifest, all up to date; "
              "nothing to embed")  # fmt: skip
        return 0
    # a bucket that is gone or denied would otherwise cost a model load and an error row per sample.
    # Rows retried after a read failure are not probed: if they still cannot be read (deleted
    # objects), renewing their error rows is the right outcome, not a failed job
    w.check_source(source, so, _probe_files(manifest.samples, status.todo & ~status.retry))
    latent_spec, text_spec = _specs(args)
    if latent_spec.source.is_default or any(t.is_default for t in text_spec.sources):
        print(_default_notice(), file=sys.stderr, flush=True)

    ray, _ = init_ray(args.ray_address)  # a CLI process: Ray stops when it exits
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    threads = args.torch_threads or max(1, int(resources.get("CPU", 2)) // 2)
    gpu_opts = {"num_gpus": 1, "num_cpus": 1} if gpus else {"num_cpus": 1}
    t0 = time.time()

    # phase 1: text. Its actor is started first so a settings mismatch is found before any work
    text_actor = ray.remote(w.TextWorker).options(**gpu_opts).remote(
        text_spec, bool(gpus), request["dtype"], None if gpus else threads)
    n_vae = args.vae_workers or max(1, gpus)
    vae_actors = []
    text_info = _actor_get(ray, text_actor.describe.remote())
    if not gpus or gpus > 1:  # on one GPU the VAE waits for the text actor to free it
        vae_actors = [ray.remote(w.LatentWorker).options(max_concurrency=2, **gpu_opts).remote(
            latent_spec, bool(gpus), request["dtype"], None if gpus else threads) for _ in range(n_vae)]  # fmt: skip
    samples = manifest.samples.select(["sample_id", "filename", "caption", "bucket"]).to_pylist()
    source_keys = source_key(manifest.samples)  # (n,) what each record is made from, stored in its index row
    for row, key, todo in zip(samples, source_keys.tolist(), status.todo.tolist()):
        row["caption_key"] = caption_key(row["caption"])
        row["source_key"] = key
        row["todo"] = todo
    keys_by_id = {row["sample_id"]: row["source_key"] for row in samples}

    def start_vae() -> dict:
        if not vae_actors:
            vae_actors.extend(ray.remote(w.LatentWorker).options(max_concurrency=2, **gpu_opts).remote(
                latent_spec, bool(gpus), request["dtype"], None) for _ in range(n_vae))  # fmt: skip
        infos = _actor_get(ray, [a.describe.remote() for a in vae_actors])
        if len({i["weights_sha256"] for i in infos}) != 1:
            raise BucketeerError("VAE workers loaded different weights (nodes disagree on the model files)")
        return infos[0]

    vae_info = start_vae() if vae_actors else None
    settings = _settings(request, vae_info, text_info) if vae_info else None
    writer = None
    if settings:
        writer = _open_writer(args, so, settings, vae_info, text_info, gpus, index, validation)
    todo_keys = {}
    done_texts = writer.done_texts if writer else set()
    for row in samples:  # a fresh record's caption has its text record already (texts commit first)
        if row["todo"] and row["caption_key"] not in done_texts:
            todo_keys[row["caption_key"]] = row["caption"] or ""
    todo_keys.update((k, text) for k, text in missing_prompts.items() if k not in done_texts)
    items = sorted(todo_keys.items(), key=lambda kv: kv[1])
    text_results = [text_actor.encode.remote(items[i : i + args.text_batch_size])
                    for i in range(0, len(items), args.text_batch_size)]  # fmt: skip
    encoded_texts = []
    with Progress("embed", "captions", total=len(items), unit="captions", enabled=bool(items)) as progress:
        for ref in text_results:
            encoded = ray.get(ref)
            encoded_texts.extend(encoded)
            progress.update(len(encoded))
    ray.kill(text_actor)
    if writer is None:  # single GPU: the VAE starts now
        vae_info = start_vae()
        settings = _settings(request, vae_info, text_info)
        writer = _open_writer(args, so, settings, vae_info, text_info, gpus, index, validation)
    new_texts = [len(blob) for key, blob in encoded_texts if key not in writer.done_texts]
    text_bytes = sum(new_texts)
    for key, blob in encoded_texts:
        writer.add_text(key, blob)
    writer.commit("texts")  # text records are committed before any sample that refers to them

    # phase 2: images, batched by bucket; prepared batches go straight from task to actor
    todo = [r for r in samples if r["todo"]]
    changed, retried = int(status.stale.sum()), int(status.retry.sum())
    batches = _batches(todo, args.batch_size)
    print(f"bucketeer embed: {len(samples)} samples in the manifest, {len(samples) - len(todo)} already cached, "
          f"{changed} changed since embedded (re-embedding), {retried} read failures (retrying), "
          f"{len(todo) - changed - retried} new: "
          f"{len(todo)} to embed in {len(batches)} batches; {len(items)} new captions "
          f"({_size(text_bytes / len(new_texts)) if new_texts else '-'} each); "
          f"{'%d GPU' % gpus if gpus else 'CPU'} VAE x{len(vae_actors)}; gzip via {GZIP_BACKEND}", flush=True)
    prepare = ray.remote(w.prepare_batch).options(num_cpus=1)
    t_images = time.time()
    window: deque = deque()
    counts = {"embedded": 0, "errors": 0, "bytes": 0}
    fields = ("sample_id", "filename", "caption_key")
    progress = Progress("embed", "images", total=len(todo), unit="images")

    def collect(ref) -> None:
        result = ray.get(ref)
        for sample_id, blob, key, bucket in result["records"]:
            counts["embedded"] += 1
            counts["bytes"] += len(blob)
            writer.add_sample(sample_id, blob, key, bucket, keys_by_id[sample_id])
        for sample_id, filename, kind, message in result["errors"]:
            counts["errors"] += 1
            writer.add_error(sample_id, filename, kind, message, keys_by_id[sample_id])
        progress.update(len(result["records"]) + len(result["errors"]), written=f"{counts['bytes'] / 1e6:.1f} MB",
                        errors=counts["errors"])  # fmt: skip

    for i, (bucket, rows) in enumerate(batches):
        prepared = prepare.remote(source, so, bucket, [{k: r[k] for k in fields} for r in rows],
                                  args.crop, args.seed, manifest.max_pixels)  # fmt: skip
        window.append(vae_actors[i % len(vae_actors)].encode.remote(prepared))
        if len(window) >= 2 * len(vae_actors) + 2:  # bounded: a few batches in flight per actor
            collect(window.popleft())
    while window:
        collect(window.popleft())
    progress.close()
    for actor in vae_actors:
        ray.kill(actor)
    seconds, image_seconds = time.time() - t0, time.time() - t_images
    summary = {"embedded": counts["embedded"], "errors": counts["errors"], "skipped": len(samples) - len(todo),
               "changed": changed, "retried": retried, "new_captions": len(items),
               "bytes_per_caption": round(text_bytes / len(new_texts)) if new_texts else None,  # this run's
               "bytes_per_sample": round(counts["bytes"] / counts["embedded"]) if counts["embedded"] else None,
               "seconds": round(seconds, 2),
               "image_seconds": round(image_seconds, 2),  # the image phase alone, without model loading
               "images_per_second": round(counts["embedded"] / image_seconds, 2)
               if image_seconds else None}  # fmt: skip
    meta = writer.finish(manifest.fingerprint, summary)
    print(f"bucketeer embed: {counts['embedded']} embedded, {counts['errors']} error rows, "
          f"{changed} changed, {retried} retried, {summary['skipped']} skipped in {seconds:.1f}s "
          f"-> {redact(args.out)} "
          f"({meta['counts']['samples']} samples, {meta['counts']['texts']} captions, "
          f"{len(meta['shards'])} shards; {_size(meta['bytes']['per_sample'])} per sample, "
          f"{_size(meta['bytes']['per_caption'])} per caption)", flush=True)
    return 0


def _size(n: float | None) -> str:
    """``n`` bytes for people: ``'512 B'``, ``'6.3 kB'``, ``'2.42 MB'`` (decimal units)."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _default_notice() -> str:
    from pipeline.embed.encoders import DEFAULT_NOTICE

    return DEFAULT_NOTICE


def _open_writer(
    args, so: dict, settings: dict, vae: dict, text: dict, gpus: int, index: dict | None, validation: list[dict]
) -> CacheWriter:
    posterior = vae["latents"] == "posterior"
    info = {
        "family": text["family"],
        "latent": {"kind": "posterior_mean_std" if posterior else "posterior_mean", "dtype": settings["dtype"],
                   "channels": vae["channels"], "factor": vae["factor"], "scaling_factor": vae["scaling_factor"],
                   "shift_factor": vae["shift_factor"],
                   "usage": ("latent = latent + latent_std * noise; " if posterior else "")
                   + "z = (latent - shift_factor) * scaling_factor (shift 0 when null)"},
        "text": {"family": text["family"], "pipeline": text["pipeline"], "dtype": settings["dtype"],
                 "layer": text["layer"], "max_tokens": text["max_tokens"], "pooled_dim": text["pooled_dim"],
                 "encoders": [{"id": e["id"], "class": e["class"], "hidden_size": e["hidden_size"],
                               "max_length": e["max_length"]} for e in text["encoders"]],
                 "layout": text["layout"],
                 "empty_caption_key": caption_key(""),  # its text record: caption dropout; a null caption's text
                 "validation_prompts": validation},
        "compute": {"device": vae.get("device"), "dtype": vae.get("compute_dtype"), "gpus": gpus},
        "gzip": GZIP_BACKEND,
        "storage_options": public_options(so),
    }  # fmt: skip
    return CacheWriter(args.out, settings, info=info, storage_options=so, shard_records=args.shard_records,
                       index=index)

