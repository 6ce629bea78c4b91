"""Embed a manifest into a cache: VAE latents and text embeddings, gzip'd safetensors records (Ray job).

    bucketeer embed MANIFEST --out CACHE [--vae ID|PATH] [--text-encoder ID|PATH ...] [--dtype bf16]
    ray job submit --working-dir . -- python -m pipeline.embed MANIFEST --out s3://bucket/cache ...

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
real model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from typing import Any

import numpy as np
import pyarrow as pa

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
from manifests.schema import LOCATION_COLUMNS
from manifests.storage import parse_storage_options, public_options, redact
from pipeline.ray_setup import init_ray


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", help="manifest folder (local path or URL) written by `bucketeer scan`")
    parser.add_argument("--out", required=True, help="cache folder (local path or URL); resumed if it exists")
    g = parser.add_argument_group("encoders")
    g.add_argument("--vae", default="default",
                   help="AutoencoderKL hub id or local folder; "
                        "'default' = tiny random-weight VAE for trying the pipeline")
    g.add_argument("--vae-subfolder", default=None, help="subfolder of --vae, e.g. 'vae' for a pipeline repo")
    g.add_argument("--text-encoder", action="append", default=None, metavar="ID|PATH",
                   help="text encoder hub id or folder; repeat for SDXL-style pairs (order kept); default: tiny CLIP")
    g.add_argument("--text-encoder-subfolder", action="append", default=None,
                   help="subfolder per --text-encoder (same order), e.g. text_encoder / text_encoder_2; "
                        "the tokenizer is read from the matching tokenizer* subfolder")
    g.add_argument("--text-layer", choices=("last", "penultimate"), default="last",
                   help="hidden state stored: last, or penultimate (what SDXL conditions on)")
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


def _sources(args: argparse.Namespace):
    from pipeline.embed.encoders import EncoderSource

    home = os.environ.get("BUCKETEER_HOME")
    vae = EncoderSource(args.vae, args.vae_subfolder, home)
    texts = args.text_encoder or ["default"]
    subs = args.text_encoder_subfolder or []
    if len(subs) > len(texts):
        raise UsageError(f"{len(subs)} --text-encoder-subfolder options for {len(texts)} --text-encoder options")
    subs = subs + [None] * (len(texts) - len(subs))
    return vae, [EncoderSource(t, s, home) for t, s in zip(texts, subs)]


def _request_settings(args: argparse.Namespace, bucket_spec: dict) -> dict[str, Any]:
    """The settings known before any model is loaded (checked first, so a mismatch fails fast)."""
    from pipeline.embed.encoders import STORAGE_DTYPES

    vae, texts = _sources(args)
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "dtype": STORAGE_DTYPES[args.dtype],
        "buckets": bucket_spec,
        "crop": args.crop,
        "seed": args.seed if args.crop == "random" else None,
        "resample": "lanczos",
        "pixels": "rgb, [-1, 1], exif-transposed, alpha on white",
        "latent": "posterior_mean",
        "vae": {"id": "bucketeer:default-v1" if vae.is_default else redact(vae.source),
                "subfolder": None if vae.is_default else vae.subfolder},
        "text": {"layer": args.text_layer,
                 "encoders": [{"id": "bucketeer:default-v1" if t.is_default else redact(t.source),
                               "subfolder": None if t.is_default else t.subfolder} for t in texts]},
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
    settings["text"] = {"layer": request["text"]["layer"], "pooled_dim": text["pooled_dim"], "encoders": [
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


def _probe_files(samples, todo: np.ndarray) -> list[dict]:
    """Up to PROBE_FILES of the ``todo`` rows (where their images are), spread evenly over them (deterministic)."""
    rows = np.flatnonzero(todo)  # (t,)
    if not len(rows):
        return []
    picks = np.unique(np.linspace(0, len(rows) - 1, min(PROBE_FILES, len(rows))).round().astype(int))
    return samples.select(LOCATION_COLUMNS).take(pa.array(rows[picks])).to_pylist()


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
    if not status.todo.any():
        print(f"bucketeer embed: {redact(args.out)} already holds every sample of the manifest, all up to date; "
              "nothing to embed")  # fmt: skip
        return 0
    # a bucket that is gone or denied would otherwise cost a model load and an error row per sample.
    # Rows retried after a read failure are not probed: if they still cannot be read (deleted
    # objects), renewing their error rows is the right outcome, not a failed job
    w.check_source(source, so, _probe_files(manifest.samples, status.todo & ~status.retry))
    vae_source, text_sources = _sources(args)
    if vae_source.is_default or any(t.is_default for t in text_sources):
        print(_default_notice(), file=sys.stderr, flush=True)

    ray, _ = init_ray(args.ray_address)  # a CLI process: Ray stops when it exits
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    threads = args.torch_threads or max(1, int(resources.get("CPU", 2)) // 2)
    gpu_opts = {"num_gpus": 1, "num_cpus": 1} if gpus else {"num_cpus": 1}
    t0 = time.time()

    # phase 1: text. Its actor is started first so a settings mismatch is found before any work
    text_actor = ray.remote(w.TextWorker).options(**gpu_opts).remote(
        text_sources, bool(gpus), request["dtype"], args.text_layer, None if gpus else threads)
    n_vae = args.vae_workers or max(1, gpus)
    vae_actors = []
    text_info = _actor_get(ray, text_actor.describe.remote())
    if not gpus or gpus > 1:  # on one GPU the VAE waits for the text actor to free it
        vae_actors = [ray.remote(w.LatentWorker).options(max_concurrency=2, **gpu_opts).remote(
            vae_source, bool(gpus), request["dtype"], None if gpus else threads) for _ in range(n_vae)]  # fmt: skip
    samples = manifest.samples.select(["sample_id", "caption", "bucket", *LOCATION_COLUMNS]).to_pylist()
    source_keys = source_key(manifest.samples)  # (n,) what each record is made from, stored in its index row
    for row, key, todo in zip(samples, source_keys.tolist(), status.todo.tolist()):
        row["caption_key"] = caption_key(row["caption"])
        row["source_key"] = key
        row["todo"] = todo
    keys_by_id = {row["sample_id"]: row["source_key"] for row in samples}

    def start_vae() -> dict:
        if not vae_actors:
            vae_actors.extend(ray.remote(w.LatentWorker).options(max_concurrency=2, **gpu_opts).remote(
                vae_source, bool(gpus), request["dtype"], None) for _ in range(n_vae))  # fmt: skip
        infos = _actor_get(ray, [a.describe.remote() for a in vae_actors])
        if len({i["weights_sha256"] for i in infos}) != 1:
            raise BucketeerError("VAE workers loaded different weights (nodes disagree on the model files)")
        return infos[0]

    vae_info = start_vae() if vae_actors else None
    settings = _settings(request, vae_info, text_info) if vae_info else None
    writer = None
    if settings:
        writer = _open_writer(args, so, settings, vae_info, text_info, gpus, index)
    todo_keys = {}
    done_texts = writer.done_texts if writer else set()
    for row in samples:  # a fresh record's caption has its text record already (texts commit first)
        if row["todo"] and row["caption_key"] not in done_texts:
            todo_keys[row["caption_key"]] = row["caption"] or ""
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
        writer = _open_writer(args, so, settings, vae_info, text_info, gpus, index)
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
          f"{len(todo)} to embed in {len(batches)} batches; {len(items)} new captions; "
          f"{'%d GPU' % gpus if gpus else 'CPU'} VAE x{len(vae_actors)}; gzip via {GZIP_BACKEND}", flush=True)
    prepare = ray.remote(w.prepare_batch).options(num_cpus=1)
    t_images = time.time()
    window: deque = deque()
    counts = {"embedded": 0, "errors": 0, "bytes": 0}
    fields = ("sample_id", "caption_key", *LOCATION_COLUMNS)
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
               "seconds": round(seconds, 2),
               "image_seconds": round(image_seconds, 2),  # the image phase alone, without model loading
               "images_per_second": round(counts["embedded"] / image_seconds, 2)
               if image_seconds else None}  # fmt: skip
    meta = writer.finish(manifest.fingerprint, summary)
    print(f"bucketeer embed: {counts['embedded']} embedded, {counts['errors']} error rows, "
          f"{changed} changed, {retried} retried, {summary['skipped']} skipped in {seconds:.1f}s "
          f"-> {redact(args.out)} "
          f"({meta['counts']['samples']} samples, {meta['counts']['texts']} captions, "
          f"{len(meta['shards'])} shards)", flush=True)
    return 0


def _default_notice() -> str:
    from pipeline.embed.encoders import DEFAULT_NOTICE

    return DEFAULT_NOTICE


def _open_writer(
    args, so: dict, settings: dict, vae: dict, text: dict, gpus: int, index: dict | None
) -> CacheWriter:
    info = {
        "latent": {"kind": "posterior_mean", "dtype": settings["dtype"], "channels": vae["channels"],
                   "factor": vae["factor"], "scaling_factor": vae["scaling_factor"],
                   "shift_factor": vae["shift_factor"],
                   "usage": "z = (latent - shift_factor) * scaling_factor (shift 0 when null)"},
        "text": {"dtype": settings["dtype"], "layer": args.text_layer, "pooled_dim": text["pooled_dim"],
                 "encoders": [{"id": e["id"], "hidden_size": e["hidden_size"], "max_length": e["max_length"]}
                              for e in text["encoders"]],
                 "layout": "per caption: tokens.<i> (L_i, D_i) unpadded per encoder in order; pooled (D,) "
                           "from the last encoder with one; null caption = empty string"},
        "compute": {"device": vae.get("device"), "dtype": vae.get("compute_dtype"), "gpus": gpus},
        "gzip": GZIP_BACKEND,
        "storage_options": public_options(so),
    }  # fmt: skip
    return CacheWriter(args.out, settings, info=info, storage_options=so, shard_records=args.shard_records,
                       index=index)

