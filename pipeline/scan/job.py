"""Header-only Ray scan of a local folder or s3:// prefix into a parquet manifest.

    bucketeer scan s3://bucket/ds --out s3://bucket/manifests/ds --storage-options '{"endpoint_url": "…"}'
    ray job submit --working-dir . -- python -m pipeline.scan s3://bucket/ds --out s3://bucket/manifests/ds
    run(ScanJob(source="s3://bucket/ds", out="s3://bucket/manifests/ds", spec=BucketSpec(area=512 * 512)))

The source is listed once (on the driver, key ranges in parallel); the files to read are cut into
batches, one Ray task per batch, and each task (:mod:`pipeline.scan.probing`) keeps many ranged
reads in flight (:func:`pipeline.sources.reading.probe_files`: ``os.pread`` on a local disk, s3fs's
async API on an object store) and probes each header as its first bytes arrive. Only the first bytes
of each image are read, with its sidecar caption in the same pass. A task returns an Arrow table;
the driver assembles the rows column by column (:mod:`pipeline.scan.assemble`), buckets them through
:func:`manifests.manifest.apply_buckets` and commits them with
:func:`manifests.manifest.write_manifest` (parts first, ``_manifest.json`` last), so a killed scan
leaves the previous manifest readable and a re-run gives the same manifest as a clean run. No file
can fail the scan: every value read from a file is checked before it reaches a row
(:mod:`pipeline.sources.results`), and a file's problem is its error row. Files probed are reported
as they come back (:class:`manifests.progress.Progress`: a bar on a terminal, a plain line every 30
s in a Ray job's log; ``--no-progress`` for neither); the closing line is
:func:`pipeline.scan.summary.summary_line`.

Incremental (:mod:`pipeline.sources.rescan`): rows of the manifest already at ``--out`` (or
``--previous``) whose file size and ETag (mtime when the store has no ETag) are unchanged are reused
without reading the file; their sidecar caption is read again only when the listed sidecar is not
the version recorded in the row's ``caption_source`` (see manifests/schema.py). An image with
numbered sidecars (``img.1.txt``, ...: :func:`pipeline.sources.listing.image_sidecars`) gets one
work item per further sidecar, read in its task; all of them are read again when any one changed. The
members of WebDataset ``.tar`` shards are scanned by :mod:`pipeline.sources.containers` (member
headers walked by ranged reads, reuse per shard); a folder of loose images and shards gives one
manifest of both (:func:`pipeline.scan.summary.mixed_part`). ``--format files|tar|parquet`` scans
one kind only (:mod:`pipeline.scan.kinds`; parquet: :mod:`pipeline.sources.parquet`, the
``--image-column`` and ``--caption-column`` of each row group, reuse per file) and counts the others
as ignored by extension; without it, a source of nothing but parquet files is refused with the
options to pass. ``--conditioning``
pairs each sample with a conditioning image (:mod:`pipeline.scan.conditioning`): its header is
probed by the same tasks after the images', and a bad pair is an error row. ``--frames`` (or
``--frame-ladder``) makes it a video scan (:mod:`pipeline.scan.video`): loose video files' container
headers, ``WxHxF`` buckets, the folder's images as 1-frame samples. Without
``--ray-address`` (or ``RAY_ADDRESS``) Ray starts in-process on this machine.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa

from manifests.lock import writer_lock
from manifests.buckets import BucketSpec, add_bucket_arguments, spec_from_args
from manifests.errors import StorageError, UsageError
from manifests.frames import FrameLadder, add_frame_arguments, ladder_from_args
from manifests.manifest import apply_buckets, write_manifest
from manifests.manifest_meta import ManifestMeta, ScanSummary
from manifests.retry import is_storage_failure
from manifests.schema import MAX_PIXELS
from manifests.storage import open_url, parse_storage_options, redact
from manifests.throttles import counting_throttles, job_throttles
from pipeline.formats import IMAGE_EXTENSIONS
from pipeline.ray_setup import ray_session
from pipeline.scan.assemble import assemble
from pipeline.scan.conditioning import Pairing, pair, resolve
from pipeline.sources.masks import MaskFiles, attach_masks, mask_column, mask_counts, parse_masks, \
    split_mask_files
from pipeline.scan.config import FORMATS, ScanConfig
from pipeline.scan.probing import batches, conditioning_probe, redacted, scan_batch, task_options
from pipeline.scan.kinds import select_kinds
from pipeline.scan.summary import ignored_line, mixed_part, scan_summary, summary_line
from pipeline.scan.video import one_frame, video_part, video_scan_part, video_summary_line
from pipeline.sources.captions import CaptionTable, load_captions
from pipeline.sources.containers import ScanPart, container_part
from pipeline.sources.headers import FIRST_READ
from pipeline.sources.listing import Listing, link_error_rows, list_source
from pipeline.sources.reading import PROBE_SCHEMA, probe_files
from pipeline.sources.rescan import plan_rescan, previous_manifest
from pipeline.sources.tar import SHARD_WINDOW
from pipeline.sources.tasks import run_tasks

__all__ = ["ScanJob", "ScanResult", "add_arguments", "job_from_args", "run", "scan_dataset"]

log = logging.getLogger("bucketeer.scan")


@dataclass(frozen=True, kw_only=True)
class ScanJob:
    """``bucketeer scan``: list ``source`` once and read its image headers into a manifest at ``out``.

    ``captions``: a caption table URL; ``conditioning``: ``--conditioning`` (a ``--captions`` column or
    a root, :mod:`pipeline.scan.conditioning`); ``previous``: the manifest to reuse rows from (default:
    the one at ``out``); ``fs`` replaces the filesystem of ``source`` (``source`` is then a path in it;
    it must be picklable): benchmarks and tests wrap storage with it. Invalid tuning raises UsageError
    where the :class:`ScanConfig` is built, an invalid bucket spec where the :class:`BucketSpec` is.
    """

    source: str
    out: str
    spec: BucketSpec = field(default_factory=BucketSpec)
    config: ScanConfig = field(default_factory=ScanConfig)
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec options, e.g. an endpoint_url
    captions: str | None = None
    conditioning: str | None = None
    masks: str | None = None  # --masks: "alpha", "files" or "alpha,files" (pipeline/scan/masks.py)
    previous: str | None = None
    ray_address: str | None = None  # None: $RAY_ADDRESS, else Ray starts in-process
    frames: FrameLadder | None = None  # --frames: a video scan (pipeline/scan/video.py)
    fs: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, kw_only=True)
class ScanResult:
    """What a scan committed: the manifest's URL, fingerprint and ``_manifest.json``, and its figures."""

    url: str
    fingerprint: str
    meta: ManifestMeta
    listed: int  # image files listed (container sources: images found in the shards or parquet files)
    samples: int
    errors: int
    errors_by_kind: dict[str, int]
    ignored: int  # other files, not images
    seconds: float  # the driver's time, Ray's start-up left out
    files_per_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="dataset root: a local folder or s3://bucket/prefix")
    parser.add_argument("--out", required=True, help="manifest folder to write (an existing manifest there is reused)")
    parser.add_argument("--captions", default=None, metavar="URL",
                        help="caption table (parquet, jsonl or csv with filename + caption columns; the caption "
                        "column may be a list of strings: several captions); images not in it fall back to "
                        ".txt/.caption sidecars (numbered img.1.txt, img.2.txt, ...: more captions); or an ANNOTATIONS "
                        "folder of `bucketeer annotate`: its generated captions are added to each image's caption "
                        "list beside the originals")  # fmt: skip
    parser.add_argument("--conditioning", default=None, metavar="ROOT_OR_COLUMN",
                        help="a conditioning image per sample (ControlNet map, edit pair): a column of the --captions "
                        "table holding its path relative to the source root, else a root (folder or URL) holding "
                        "it at the sample's own relative path. Missing or differently sized pairs are error "
                        "rows")  # fmt: skip
    parser.add_argument("--masks", default=None, metavar="alpha,files",
                        help="record a loss mask per sample (manifest column `mask`): files: a mask file beside the "
                        "image, <stem>.mask.<ext> (a/cat.mask.png for a/cat.jpg; in a tar shard the member "
                        "<key>.mask.<ext>; never a sample itself); alpha: the image's own alpha channel, as its "
                        "header declares it; column:NAME (--format parquet): a column of mask bytes")  # fmt: skip
    parser.add_argument("--previous", default=None, metavar="MANIFEST",
                        help="reuse unchanged rows from this manifest (default: the one at --out, if any)")  # fmt: skip
    parser.add_argument("--storage-options", default=None, help="fsspec options as JSON, e.g. an endpoint_url")
    parser.add_argument("--max-pixels", type=int, default=MAX_PIXELS,
                        help="images declaring more pixels are errors (too_many_pixels), never decoded; recorded "
                        f"in the manifest, embed decodes up to it (default and most {MAX_PIXELS:,}: "
                        "what Pillow decodes)")  # fmt: skip
    parser.add_argument("--header-bytes", type=int, default=FIRST_READ,
                        help="first ranged read per image (default 64 KiB)")
    parser.add_argument("--reads-in-flight", type=int, default=ScanConfig.reads_in_flight,
                        help="storage requests in flight per Ray task on an object store (default 128)")
    parser.add_argument("--files-per-task", type=int, default=None,
                        help="batch size of one Ray task (default: automatic)")
    parser.add_argument("--shard-window", type=int, default=SHARD_WINDOW,
                        help="tar shards: bytes read at each member header, which also covers the small members "
                        "after it and the next image's header (default 4 KiB)")  # fmt: skip
    parser.add_argument("--caption-field", default="caption",
                        help="tar shards: the field of a sample's .json member to take the caption from when it "
                        "has no .txt/.caption member, a string or a list of strings (default: caption)")  # fmt: skip
    parser.add_argument("--format", choices=FORMATS, default="auto",
                        help="auto (default): loose image files and the members of WebDataset .tar shards, into one "
                        "manifest; files: only loose images; tar: only .tar shards; parquet: only the .parquet files, "
                        "one image per row (--image-column). Files of the other kinds are counted as ignored by "
                        "extension")  # fmt: skip
    parser.add_argument("--image-column", default="image",
                        help="--format parquet: the column of image bytes: binary, or the HuggingFace datasets "
                        "Image struct {bytes, path} (default: image)")  # fmt: skip
    parser.add_argument("--caption-column", default=None,
                        help="--format parquet: the column of captions (text); default: no captions")
    parser.add_argument("--ray-address", default=None,
                        help="Ray cluster to use (default: $RAY_ADDRESS, else start one here)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar or progress lines (the summary line is always printed)")
    add_bucket_arguments(parser)
    add_frame_arguments(parser)
    parser.epilog = (f"Images: {', '.join(sorted(IMAGE_EXTENSIONS))} (any case): what this Pillow and its "
                     "installed plugins open. Hidden and ._* files are ignored; other files are counted by extension.")


def job_from_args(args: argparse.Namespace) -> ScanJob:
    """The job of ``bucketeer scan``'s options; raises UsageError naming a bad option."""
    storage_options = parse_storage_options(args.storage_options)
    config = ScanConfig(
        max_pixels=args.max_pixels, header_bytes=args.header_bytes, reads_in_flight=args.reads_in_flight,
        files_per_task=args.files_per_task, progress=not args.no_progress, shard_window=args.shard_window,
        caption_field=args.caption_field, format=args.format, image_column=args.image_column,
        caption_column=args.caption_column,
    )  # fmt: skip
    return ScanJob(
        source=args.source, out=args.out, spec=spec_from_args(args), config=config, storage_options=storage_options,
        captions=args.captions, conditioning=args.conditioning, previous=args.previous, ray_address=args.ray_address,
        masks=parse_masks(args.masks),
        frames=ladder_from_args(args),
    )  # fmt: skip


def run(job: ScanJob) -> ScanResult:
    """Scan, commit the manifest, print the summary line; raises StorageError for permanent storage
    failures (nothing is committed), UsageError for bad input (no images, a bad caption table)."""
    meta = scan_dataset(job)
    print(video_summary_line(meta, job.out) if meta.frame_ladder is not None else summary_line(meta, job.out))
    s = meta.summary
    return ScanResult(
        url=job.out, fingerprint=meta.fingerprint, meta=meta, listed=meta.counts.listed or 0,
        samples=meta.counts.samples, errors=meta.counts.errors, errors_by_kind=dict(s.errors_by_kind or {}),
        ignored=meta.counts.ignored or 0, seconds=s.seconds or 0.0, files_per_s=s.files_per_s or 0.0,
    )  # fmt: skip


def scan_dataset(job: ScanJob) -> ManifestMeta:
    """Scan ``job.source`` into a manifest at ``job.out`` (what :func:`run` does, without the summary
    line); returns the committed ``_manifest.json``. Raises as :func:`run`, and WriterBusyError when another
    job writes ``job.out``."""
    with writer_lock(job.out, job.storage_options, "scan"), counting_throttles():  # one writer per manifest folder
        return _scan(job)


def _throttled(summary: ScanSummary) -> ScanSummary:
    """``summary`` with the job's throttled storage answers so far (all its processes)."""
    tally = job_throttles()
    return replace(summary, throttled=tally.total) if tally is not None else summary


def _inside(out: str, options: dict[str, Any], fs, root: str) -> str | None:
    """``out``'s path relative to the source ``root`` when the manifest is written inside the dataset: its
    parts and writer lock are bucketeer's own files, never listed as the dataset's."""
    out_fs, out_root = open_url(out, options)
    if out_fs.protocol != fs.protocol or not out_root.startswith(root.rstrip("/") + "/"):
        return None
    return out_root[len(root.rstrip("/")) + 1 :]


def _scan(job: ScanJob) -> ManifestMeta:
    started = time.time()
    source, config, options = job.source, job.config, job.storage_options
    fs, root = (job.fs, job.fs._strip_protocol(source).rstrip("/")) if job.fs is not None else \
        open_url(source, options)  # fmt: skip
    try:
        listing = list_source(fs, root, skip=_inside(job.out, options, fs, root))
    except Exception as e:
        if isinstance(e, FileNotFoundError) or is_storage_failure(e):  # retried already; a missing root or bucket
            raise StorageError(redact(f"cannot list {source}: {e}", options)) from None
        raise
    table = load_captions(job.captions, options) if job.captions else None
    target = (source, task_options(source, options, config), job.fs, root)
    if job.frames is not None:
        return _video_scan(job, listing, target, table, started)
    loose, containers = select_kinds(listing, source, config.format)
    column = mask_column(job.masks)
    parquet = config.format == "parquet"
    if job.masks and (parquet and "files" in job.masks.split(",") or not parquet and column is not None):
        raise UsageError(f"--masks {job.masks}: a parquet dataset's mask files are a column (--masks column:NAME, "
                         "with --format parquet); loose files and tar shards take alpha and/or files")  # fmt: skip
    config = replace(config, masks=job.masks)  # the tar shards' tasks read their mask members
    if containers and job.conditioning:
        raise UsageError("--conditioning works on loose image files; this source holds .tar shards or parquet files: "
                         "add --format files to scan only its loose images")  # fmt: skip
    if not (loose or containers):
        raise UsageError(
            f"no image files under {redact(source)} ({listing.ignored} other files ignored"
            f"{': ' + ignored_line(listing.ignored_extensions) if listing.ignored_extensions else ''}); images are "
            f"{_extensions()}, or WebDataset .tar shards. Check the path."
        )
    pairing = resolve(job.conditioning, source, job.captions, options, job.fs) if job.conditioning else None
    excluded = 0
    if pairing is not None:
        listing, excluded = pairing.exclude(listing)
    listing, mask_files = split_mask_files(listing) if job.masks and "files" in job.masks else (listing, MaskFiles({}))
    parts = []
    if loose:
        parts.append(_loose_part(job, listing, target, table, (pairing, excluded), started, mask_files))
    if containers:
        parts.append(container_part(listing, job.out, target, source=source, spec=job.spec, storage_options=options,
                                    table=table, previous=job.previous, config=config, ray_address=job.ray_address,
                                    started=started))  # fmt: skip
    samples, errors, summary, counts = parts[0] if len(parts) == 1 else mixed_part(*parts)
    return write_manifest(
        job.out, samples, errors, source=source, spec=job.spec, storage_options=options, summary=_throttled(summary),
        counts=counts, max_pixels=config.max_pixels, conditioning=pairing.meta() if pairing is not None else None,
        masks=job.masks,
    )  # fmt: skip


def _video_scan(job: ScanJob, listing: Listing, target: tuple, table: CaptionTable | None,
                started: float) -> ManifestMeta:
    """``--frames``: the loose videos (pipeline/scan/video.py) and loose images as 1-frame samples."""
    assert job.frames is not None
    if job.conditioning or job.masks:
        raise UsageError("--frames scans videos (loose, in tar shards, in a parquet column) and loose images: leave "
                         "out --masks and --conditioning")  # fmt: skip
    try:
        import av  # noqa: F401
    except ImportError:
        raise UsageError("--frames reads video headers with PyAV: pip install 'bucketeer[video]'") from None
    fmt = job.config.format  # tar or parquet: only those containers' videos (loose videos ignored)
    loose, _ = select_kinds(listing, job.source, fmt, videos=fmt in ("auto", "files"))
    if not (listing.videos or listing.shards or listing.parquet):
        raise UsageError(f"--frames: no video files (.mp4 .mov .webm .mkv) or .tar shards under {redact(job.source)}; "
                         "check the path, or scan images without --frames")  # fmt: skip
    with ray_session(job.ray_address):  # one Ray for both parts
        no_masks = MaskFiles({})  # --masks is refused above
        images = one_frame(_loose_part(job, listing, target, table, (None, 0), started, no_masks)) if loose else None
        old = previous_manifest(job.out, job.previous, job.storage_options)
        videos = video_part(listing, target, job.config, job.spec, job.frames, table, job.ray_address, old,
                            job.previous or job.out)  # fmt: skip
    samples, errors, summary, counts = video_scan_part(images, videos)
    return write_manifest(
        job.out, samples, errors, source=job.source, spec=job.spec, storage_options=job.storage_options,
        summary=_throttled(summary), counts=counts, max_pixels=job.config.max_pixels, frame_ladder=job.frames.frames,
    )  # fmt: skip


def _loose_part(job: ScanJob, listing: Listing, target: tuple, table: CaptionTable | None,
                conditioning: tuple[Pairing | None, int], started: float, mask_files: MaskFiles) -> ScanPart:
    """The loose image files of ``listing``: probed by Ray tasks, reused where unchanged, paired with
    their conditioning images (``conditioning``: the pairing and the files it took from the listing) and
    their loss masks (``--masks``; ``mask_files``: the mask files taken from the listing)."""
    clock = time.perf_counter()
    config, options, (pairing, excluded) = job.config, job.storage_options, conditioning
    _, _, fs, root = target
    if fs is None:
        fs, root = open_url(job.source, options)
    log.info("listed %d images (%d ignored) in %.1f s", len(listing.images), listing.ignored, listing.seconds)
    plan = plan_rescan(listing, job.out, job.previous, options, config.max_pixels, table)

    # only image headers go to Ray; re-reading a few changed sidecars of reused rows is driver work
    probed = {w.name for w in plan.work if w.probe}  # an image's further sidecars are read in its task
    image_work = [w for w in plan.work if w.name in probed]
    caption_work = [w for w in plan.work if w.name not in probed]
    try:
        results, ray_seconds = run_tasks(scan_batch, target, config, lambda cpus: batches(image_work, config, cpus),
                                         len(image_work), progress=config.progress, ray_address=job.ray_address)
        if caption_work:
            results.append(probe_files(fs, root, caption_work, in_flight=config.reads_in_flight))
    except StorageError as e:
        raise StorageError(redact(str(e), options)) from None
    probed = redacted(pa.concat_tables(results) if results else PROBE_SCHEMA.empty_table(), options)
    images, errors, stats = assemble(listing, plan, probed, table)
    if pairing is not None:
        images, errors, paired = pair(images, errors, set(probed.filter(probed.column("probed")).column("name")
                                                          .to_pylist()), pairing,
                                      conditioning_probe(pairing, options, job.fs, config, job.ray_address))
        stats.update(paired, conditioning_files=excluded)
    if job.masks:
        images = attach_masks(images, probed, job.masks, mask_files)
    samples, too_small = apply_buckets(images, job.spec)
    if job.masks:
        stats.update(mask_counts(samples, len(mask_files.by_stem)))
    errors = pa.concat_tables([errors, too_small, link_error_rows(listing)])
    seconds = time.perf_counter() - clock - ray_seconds
    summary = scan_summary(listing, plan, stats, samples, errors, seconds, started, config, job.captions, table)
    listed = len(listing.images) + len(listing.link_errors)
    return ScanPart(samples, errors, summary, {"listed": listed, "ignored": listing.ignored})


def _extensions() -> str:
    """The image extensions, the common ones first: ``jpg, png, ... and 40 more (bucketeer scan --help)``."""
    common = [e for e in ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "avif", "heic", "jxl")
              if e in IMAGE_EXTENSIONS]  # fmt: skip
    rest = len(IMAGE_EXTENSIONS) - len(common)
    return ", ".join(common) + (f" and {rest} more (bucketeer scan --help)" if rest else "")
