"""Embed a manifest into a cache: VAE latents and text embeddings, gzip'd safetensors records (Ray job).

    bucketeer embed MANIFEST --out CACHE --family sdxl|sd3|flux|pixart --model ID|PATH [--dtype bf16]
    bucketeer embed MANIFEST --out CACHE [--vae ID|PATH] [--text-encoder ID|PATH ...]   # generic encoders
    ray job submit --working-dir . -- python -m pipeline.embed MANIFEST --out s3://bucket/cache --device cuda ...

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
actors (:mod:`pipeline.embed.dataflow`, Ray Data). Workers write the shards; the driver receives
only index rows and commits them (:class:`manifests.cache.CacheCommitter`) every
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
variants (K crops, each also mirrored) in the record, recorded in ``_cache.json`` settings; the
trainer picks one per (seed, epoch, sample) (:func:`train.data.variant_choice`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from manifests.cache import (
    CACHE_FORMAT_VERSION,
    SHARD_RECORDS,
    CacheCommitter,
    CacheError,
    CacheMissingError,
    IndexLookup,
    index_lookup,
    read_cache_meta,
    settings_diff,
)
from manifests.cache.records import GZIP_BACKEND, caption_key
from manifests.cache.writer import COMMIT_SECONDS
from manifests.errors import BucketeerError, UsageError
from manifests.manifest import read_manifest_meta
from manifests.progress import Progress
from manifests.schema import MAX_PIXELS
from manifests.storage import call_storage, is_local, join, open_url, parse_storage_options, public_options, redact
from pipeline.embed.dataflow import DEVICES, Placement
from pipeline.embed.encoders import LATENTS
from pipeline.embed.families import FAMILIES
from pipeline.embed.prompts import committed_prompts, missing_texts, prompt_texts, read_validation_prompts
from pipeline.embed.work import EmbedWork
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
    g.add_argument("--seed", type=int, default=0,
                   help="seed of --crop random and --crops (per sample: seed + sample id)")
    g.add_argument("--flip", action="store_true",
                   help="also store each crop mirrored left-right as a variant (its crop box mirrored as SDXL "
                        "expects); the trainer picks one variant per (seed, epoch, sample)")
    g.add_argument("--crops", type=int, default=1, metavar="K",
                   help="store K random crops per image as variants, reproducible from --seed and the sample id "
                        "(default 1: the --crop policy's one crop); variants = crops x (2 with --flip)")
    g.add_argument("--source", default=None, help="dataset root, if it moved since the scan (default: the manifest's)")
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
    g.add_argument("--ray-address", default=None, help="Ray cluster address (default: start Ray on this machine)")


def _specs(args: argparse.Namespace):
    """The encoder specs (:class:`~pipeline.embed.encoders.LatentSpec`, ``TextSpec``) the options ask for."""
    from pipeline.embed.encoders import encoder_specs

    return encoder_specs(family=args.family, model=args.model, vae=args.vae, vae_subfolder=args.vae_subfolder,
                         text_encoders=args.text_encoder, text_subfolders=args.text_encoder_subfolder,
                         max_tokens=args.max_text_tokens, layer=args.text_layer, latents=args.latents,
                         home=os.environ.get("BUCKETEER_HOME"))  # fmt: skip


def _request_settings(args: argparse.Namespace, bucket_spec: dict, conditioning: bool = False) -> dict[str, Any]:
    """The settings known before any model is loaded (checked first, so a mismatch fails fast);
    ``conditioning``: the manifest pairs its samples with conditioning images."""
    from pipeline.embed.encoders import STORAGE_DTYPES

    latent, text = _specs(args)
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "family": text.family,
        "dtype": STORAGE_DTYPES[args.dtype],
        "buckets": bucket_spec,
        "crop": args.crop,
        "seed": args.seed if args.crop == "random" or args.crops > 1 else None,
        "resample": "lanczos",
        "pixels": "rgb, [-1, 1], exif-transposed, alpha on white",
        "latent": "posterior_mean" if latent.latents == "mean" else "posterior_mean_std",
        "model": None if text.model is None else text.model.ident,
        "vae": {"id": latent.source.ident, "subfolder": latent.source.subfolder},
        "text": {"layer": text.layer, "max_text_tokens": text.max_tokens,
                 "encoders": [{"id": t.ident, "subfolder": t.subfolder} for t in text.sources]},
        # only when used, so that caches made before these options keep their settings (and fingerprint)
        **({"variants": {"crops": args.crops, "flip": args.flip}} if args.crops > 1 or args.flip else {}),
        **({"conditioning": "same crop and variants as the image"} if conditioning else {}),
    }  # fmt: skip


def _check_early(url: str, storage_options: dict, request: dict) -> dict | None:
    """Refuse a cache made with other requested settings; its ``_cache.json``, None when there is no cache."""
    try:
        meta = read_cache_meta(url, storage_options)
    except CacheMissingError:
        return None
    _refuse(url, settings_diff(meta["settings"], request, only_new_keys=True))
    return meta


_VAE_KEYS = ("class", "weights_sha256", "factor", "channels", "scaling_factor", "shift_factor")


def _settings(request: dict, vae: dict, text: dict) -> dict[str, Any]:
    settings = {**request}
    settings["vae"] = {**request["vae"], **{k: vae[k] for k in _VAE_KEYS}}
    settings["text"] = {**request["text"], "pipeline": text["pipeline"], "pooled_dim": text["pooled_dim"],
                        "layout": text["layout"], "encoders": [
        {**r, **{k: e[k] for k in ("class", "weights_sha256", "max_length", "hidden_size")}}
        for r, e in zip(request["text"]["encoders"], text["encoders"])]}  # fmt: skip
    return settings


def _committed_text(meta: dict) -> dict[str, Any]:
    """The text encoders' ``describe()`` as a committed ``_cache.json`` records it (a run with no new
    caption loads no text encoder)."""
    return {**meta["text"], **{k: meta["settings"]["text"][k] for k in ("pipeline", "pooled_dim", "layout",
                                                                         "encoders")}}  # fmt: skip


def _info(so: dict, settings: dict, vae: dict, text: dict, validation: list[dict]) -> dict[str, Any]:
    """What ``_cache.json`` says besides the fingerprinted settings: how to read the tensors, the
    text records besides the captions (the empty caption, ``validation`` prompts)."""
    posterior = vae["latents"] == "posterior"
    return {
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
        "gzip": GZIP_BACKEND,
        "storage_options": public_options(so),
    }  # fmt: skip


def _factories(args: argparse.Namespace, dtype: str):
    """The encoders as picklable ``(use_gpu=bool) -> Encoder`` factories (the specs' ``load``): what
    the workers build."""
    latent, text = _specs(args)
    return functools.partial(latent.load, dtype=dtype), functools.partial(text.load, dtype=dtype)


def _describe(ray, make_encoder) -> dict[str, Any]:
    """An encoder's ``describe()``, loaded once on a CPU worker (a bad path fails here, in one line)."""
    from pipeline.embed.workers import describe_encoder

    try:
        return ray.get(ray.remote(describe_encoder).options(num_cpus=1).remote(make_encoder))
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, (BucketeerError, OSError)):
            raise UsageError(f"an encoder failed to load: {e.cause}") from None
        raise


def _validate(args: argparse.Namespace) -> None:
    if args.batch_size < 1 or args.shard_records < 1 or args.text_batch_size < 1:
        raise UsageError("--batch-size, --text-batch-size and --shard-records must be >= 1")
    if args.commit_seconds < 0 or (args.vae_workers is not None and args.vae_workers < 1):
        raise UsageError("--commit-seconds must be >= 0 and --vae-workers >= 1")
    if args.crops < 1:
        raise UsageError("--crops must be >= 1")
    if (args.crops > 1 or args.flip) and args.latents == "posterior":
        raise UsageError("--latents posterior stores one posterior std per sample, not per --flip/--crops variant; "
                         "use one or the other")


def image_column(manifest: dict) -> str | None:
    """The column of image bytes of a parquet-sourced manifest (``scan --format parquet``), else None."""
    summary = manifest.get("summary") or {}
    return summary.get("image_column") if summary.get("source_format") == "parquet" else None


def run(args: argparse.Namespace) -> int:
    from pipeline.embed.encoders import DEFAULT_NOTICE, STORAGE_DTYPES
    from pipeline.embed.work import find_work
    from pipeline.embed.workers import check_source

    _validate(args)
    so = parse_storage_options(args.storage_options)
    manifest = read_manifest_meta(args.manifest, so)
    source = args.source or manifest["source"]
    request = _request_settings(args, manifest["bucket_spec"], "conditioning" in manifest)
    # one look at the committed index decides the work: stale rows (changed image bytes, caption or
    # bucket since they were embedded), read failures and missing ones are embedded; fresh records
    # and error rows about the image itself stay
    committed = _check_early(args.out, so, request)
    lookup, done_texts = index_lookup(args.out, so, committed) if committed else (IndexLookup.empty(), [])
    # besides the captions: the empty caption (caption dropout) and the validation prompts, once each;
    # a caption equal to one of them is encoded as that one, not twice
    validation = committed_prompts(committed) if args.validation_prompts is None else \
        read_validation_prompts(args.validation_prompts, so)  # fmt: skip
    prompts = missing_texts(prompt_texts(validation), done_texts)
    done_texts = np.concatenate([np.asarray(done_texts, np.uint64), np.fromiter(prompts, np.uint64, len(prompts))])
    work = find_work(args.manifest, manifest, so, lookup, done_texts)
    del lookup, done_texts
    if not work.todo and not prompts and validation == committed_prompts(committed):
        print(f"bucketeer embed: {redact(args.out)} already holds every sample of the manifest, all up to date; "
              "nothing to embed")  # fmt: skip
        return 0
    # a bucket that is gone or denied would otherwise cost a model load and an error row per sample
    check_source(source, so, work.probe, image_column=image_column(manifest))
    latent_spec, text_spec = _specs(args)
    if latent_spec.source.is_default or any(t.is_default for t in text_spec.sources):
        print(DEFAULT_NOTICE, file=sys.stderr, flush=True)

    ray, _ = init_ray(args.ray_address)  # a CLI process: Ray stops when it exits
    from pipeline.embed.dataflow import configure_ray_data, place_encoders

    configure_ray_data()
    placement = place_encoders(ray, args.device, args.vae_workers, args.torch_threads)
    make_vae, make_text = _factories(args, STORAGE_DTYPES[args.dtype])
    t0 = time.time()
    vae = _describe(ray, make_vae)
    embed = _Embed(args, so, request, committed, vae, placement, validation)
    counts, new_captions = work.counts, work.new_captions + len(prompts)
    print(f"bucketeer embed: {work.samples} samples in the manifest, {counts['fresh'] + counts['failed']} already "
          f"cached, {counts['stale']} changed since embedded (re-embedding), {counts['retry']} read failures "
          f"(retrying), {counts['missing']} new: {work.todo} to embed; {new_captions} new captions; "
          f"{placement.summary()}; gzip via {GZIP_BACKEND}", flush=True)  # fmt: skip
    embed.mark_visible()
    embed.captions(work, prompts, make_text)
    if work.todo:
        embed.images(work, source, make_vae, manifest)
    seconds, image_seconds = time.time() - t0, embed.steady_seconds
    summary = {"embedded": embed.embedded, "errors": embed.errors, "skipped": work.samples - work.todo,
               "changed": counts["stale"], "retried": counts["retry"], "new_captions": new_captions,
               # this run's records, compressed: what a caption and a sample cost in this cache
               "bytes_per_caption": embed.bytes_per("texts"), "bytes_per_sample": embed.bytes_per("samples"),
               "seconds": round(seconds, 2),
               # steady state: from the first image result to the last (start-up and model loading
               # excluded); with fewer than 3 results (units), the whole image phase
               "image_seconds": round(image_seconds, 2),
               "images_per_second": round(embed.steady_images / image_seconds, 2) if image_seconds else None,
               "device": placement.device, "encoder_nodes": len(embed.nodes), "shards": embed.shards,
               "redone": embed.committer.redone}  # fmt: skip
    meta = embed.committer.finish(manifest["fingerprint"], summary)
    embed.unmark_visible()
    print(f"bucketeer embed: {embed.embedded} embedded, {embed.errors} error rows, {counts['stale']} changed, "
          f"{counts['retry']} retried, {summary['skipped']} skipped in {seconds:.1f}s -> {redact(args.out)} "
          f"({meta['counts']['samples']} samples, {meta['counts']['texts']} captions; {embed.shards} shards "
          f"written; {_size(meta['bytes']['per_sample'])} per sample, {_size(meta['bytes']['per_caption'])} per "
          "caption)", flush=True)  # fmt: skip
    return 0


def _conditioning_root(manifest: dict, source: str) -> str | None:
    """Where the manifest's ``conditioning`` paths are: its conditioning root, or (a --captions column)
    the source root, ``--source`` when the dataset moved. None for a manifest without pairs."""
    pairing = manifest.get("conditioning")
    if pairing is None:
        return None
    return source if pairing.get("column") else pairing["root"]


def _size(n: float | None) -> str:
    """``n`` bytes for people: ``'512 B'``, ``'6.3 kB'``, ``'2.42 MB'`` (decimal units)."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


class _Embed:
    """The driver's side of a run: the committer (opened once the settings are known: the VAE's
    description, and the text encoders' from their first result or the committed cache), the
    workers' descriptions it checks, and the counts it reports."""

    def __init__(self, args, so: dict, request: dict, committed: dict | None, vae: dict, placement: Placement,
                 validation: list[dict]):
        self.args, self.so, self.request, self.committed, self.vae, self.placement = (
            args, so, request, committed, vae, placement)  # fmt: skip
        self.validation = validation  # listed in _cache.json: the prompts of this run, else the committed ones
        self.committer: CacheCommitter | None = None
        self.seen: dict[str, dict] = {}  # phase -> the first worker's encoder description
        self.nodes: set[str] = set()  # Ray nodes whose VAE workers returned results
        self.notices: set[str] = set()
        self.embedded = self.errors = self.shards = 0
        self.steady_images, self.steady_seconds = 0, 0.0  # images after the first result, and their seconds
        self.written = {"texts": [0, 0], "samples": [0, 0]}  # kind -> [records, compressed bytes] of this run
        if committed is not None:  # refuse other VAE weights now, before any caption is encoded
            old = committed["settings"]
            new = {**old, "vae": _settings(self.request, vae, old["text"])["vae"]}
            _refuse(args.out, settings_diff(old, new))

    def _open(self, text: dict) -> None:
        settings = _settings(self.request, self.vae, text)
        info = _info(self.so, settings, self.vae, text, self.validation)
        self.committer = CacheCommitter(self.args.out, settings, info, self.so, meta=self.committed,
                                        commit_seconds=self.args.commit_seconds)  # fmt: skip

    def _count(self, kind: str, rows: pa.Table) -> None:
        """Count the records of ``rows`` (index rows of this run's shards) and their compressed bytes."""
        self.written[kind][0] += rows.num_rows
        self.written[kind][1] += int(pc.sum(rows.column("length")).as_py() or 0)

    def bytes_per(self, kind: str) -> int | None:
        """Mean compressed bytes of a record of ``kind`` written by this run (None when none was)."""
        records, size = self.written[kind]
        return round(size / records) if records else None

    def _worker(self, phase: str, text: str) -> dict:
        """Check a result's worker description against the first of its phase (and the VAE probe)."""
        worker = json.loads(text)
        first = self.seen.setdefault(phase, worker)
        expected = self.vae if phase == "images" else first["encoder"]
        digests = (lambda d: [e["weights_sha256"] for e in d.get("encoders", [d])])  # noqa: E731
        if digests(worker["encoder"]) != digests(expected):
            raise BucketeerError(f"encoder workers on {first['host']} and {worker['host']} loaded different "
                                 "weights (nodes disagree on the model files): fix the nodes' model cache and rerun")
        if worker["notice"] and worker["notice"] not in self.notices:
            self.notices.add(worker["notice"])
            print(f"bucketeer embed: WARNING: {worker['notice']}", file=sys.stderr, flush=True)
        return worker

    def mark_visible(self) -> None:
        """A local --out gets a marker every worker must see: workers write shards there themselves."""
        from pipeline.embed.workers import VISIBLE_MARKER

        fs, root = open_url(self.args.out, self.so)
        if is_local(fs):
            call_storage(fs, "creating", root, lambda: fs.makedirs(root, exist_ok=True))
            with open(join(root, VISIBLE_MARKER), "w") as f:
                f.write(f"{os.getpid()}\n")

    def unmark_visible(self) -> None:
        from pipeline.embed.workers import VISIBLE_MARKER

        fs, root = open_url(self.args.out, self.so)
        if is_local(fs):
            call_storage(fs, "removing", root, lambda: os.remove(join(root, VISIBLE_MARKER)))

    def captions(self, work: EmbedWork, prompts: dict[int, str], make_text) -> None:
        """Phase 1: new captions and ``prompts`` (caption key -> text: the empty caption, validation
        prompts) -> text shards, committed as they finish and all before the images."""
        from pipeline.embed.dataflow import caption_pipeline, results
        from pipeline.embed.workers import from_ipc

        if not work.captions and not prompts:  # every text has its record: the text settings are the committed ones
            self._open(_committed_text(self.committed))
            return
        pipeline = caption_pipeline(work, prompts, self.args.manifest, self.so, make_text, self.request["dtype"],
                                    self.args.out, self.args.text_batch_size, self.placement)  # fmt: skip
        written = 0
        total = work.new_captions + len(prompts)
        with Progress("embed", "captions", total=total, unit="captions") as progress:
            for row in results(pipeline):
                worker = self._worker("captions", row["worker"])
                if self.committer is None:
                    self._open(worker["encoder"])
                rows = from_ipc(row["texts"])
                self.committer.add("texts", rows)
                self._count("texts", rows)
                written += row["shard_bytes"]
                self.shards += 1
                progress.update(rows.num_rows, written=f"{written / 1e6:.1f} MB")
                if self.committer.due():
                    self.committer.commit()
        self.committer.commit()  # text records are committed before any sample that refers to them

    def images(self, work: EmbedWork, source: str, make_vae, manifest: dict) -> None:
        """Phase 2: units of rows -> sample shards and error rows, committed every --commit-seconds."""
        from pipeline.embed.dataflow import image_pipeline, results
        from pipeline.embed.workers import from_ipc

        options = {"batch_size": self.args.batch_size, "shard_records": self.args.shard_records,
                   "crop": self.args.crop, "seed": self.args.seed, "crops": self.args.crops, "flip": self.args.flip,
                   "conditioning": _conditioning_root(manifest, source),
                   "max_pixels": int(manifest.get("max_pixels") or MAX_PIXELS),
                   "image_column": image_column(manifest)}  # fmt: skip
        pipeline = image_pipeline(work, self.args.manifest, source, self.so, make_vae, self.request["dtype"],
                                  self.args.out, options, self.placement)  # fmt: skip
        written, first, start, results_seen, images_seen = 0, None, time.time(), 0, 0
        with Progress("embed", "images", total=work.todo, unit="images") as progress:
            for row in results(pipeline):
                worker = self._worker("images", row["worker"])
                if "compute" not in self.committer.meta:
                    encoder = worker["encoder"]
                    self.committer.set_info(compute={"device": worker["device"], "gpus": self.placement.gpus_now,
                                                     "dtype": encoder.get("compute_dtype")})  # fmt: skip
                self.nodes.add(worker["node"])
                samples, errors = from_ipc(row["samples"]), from_ipc(row["errors"])
                self.embedded += self.committer.add("samples", samples)
                self._count("samples", samples)
                self.errors += self.committer.add("errors", errors)
                written += row["shard_bytes"]
                self.shards += bool(row["shard_bytes"])
                progress.update(samples.num_rows + errors.num_rows, written=f"{written / 1e6:.1f} MB",
                                errors=self.errors)  # fmt: skip
                results_seen, images_seen = results_seen + 1, images_seen + samples.num_rows
                if first is None:
                    first = time.time()
                else:
                    self.steady_images += samples.num_rows
                    self.steady_seconds = time.time() - first
                if self.committer.due():
                    self.committer.commit()
        if results_seen < 3:  # one or two units finish together: their gap says nothing about the rate
            self.steady_images, self.steady_seconds = images_seen, time.time() - start
        self.committer.commit()


def _refuse(url: str, diff: list[str]) -> None:
    if diff:
        raise CacheError(f"{redact(url)} was embedded with other settings:\n  " + "\n  ".join(diff)
                         + "\nUse a new --out for these settings (a cache holds exactly one setting).")  # fmt: skip
