"""The options of ``bucketeer embed``: its command line (:func:`add_arguments`), the typed job they make
(:class:`EmbedJob`, validated where it is built) and the one place the first becomes the second
(:func:`job_from_args`). :mod:`pipeline.embed.job` runs it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Mapping

from manifests.cache import SHARD_RECORDS
from manifests.cache.writer import COMMIT_SECONDS
from manifests.errors import UsageError
from manifests.storage import parse_storage_options, redact
from pipeline.embed.clips import MAX_CLIPS
from pipeline.embed.dataflow import DEVICES, EXECUTORS
from pipeline.embed.families import FAMILIES, qwen_image_edit
from pipeline.embed.loading import LATENTS, STORAGE_DTYPES
from pipeline.embed.reuse import parse_reuse

__all__ = ["EmbedJob", "add_arguments", "job_from_args"]

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
    g.add_argument("--text-dtype", choices=("exact", "fp8"), default="exact",
                   help="text records: exact (in --dtype) or fp8: float8 e4m3 codes with a float32 scale per token, "
                        "about 0.63x bf16's bytes, each value within 2^-4 (docs/embed.md: Compact text records)")
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
    g.add_argument("--reuse", default=None, metavar="CACHE[,CACHE...]",
                   help="caches to copy records from instead of encoding: a latent of the same image bytes, bucket and "
                        "crop under the same VAE settings (any dataset, file name or family), a text record of the "
                        "same caption under the same text settings; checked, then written into --out, which stays "
                        "self-contained (docs/embed.md: Reuse)")
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
    g.add_argument("--compile-vae", action="store_true",
                   help="torch.compile the VAE's encoder (2D VAEs: SDXL's, Flux's, Flux 2's): compiled at its first "
                        "batches (minutes), faster after; latents the same within bf16 rounding, so the cache's "
                        "fingerprint does not change (docs/embed.md: The VAE on a GPU)")
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
    text_dtype: str = "exact"  # exact (dtype) | fp8 (manifests.cache.compact: e4m3 codes, a scale per row)
    features: str | None = None  # dinov2: DINOv2 patch features in every record (REPA)
    features_model: str = "default"
    crop: str = "center"  # center | random
    seed: int = 0
    flip: bool = False
    crops: int = 1
    max_clips: int = MAX_CLIPS  # video manifests: clips per video, evenly spaced, one variant each
    reference_resolution: int | None = None  # a reference family's reference area, squared (None: its pipeline's)
    source: str | None = None  # dataset root, if it moved since the scan
    reuse: tuple[str, ...] = ()  # caches whose records are copied instead of encoded (pipeline.embed.reuse)
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    batch_size: int = 16
    text_batch_size: int = 128
    shard_records: int = SHARD_RECORDS
    device: str = "auto"  # auto | cuda | cpu
    compile_vae: bool = False  # torch.compile the VAE encoder (pipeline.embed.vae_speed; not fingerprinted)
    vae_workers: int | None = None
    torch_threads: int | None = None
    commit_seconds: float = COMMIT_SECONDS
    executor: str = "ray"  # ray | local (pipeline.embed.local: this process, no Ray)
    ray_address: str | None = None

    def __post_init__(self) -> None:
        choices = (("--family", self.family, tuple(FAMILIES)), ("--latents", self.latents, LATENTS),
                   ("--executor", self.executor, EXECUTORS),
                   ("--dtype", self.dtype, tuple(STORAGE_DTYPES)), ("--device", self.device, DEVICES),
                   ("--text-dtype", self.text_dtype, ("exact", "fp8")),
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
        if any(redact(r).rstrip("/") == redact(self.out).rstrip("/") for r in self.reuse):
            raise UsageError("--reuse names --out itself: a cache already keeps its own records (a rerun resumes)")
        if (self.crops > 1 or self.flip) and self.latents == "posterior":
            raise UsageError("--latents posterior stores one posterior std per sample, not per --flip/--crops "
                             "variant; use one or the other")  # fmt: skip


def job_from_args(args: argparse.Namespace) -> EmbedJob:
    """The :class:`EmbedJob` of parsed ``bucketeer embed`` options (UsageError for a bad combination)."""
    tuple_or_none = lambda values: None if values is None else tuple(values)  # noqa: E731
    return EmbedJob(
        manifest=args.manifest, out=args.out, family=args.family, model=args.model, vae=args.vae,
        vae_subfolder=args.vae_subfolder, text_encoders=tuple_or_none(args.text_encoder),
        text_encoder_subfolders=tuple_or_none(args.text_encoder_subfolder), text_layer=args.text_layer,
        max_text_tokens=args.max_text_tokens, latents=args.latents, validation_prompts=args.validation_prompts,
        dtype=args.dtype, text_dtype=args.text_dtype, features=args.features, features_model=args.features_model,
        crop=args.crop, seed=args.seed,
        flip=args.flip, crops=args.crops, max_clips=args.max_clips, reference_resolution=args.reference_resolution,
        source=args.source, reuse=parse_reuse(args.reuse),
        storage_options=parse_storage_options(args.storage_options), batch_size=args.batch_size,
        text_batch_size=args.text_batch_size, shard_records=args.shard_records, device=args.device,
        compile_vae=args.compile_vae, vae_workers=args.vae_workers, torch_threads=args.torch_threads,
        commit_seconds=args.commit_seconds, executor=args.executor, ray_address=args.ray_address,
    )  # fmt: skip
