"""Fetch image bytes, decode them (EXIF transpose, RGB), resize to cover a bucket and crop it.

An image is fetched with one read: a loose file whole, an image inside a tar shard by its byte range;
images inside parquet files by row group (:mod:`pipeline.embed.parquet_images`: one read of the image
column of a row group for all the rows asked for in it).

Geometry follows SDXL's micro-conditioning: sizes are ``(height, width)``, the crop position is
``(top, left)`` in the pixels of the resized image (the image scaled so that it just covers the
bucket). A seeded random crop depends only on ``(seed, sample_id)``, never on processing order.

An image is decoded when its pixel count is within the manifest's ``max_pixels`` (the limit the
scan accepted it under, :data:`manifests.schema.MAX_PIXELS` at most): it is opened the way the scan
opens it (:func:`pipeline.formats.open_image`, with the same optional format plugins registered, and
no Pillow bomb check), so every format the scan accepted decodes here and Pillow's own threshold never
refuses what the manifest accepted; Pillow's settings are left as they are.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from manifests.errors import StorageError, UsageError
from manifests.schema import MAX_PIXELS, image_range
from manifests.retry import is_transient
from manifests.storage import join, open_url, read_many, redact
from pipeline.embed.parquet_images import fetch_parquet_images, is_parquet_row
from pipeline.formats import open_image

__all__ = ["ImageFailure", "Prepared", "check_source", "cover_and_crop", "crop_resized", "open_source", "prepare_views",
           "fetch_all", "fetch_images", "read_failure", "conditioning_views"]

_EXIF_ORIENTATION = 0x0112


class ImageFailure(Exception):
    """An image that cannot be embedded: ``kind`` is a manifests.schema.ERROR_KINDS kind."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def read_failure(exc: BaseException, storage_options: dict | None) -> ImageFailure:
    """The ``read_failed`` ImageFailure of a read that failed (credentials redacted)."""
    # a transient error here has outlived every retry; a permanent one was never retried
    note = " (still failing after retries)" if is_transient(exc) else ""
    return ImageFailure("read_failed", redact(f"{type(exc).__name__}: {exc}{note}", storage_options))


@dataclass(frozen=True)
class Prepared:
    """One decoded, resized and cropped image: ``pixels`` uint8 ``(bucket_h, bucket_w, 3)``."""

    pixels: np.ndarray
    original_size: tuple[int, int]  # (h, w), display orientation
    resized_size: tuple[int, int]  # (h, w) after resize-to-cover
    crop_top_left: tuple[int, int]  # (top, left) in resized pixels


def cover_and_crop(
    size: tuple[int, int], bucket: tuple[int, int], crop: str = "center", seed: int = 0, sample_id: int = 0,
    index: int | None = None,
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Resized ``(h, w)`` covering ``bucket`` ``(h, w)`` at the image's aspect, and the crop ``(top, left)``.

    ``index``: the ``index``-th of several random crops (``embed --crops K``), drawn from
    ``(seed, sample_id, index)`` whatever ``crop`` says. Raises ValueError for an unknown ``crop``
    policy (``center`` or ``random``).
    """
    h, w = size
    bh, bw = bucket
    scale = max(bh / h, bw / w)
    rh, rw = max(bh, round(h * scale)), max(bw, round(w * scale))
    if index is not None:
        rng = np.random.default_rng([seed, sample_id & 0xFFFFFFFF, sample_id >> 32, index])
        return (rh, rw), (int(rng.integers(0, rh - bh + 1)), int(rng.integers(0, rw - bw + 1)))
    if crop == "center":
        return (rh, rw), ((rh - bh) // 2, (rw - bw) // 2)
    if crop == "random":
        rng = np.random.default_rng([seed, sample_id & 0xFFFFFFFF, sample_id >> 32])
        return (rh, rw), (int(rng.integers(0, rh - bh + 1)), int(rng.integers(0, rw - bw + 1)))
    raise UsageError(f"--crop must be 'center' or 'random', got {crop!r}")


def _open(data: bytes, max_pixels: int, name: str | None = None) -> Image.Image:
    if not data:
        raise ImageFailure("empty", "the file has zero bytes")
    try:
        img, problems = open_image(io.BytesIO(data), data[:16], name)  # the name picks TGA, IM, PCD
    except Image.DecompressionBombError as e:  # a plugin that checks while opening (WebP): above MAX_PIXELS
        raise ImageFailure("too_many_pixels", str(e)) from None
    if img is None:
        unreadable = [e for _, e in problems if isinstance(e, (OSError, EOFError))]
        if unreadable:
            raise ImageFailure("truncated", f"header unreadable: {unreadable[0]}")
        raise ImageFailure("not_an_image", "no image decoder recognises these bytes")
    if img.width * img.height > max_pixels:
        raise ImageFailure("too_many_pixels", f"{img.width}x{img.height} is over the manifest's "
                           f"{max_pixels:,}-pixel limit (scan --max-pixels)")
    return img


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        # composite transparency on white: convert("RGB") would turn transparent pixels black
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def prepare_views(
    data: bytes,
    bucket: tuple[int, int],
    *,
    crop: str = "center",
    seed: int = 0,
    sample_id: int = 0,
    max_pixels: int = MAX_PIXELS,
    crops: int = 1,
    at: list[tuple[int, int]] | None = None,
    size: tuple[int, int] | None = None,
    name: str | None = None,
    out: tuple[int, int] | None = None,
) -> list[Prepared]:
    """Decode ``data`` once and return crops of ``bucket`` ``(h, w)`` from it resized to cover the bucket.

    ``max_pixels`` is the manifest's limit (``Manifest.max_pixels``). Raises ImageFailure (kind +
    message) for bytes that cannot become an image, or an image of more pixels.
    ``crops``: 1 is the ``crop`` policy's crop; K > 1 gives K random crops (``cover_and_crop``
    ``index`` 0..K-1: reproducible from ``(seed, sample_id)``). ``at``: the crops' ``(top, left)``
    given instead (a conditioning image gets its target's), with ``size`` the ``(h, w)`` the image
    must show (display orientation; ImageFailure ``conditioning_mismatch`` otherwise). ``name``: the
    file's name, which picks the plugin of a format without a magic number (TGA, IM, PCD). ``out``: each crop's
    pixels resized to ``(h, w)`` instead of the bucket's, in the same single pass from the full-resolution decode
    (no reduced JPEG decode): a reference as an edit pipeline resizes its input image once.
    """
    img = _open(data, max_pixels, name)
    try:
        orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception:  # a broken EXIF block is not a broken image
        orientation = 1
    swap = orientation in (5, 6, 7, 8)
    stored_w, stored_h = img.size
    original = (stored_w, stored_h) if swap else (stored_h, stored_w)  # (h, w) in display orientation
    if size is not None and original != tuple(size):
        raise ImageFailure("conditioning_mismatch", f"is {original[1]}x{original[0]}, its image "
                           f"{size[1]}x{size[0]}: re-scan the pair")  # fmt: skip
    if at is not None:
        resized = cover_and_crop(original, bucket)[0]
        tops_lefts = list(at)
    else:
        views = [cover_and_crop(original, bucket, crop, seed, sample_id, None if crops == 1 else k)
                 for k in range(crops)]  # fmt: skip
        resized, tops_lefts = views[0][0], [v[1] for v in views]
    try:
        with warnings.catch_warnings():
            # the size passed the manifest's limit: Pillow's warning above half its threshold says nothing new
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            # JPEG: decode at 1/2, 1/4 or 1/8 scale when that still covers the resized size (much faster)
            if out is None:
                img.draft("RGB", (resized[0], resized[1]) if swap else (resized[1], resized[0]))
            img = ImageOps.exif_transpose(img) if orientation != 1 else img
            img = _to_rgb(img)
    except Image.DecompressionBombError as e:
        raise ImageFailure("too_many_pixels", str(e)) from None
    except OSError as e:
        kind = "truncated" if "truncat" in str(e).lower() else "decode_failed"
        raise ImageFailure(kind, f"decode failed: {e}") from None
    except (ValueError, SyntaxError) as e:
        raise ImageFailure("decode_failed", f"decode failed: {e}") from None
    return [Prepared(pixels=crop_resized(img, resized, (top, left), bucket, out), original_size=original,
                     resized_size=resized, crop_top_left=(top, left)) for top, left in tops_lefts]


def crop_resized(img: Image.Image, resized: tuple[int, int], top_left: tuple[int, int],
                 bucket: tuple[int, int], out: tuple[int, int] | None = None) -> np.ndarray:
    """The ``bucket`` ``(h, w)`` crop at ``top_left`` of ``img`` resized to ``resized`` ``(h, w)``: uint8
    ``(h, w, 3)`` (``out`` ``(h, w)``: that region at this size instead). The crop region is resampled straight
    from ``img`` (one Lanczos pass, whatever size ``img`` has: a draft-reduced JPEG, a video frame), never the
    whole resized image."""
    sx, sy = img.width / resized[1], img.height / resized[0]
    (bh, bw), (top, left) = bucket, top_left
    oh, ow = out or bucket
    box = (left * sx, top * sy, (left + bw) * sx, (top + bh) * sy)
    return np.asarray(img.resize((ow, oh), Image.Resampling.LANCZOS, box=box), dtype=np.uint8)  # (oh, ow, 3)


def conditioning_views(row: dict, blob, views: list, bucket: tuple[int, int], max_pixels: int,
                       storage_options: dict | None, out: tuple[int, int] | None = None) -> np.ndarray:
    """The conditioning image of ``row`` cropped exactly like its target's ``views``: (K, H, W, 3) uint8
    (``out``: each crop's region resized once from the full-resolution image to ``(h, w)``: (K, h, w, 3)).

    Raises ImageFailure naming the conditioning image (a missing one is ``conditioning_missing``)."""
    path = row["conditioning"]
    if not path:  # a manifest row of a paired manifest without its pair cannot be: the scan made it an error
        raise ImageFailure("conditioning_missing", "no conditioning image in its manifest row")
    try:
        if isinstance(blob, BaseException):
            if isinstance(blob, FileNotFoundError):
                raise ImageFailure("conditioning_missing", f"not found: {redact(str(blob), storage_options)}")
            raise read_failure(blob, storage_options)
        cond = prepare_views(blob, bucket, max_pixels=max_pixels, at=[v.crop_top_left for v in views],
                             size=views[0].original_size, name=path, out=out)  # fmt: skip
    except ImageFailure as e:
        raise ImageFailure(e.kind, f"conditioning image {path}: {e.message}") from None
    return np.stack([c.pixels for c in cond])  # (K, H, W, 3)


def fetch_all(fs, paths: list[str], *, threads: int = 16) -> list[bytes | BaseException]:
    """Read whole objects, many in flight; failures come back as exceptions, in path order.

    :func:`manifests.storage.read_many`: one concurrent ``cat_ranges`` (open ends: one GET per
    object; ``cat`` would first expand the paths, a HEAD or LIST each on S3), then each failed
    read retried on its own: a transient error (throttling, timeout, reset, 5xx) is retried with
    backoff, so one flaky moment never becomes an error row; a permanent one (access denied, no
    such key or bucket) comes back at once.
    """
    return read_many(fs, paths, threads=threads)


def fetch_images(
    fs, root: str, rows: list[dict], *, image_column: str | None = None, threads: int = 16
) -> list[bytes | BaseException]:
    """The image bytes of manifest ``rows`` under ``root``, as :func:`fetch_all` (failures as exceptions, in order).

    A loose file is read whole; an image inside a tar shard with one ranged read of its bytes
    (:func:`manifests.schema.image_range`), never the shard; images of a parquet file by row group
    (:func:`pipeline.embed.parquet_images.fetch_parquet_images`, ``image_column`` being the
    manifest's ``summary.image_column``). Rows need ``filename`` and, from a container-sourced
    manifest, the other :data:`manifests.schema.LOCATION_COLUMNS`. Raises UsageError for parquet
    rows without ``image_column``.
    """
    in_parquet = [i for i, r in enumerate(rows) if is_parquet_row(r)]
    if in_parquet and not image_column:
        raise UsageError(f"{rows[in_parquet[0]]['filename']} is a parquet row, but the manifest names no image "
                         "column (summary.image_column); rescan the source with --format parquet")
    ranged = [i for i in range(len(rows)) if not is_parquet_row(rows[i])]
    ranges = [image_range(rows[i]) for i in ranged]
    results: list[bytes | BaseException] = [b""] * len(rows)
    found = read_many(fs, [join(root, path) for path, _, _ in ranges], [start or 0 for _, start, _ in ranges],
                      [end for _, _, end in ranges], threads=threads)  # fmt: skip
    for i, blob in zip(ranged, found):
        results[i] = blob
    if in_parquet:
        blobs = fetch_parquet_images(fs, root, [rows[i] for i in in_parquet], str(image_column), threads=threads)
        for i, blob in zip(in_parquet, blobs):
            results[i] = blob
    return results


def open_source(source: str, storage_options: dict | None, fs=None):
    """``(fs, root)`` of the dataset; a given ``fs`` (tests, benchmarks) takes ``source`` as its path."""
    if fs is not None:
        return fs, fs._strip_protocol(source).rstrip("/")
    return open_url(source, storage_options)


def check_source(source: str, storage_options: dict | None, rows: list[dict], fs=None,
                 image_column: str | None = None) -> None:  # fmt: skip
    """Refuse a dataset whose storage is unusable: raise StorageError when every one of the images
    of ``rows`` (a few manifest rows spread over the job, with :data:`manifests.schema.LOCATION_COLUMNS`,
    read with the usual retries) fails to read.

    One unreadable file is that file's error row; all of them failing means the bucket is gone,
    access is denied or the endpoint is down, and a job would only write an error row per
    sample. The message quotes the first failure (credentials redacted) and names the file.
    """
    if not rows:
        return
    fs, root = open_source(source, storage_options, fs)
    blobs = fetch_images(fs, root, rows, image_column=image_column)
    failures = [(r["filename"], b) for r, b in zip(rows, blobs) if isinstance(b, BaseException)]
    if len(failures) < len(rows):
        return
    name, first = failures[0]
    raise StorageError(redact(
        f"cannot read the images of {source}: all {len(rows)} probed files failed, e.g. {name}: "
        f"{type(first).__name__}: {first}. Nothing was embedded; check that the dataset is still there "
        "(--source if it moved) and the credentials/--storage-options allow reading it.", storage_options))
