"""The bill before a run: what ``bucketeer embed`` will do and what it will cost, before any model loads.

    bucketeer estimate MANIFEST --out CACHE --family F --model ID|PATH [embed's options] [--gpu h100] [--gpus 8]
        [--price-gpu-hour 2.50] [--price-gb-month 0.015] [--price-egress-gb 0.09] [--json]

It takes ``embed``'s own options (the same parser) and decides the work exactly as ``embed`` decides it
(:func:`pipeline.embed.work.find_work`, against ``--out``'s committed index when there is one: a rerun's bill counts
only what changed). Then, with no weight read and no image fetched:

- **counts**: samples, rows to embed, captions to encode (each distinct one once; the empty caption and
  ``--validation-prompts`` among them), variants per sample (``--crops`` x ``--flip``);
- **bytes written**, exact from the family's record layout (before gzip, which the embed summary reports after):
  the text rows each caption gets (its tokenizer and template run on it, the text encoders replaced by a model of
  no weights that returns zeros of the real shapes: :class:`pipeline.embed.encoders.TextEncoders` with
  ``weights=False``), and each sample's latents at its bucket's grid (the VAE's config: channels, factor);
- **reads**: requests (one per image, per conditioning image) and bytes (the manifest's file sizes);
- **time and GPU-hours** on ``--gpus`` of ``--gpu``, from the rates ``make gpu-check`` measured and this project
  ships (``pipeline/rates.json``, each naming its machine and date), by pixels per image (:func:`images_per_second`);
  a rate never measured for
  that device, family and model size is said to be missing, not guessed;
- **money**, from the prices given.
- with ``--reuse``: the samples and captions another cache holds, found as ``embed`` finds them (each image of the
  work read and hashed: the one thing the bill then fetches; the VAE loaded on the CPU to compare its weights), and
  left out of the time (their records are copied, not encoded; the bytes written stay).

Video manifests are not estimated yet (their clips per video depend on each video's length): refused in one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from manifests.errors import UsageError

__all__ = ["EstimateJob", "Bill", "add_arguments", "job_from_args", "run", "rates", "DEVICES"]

RATES = Path(__file__).with_name("rates.json")
DEVICES = ("h100", "h200", "a100", "l40s", "cpu")
CHUNK = 256  # captions per dry-run batch


@dataclass(frozen=True)
class EstimateJob:
    """An embed job to estimate, on ``gpus`` devices of kind ``gpu``, with optional prices (None: not priced)."""

    embed: Any  # pipeline.embed.job.EmbedJob
    gpu: str = "h100"
    gpus: int = 1
    price_gpu_hour: float | None = None
    price_gb_month: float | None = None
    price_egress_gb: float | None = None
    as_json: bool = False

    def __post_init__(self) -> None:
        if self.gpu not in DEVICES:
            raise UsageError(f"--gpu {self.gpu!r}: one of {', '.join(DEVICES)}")
        if self.gpus < 1:
            raise UsageError(f"--gpus must be >= 1, got {self.gpus}")
        for name in ("price_gpu_hour", "price_gb_month", "price_egress_gb"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise UsageError(f"--{name.replace('_', '-')} must be a number >= 0, got {value}")


@dataclass
class Bill:
    """What :func:`run` found: counts, bytes, reads, time (None: no rate) and money (None: no price)."""

    samples: int = 0
    to_embed: int = 0
    captions: int = 0  # text records (or inline texts) to encode
    variants: int = 1
    text_bytes: int = 0
    latent_bytes: int = 0
    requests: int = 0
    read_bytes: int = 0
    pixels: int = 0  # of the crops the VAE encodes, all variants
    taken: int = 0  # --reuse: samples whose record another cache holds (copied, not encoded)
    texts_taken: int = 0  # --reuse: captions whose text record another cache holds
    hashed_bytes: int = 0  # --reuse: image bytes read to find the samples another cache holds
    seconds: float | None = None  # wall time on the job's devices
    gpu_hours: float | None = None
    rate: str = ""  # which measured rate, or why there is none
    money: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipeline.embed.job import add_arguments as embed_arguments

    embed_arguments(parser)
    g = parser.add_argument_group("estimate")
    g.add_argument("--gpu", choices=DEVICES, default="h100", help="the device kind to price the run on")
    g.add_argument("--gpus", type=int, default=1, help="how many of them the run uses")
    g.add_argument("--price-gpu-hour", type=float, default=None, metavar="USD", help="price of one device-hour")
    g.add_argument("--price-gb-month", type=float, default=None, metavar="USD", help="storage, per GB and month")
    g.add_argument("--price-egress-gb", type=float, default=None, metavar="USD", help="reads, per GB out of the store")
    g.add_argument("--json", dest="as_json", action="store_true", help="print the bill as one JSON object")


def job_from_args(args: argparse.Namespace) -> EstimateJob:
    from pipeline.embed.job import job_from_args as embed_job

    return EstimateJob(embed=embed_job(args), gpu=args.gpu, gpus=args.gpus, price_gpu_hour=args.price_gpu_hour,
                       price_gb_month=args.price_gb_month, price_egress_gb=args.price_egress_gb,
                       as_json=args.as_json)  # fmt: skip


def rates() -> dict[str, Any]:
    """The shipped rates (``pipeline/rates.json``)."""
    return json.loads(RATES.read_text())


def _rate(job: EstimateJob, family: str, default_model: bool) -> tuple[dict[str, Any] | None, str]:
    """``(rate or None, what it is or why there is none)`` for the job's device, family and model size."""
    device = rates().get(job.gpu, {})
    size = "default" if default_model else "real"
    found = device.get("families", {}).get(family, {}).get(size)
    if found is None:
        return None, (f"no rate measured for {family} ({'the tiny default model' if default_model else 'real size'})"
                      f" on {job.gpu}: time and GPU-hours missing")  # fmt: skip
    return found, f"{job.gpu} {device.get('machine', '')}, {device.get('measured', '')}: {device.get('command', '')}"


def _work(job: Any) -> tuple[Any, dict]:
    """``(work, prompts)``: what ``embed`` would do, decided as it decides (:func:`pipeline.embed.job.decide_work`)."""
    from manifests.manifest import read_manifest_meta
    from pipeline.embed.job import decide_work, request_settings_of

    meta = read_manifest_meta(job.manifest, dict(job.storage_options))
    if meta.frame_ladder is not None:
        raise UsageError(f"{job.manifest} is a video manifest: bucketeer estimate prices image manifests only (a "
                         "video's clips depend on its length); see docs/embed.md")  # fmt: skip
    _, work, prompts, _ = decide_work(job, meta, request_settings_of(job, meta))
    return work, prompts


@dataclass
class Tally:
    """What the rows to embed add up to, per bucket (``rows``, and ``conditioned``: those with a conditioning image),
    the bytes they read, and the captions encoded with their text elements (rows x widths, + pooled)."""

    rows: Counter = field(default_factory=Counter)
    conditioned: Counter = field(default_factory=Counter)
    read_bytes: int = 0
    captions: int = 0
    text_elements: int = 0
    text_rows: int = 0  # token rows of every part (--text-dtype fp8 stores a float32 scale per row)
    pooled_elements: int = 0
    taken: Counter = field(default_factory=Counter)  # --reuse: rows per bucket whose record another cache holds
    texts_taken: int = 0  # --reuse: captions whose text record another cache holds
    hashed_bytes: int = 0  # --reuse: image bytes read to hash them


def _texts_of(table: Any, w: Any, inline: bool) -> list[str]:
    """The caption texts a row group's work encodes: ``w.rows`` positions of its flat captions (the captions
    phase), or (``inline``) the only caption of each row marked inline."""
    from pipeline.embed.work import flat_captions

    flat, owner = flat_captions(table)
    if not inline:
        return [flat[int(i)].as_py() or "" for i in w.rows]
    first = np.searchsorted(owner, np.asarray(w.rows, owner.dtype))  # owner is sorted: each row's first caption
    return [flat[int(i)].as_py() or "" for i, keep in zip(first, w.inline) if keep]


def _reuse_table(job: Any):
    """``embed --reuse``'s table, as embed builds it (the VAE loaded on the CPU once, to compare its weights)."""
    from manifests.manifest import read_manifest_meta
    from pipeline.embed.families import FAMILIES
    from pipeline.embed.job import _factories, request_settings_of
    from pipeline.embed.loading import STORAGE_DTYPES
    from pipeline.embed.reuse import build_reuse
    from pipeline.embed.settings import vae_settings
    from pipeline.embed.workers import describe_encoder

    request = request_settings_of(job, read_manifest_meta(job.manifest, dict(job.storage_options)))
    vae = describe_encoder(_factories(job, STORAGE_DTYPES[job.dtype])[0])
    table, _ = build_reuse(job.reuse, dict(job.storage_options), vae_settings(request, vae), request,
                           FAMILIES[job.family].reference)  # fmt: skip
    return table


def _tally(job: Any, work: Any, prompts: dict) -> Tally:
    """One pass over the row groups with work (one at a time: nothing per row is kept), counting rows per bucket and
    the text elements of every caption to encode through the family's own tokenization
    (:meth:`pipeline.embed.encoders.TextEncoders.rows` without weights)."""
    from manifests.buckets import parse_bucket
    from manifests.manifest import read_row_group
    from pipeline.embed.families import FAMILIES
    from pipeline.embed.families import qwen_image_edit as edit
    from pipeline.embed.job import _specs
    from pipeline.embed.work import MANIFEST_COLUMNS

    so = dict(job.storage_options)
    _, spec = _specs(job)
    encoders = spec.load(weights=False)
    widths, pooled = list(encoders.layout.widths), int(encoders.layout.pooled_dim or 0)
    reference = FAMILIES[job.family].reference  # one text per sample: its instruction and its reference's tokens
    area, small, per_size = edit.reference_area(job), np.zeros((56, 56, 3), np.uint8), {}

    def elements(texts: list[str], images: list[np.ndarray] | None = None, count: bool = True) -> int:
        total = 0
        for start in range(0, len(texts), CHUNK):
            some = None if images is None else images[start : start + CHUNK]
            for counts in encoders.rows(texts[start : start + CHUNK], images=some):
                total += sum(n * d for n, d in zip(counts, widths)) + pooled
                if count:
                    tally.text_rows += sum(counts)
                    tally.pooled_elements += pooled
        return total

    def reference_tokens(bucket: str) -> int:  # a reference's tokens depend on its size alone: one run per size
        bw, bh = parse_bucket(bucket)
        size = edit.reference_size(bh, bw, area)
        if size not in per_size:
            per_size[size] = (elements([""], [np.zeros((*size, 3), np.uint8)], count=False)
                              - elements([""], [small], count=False))  # fmt: skip
        tally.text_rows += per_size[size] // widths[0]  # its rows (one text encoder: Qwen2.5-VL)
        return per_size[size]

    reuse = _reuse_table(job) if job.reuse else None
    if reuse is not None:
        from manifests.cache.records import caption_key
        from manifests.manifest import read_manifest_meta
        from pipeline.embed.job import image_column
        from pipeline.embed.reuse import held_latents

        manifest = read_manifest_meta(job.manifest, so)
        source, column = job.source or manifest.source, image_column(manifest)

    def take(texts: list[str]) -> list[str]:  # --reuse: the texts no other cache holds (those are encoded)
        if reuse is None or not reuse.texts:
            return texts
        held = reuse.has_texts(np.fromiter((caption_key(t) for t in texts), np.uint64, len(texts)))
        tally.texts_taken += int(held.sum())
        return [t for t, h in zip(texts, held) if not h]

    tally = Tally()
    groups: dict[int, list] = {}  # a row group's images work and captions work (one GroupWork each, or None)
    for k, works in enumerate((work.images, work.captions)):
        for w in works:
            groups.setdefault(id(w.group), [w.group, None, None])[k + 1] = w
    for group, images, captions in groups.values():
        whole = read_row_group(job.manifest, group, MANIFEST_COLUMNS, so)  # each row group read once
        if images is not None:
            table = whole.take(_indices(images.rows))
            buckets = table.column("bucket").to_pylist()
            tally.rows.update(buckets)
            if "conditioning" in table.column_names:
                has = np.asarray(table.column("conditioning").is_valid())
                tally.conditioned.update(b for b, c in zip(buckets, has) if c)
            tally.read_bytes += int(np.asarray(table.column("size").fill_null(0)).sum())
            if reuse is not None and reuse.latents:
                found, hashed = held_latents(reuse, table.to_pylist(), source, so, column, crop=job.crop,
                                             seed=job.seed, crops=job.crops, flip=job.flip)  # fmt: skip
                tally.taken.update(found)
                tally.hashed_bytes += hashed
            if reference:
                texts = [c or "" for c in table.column("caption").to_pylist()]
                tally.captions += len(texts)
                tally.text_elements += elements(texts, [small] * len(texts)) + sum(map(reference_tokens, buckets))
            elif images.inline is not None:
                texts = _texts_of(whole, images, inline=True)
                tally.captions += len(texts)
                tally.text_elements += elements(texts)
                take(texts)
        if captions is not None:
            texts = _texts_of(whole, captions, inline=False)
            tally.captions += len(texts)
            tally.text_elements += elements(texts)
            take(texts)
    if not reference and prompts:  # the empty caption and validation prompts, once each
        tally.captions += len(prompts)
        tally.text_elements += elements(list(prompts.values()))
        take(list(prompts.values()))
    return tally


def _indices(rows: Any) -> Any:
    """Row positions as the pyarrow array ``Table.take`` wants."""
    import pyarrow as pa

    return pa.array(np.asarray(rows, np.int64))


def images_per_second(rate: dict[str, Any], pixels: int) -> float:
    """The rate's images/s at ``pixels`` per image: its measured ``images`` points ``[[pixels, images/s], ...]``,
    a power law between the two nearest (the VAE's cost grows faster than its pixels: attention), time linear in
    pixels from a single point."""
    points = sorted((float(p), float(r)) for p, r in rate["images"])
    if len(points) == 1:
        (p0, r0), = points
        return r0 * p0 / pixels
    lower = [q for q in points if q[0] <= pixels]
    (p0, r0), (p1, r1) = (points[:2] if not lower else points[-2:] if lower[-1] == points[-1] else
                          (lower[-1], points[points.index(lower[-1]) + 1]))  # fmt: skip
    slope = math.log(r1 / r0) / math.log(p1 / p0)
    return r0 * (pixels / p0) ** slope


def _latent_bytes(job: Any, tally: Tally, element: int) -> tuple[int, int]:
    """``(bytes of the latents, pixels the VAE encodes)`` of the tallied rows, at each bucket's grid (a conditioning
    image's latent beside its target's: at the reference's size for a reference family)."""
    from manifests.buckets import parse_bucket
    from pipeline.embed.families import qwen_image_edit as edit
    from pipeline.embed.job import _specs
    from pipeline.embed.latents import latent_shape

    latent, _ = _specs(job)
    shape = latent_shape(latent)  # {"factor", "channels", ...}
    f, c = shape["factor"], shape["channels"]
    variants = job.crops * (2 if job.flip else 1)
    per_value = (2 if job.latents == "posterior" else 1) * element
    area = edit.reference_area(job)
    total = pixels = 0
    for bucket, n in tally.rows.items():
        bw, bh = parse_bucket(bucket)
        total += n * variants * c * (bh // f) * (bw // f) * per_value
        pixels += n * variants * bh * bw
    for bucket, n in tally.conditioned.items():
        bw, bh = parse_bucket(bucket)
        h, w = edit.reference_size(bh, bw, area) if area else (bh, bw)
        total += n * variants * c * (h // f) * (w // f) * element  # the conditioning latent: its mean
        pixels += n * variants * h * w
    return total, pixels


ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _is_default(e: Any) -> bool:
    """Whether the job's encoders are the tiny random-weight defaults (``--model default``, a folder they were
    built in, or no encoder option at all), whose rates are not a real model's."""
    from pipeline.embed.encoders import DEFAULT_NOTICE
    from pipeline.embed.loading import DEFAULT_ID

    if e.model is None:
        return e.vae in (None, DEFAULT_ID) and all(t == DEFAULT_ID for t in e.text_encoders or (DEFAULT_ID,))
    notice = Path(e.model, "README.txt")
    return e.model == DEFAULT_ID or notice.is_file() and notice.read_text().strip() == DEFAULT_NOTICE


def device_seconds(rate: dict[str, Any], buckets: Counter, captions: int, variants: int) -> float:
    """One device's seconds for ``buckets`` (rows per bucket, each at its pixels, ``variants`` crops each) and
    ``captions`` (``captions_per_second``; a rate without one counts each image's own caption in its images/s)."""
    from manifests.buckets import parse_bucket

    seconds = 0.0
    for bucket, n in buckets.items():
        bw, bh = parse_bucket(bucket)
        seconds += n * variants / images_per_second(rate, bw * bh)
    return seconds + (captions / rate["captions_per_second"] if captions and rate.get("captions_per_second") else 0.0)


def estimate(job: EstimateJob) -> Bill:
    """The :class:`Bill` of ``job`` (nothing loaded but tokenizers and configs; nothing fetched but the manifest)."""
    e = job.embed
    if e.features:
        raise UsageError("--features: bucketeer estimate does not count DINOv2 features yet; estimate without it")
    work, prompts = _work(e)
    tally = _tally(e, work, prompts)
    element = ELEMENT_BYTES[e.dtype]
    text_bytes = tally.text_elements * element
    if e.text_dtype == "fp8":  # a byte a token value, a float32 scale a row, the pooled vector in float32
        text_bytes = tally.text_elements - tally.pooled_elements + 4 * (tally.text_rows + tally.pooled_elements)
    bill = Bill(samples=work.samples, to_embed=sum(tally.rows.values()), captions=tally.captions,
                variants=e.crops * (2 if e.flip else 1), text_bytes=text_bytes,
                requests=sum(tally.rows.values()) + sum(tally.conditioned.values()), read_bytes=tally.read_bytes)
    bill.latent_bytes, bill.pixels = _latent_bytes(e, tally, element)
    bill.taken, bill.texts_taken, bill.hashed_bytes = sum(tally.taken.values()), tally.texts_taken, tally.hashed_bytes
    rate, bill.rate = _rate(job, e.family, _is_default(e))
    if rate is not None:  # what --reuse takes costs no device time: the rest is encoded
        one = device_seconds(rate, tally.rows - tally.taken, bill.captions - bill.texts_taken, bill.variants)
        bill.seconds, bill.gpu_hours = one / job.gpus, one / 3600
    if job.price_gpu_hour is not None and bill.gpu_hours is not None:
        bill.money["compute"] = bill.gpu_hours * job.price_gpu_hour
    if job.price_gb_month is not None:
        bill.money["storage_per_month"] = (bill.text_bytes + bill.latent_bytes) / 1e9 * job.price_gb_month
    if job.price_egress_gb is not None:
        bill.money["reads"] = bill.read_bytes / 1e9 * job.price_egress_gb
    return bill


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1000
    return str(n)


def run(job: EstimateJob) -> Bill:
    """Print the bill of ``job`` (``--json``: one JSON object) and return it."""
    bill = estimate(job)
    if job.as_json:
        print(json.dumps(bill.to_json()))
        return bill
    e = job.embed
    lines = [f"bucketeer estimate: embed {e.manifest} -> {e.out} --family {e.family} ({e.dtype})",
             f"  samples {bill.samples:,}; to embed {bill.to_embed:,} (x{bill.variants} variants); captions to "
             f"encode {bill.captions:,}",
             f"  written (before gzip): latents {_human(bill.latent_bytes)}, text {_human(bill.text_bytes)}",
             f"  read: {bill.requests:,} requests, {_human(bill.read_bytes)}"]  # fmt: skip
    if e.reuse:
        lines.append(f"  --reuse: {bill.taken:,} samples and {bill.texts_taken:,} captions taken from "
                     f"{', '.join(e.reuse)} (copied, not encoded): {bill.to_embed - bill.taken:,} images and "
                     f"{bill.captions - bill.texts_taken:,} captions to encode; {_human(bill.hashed_bytes)} of images "
                     "read to hash them")  # fmt: skip
    if bill.seconds is None:
        lines.append(f"  time: {bill.rate}")
    else:
        lines.append(f"  time on {job.gpus} x {job.gpu}: {bill.seconds / 3600:,.2f} h ({bill.gpu_hours:,.2f} "
                     f"device-hours; rate: {bill.rate})")  # fmt: skip
    for name, value in bill.money.items():
        lines.append(f"  {name.replace('_', ' ')}: ${value:,.2f}")
    print("\n".join(lines), file=sys.stdout, flush=True)
    return bill
