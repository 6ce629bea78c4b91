"""Loss masks for embed: a sample's mask cropped like its image, then stored at the latent grid.

Where a mask is, the manifest's ``mask`` column says (:data:`manifests.schema.MASK_FIELDS`): ``"alpha"``
is the image's own alpha channel (read from the same bytes), anything else the path of a mask file
relative to the source root (its grey levels; a colour mask is converted to luminance, ``L``). The mask
is transposed by its own EXIF orientation, must then show the image's size in display orientation
(else ``mask_mismatch``: the sample is an error row of the cache, nothing is guessed), and is cut with
exactly the image's resize and crop boxes (area resampling, ``BOX``): :func:`mask_views` gives
``(K, H, W)`` uint8 at the bucket's pixels. The trainer's latent grid is ``f`` times smaller:
:func:`to_latent_grid` area-averages each ``f x f`` block (after the variants' flips, done on the pixels
like the image's) and rounds to uint8 0..255.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, ImageOps

from manifests.schema import MASK_ALPHA
from manifests.storage import join, read_many, redact
from pipeline.embed.imaging import ImageFailure, Prepared, read_failure
from pipeline.embed.parquet_images import fetch_parquet_images
from pipeline.embed.samples import variant_pixels
from pipeline.formats import open_image

__all__ = ["mask_views", "to_latent_grid", "variant_masks", "fetch_masks", "row_mask"]


def _plane(data: bytes, alpha: bool, max_pixels: int, name: str | None) -> Image.Image:
    """The mask as one ``L`` plane in display orientation; ImageFailure ``mask_unusable`` when it cannot be."""
    if not data:
        raise ImageFailure("mask_unusable", "the mask is empty (0 bytes)")
    img, _ = open_image(io.BytesIO(data), data[:16], name)
    if img is None:
        raise ImageFailure("mask_unusable", "no image decoder recognises the mask's bytes")
    if img.width * img.height > max_pixels:
        raise ImageFailure("mask_unusable", f"{img.width}x{img.height} is over the {max_pixels:,}-pixel limit")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = ImageOps.exif_transpose(img)
            if alpha:
                if not (img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info):
                    raise ImageFailure("mask_unusable", f"the image has no alpha channel (mode {img.mode})")
                return img.convert("RGBA").getchannel("A")
            return img.convert("L")
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageFailure("mask_unusable", f"decode failed: {e}") from None


def mask_views(data: bytes, where: str, views: list[Prepared], bucket: tuple[int, int], max_pixels: int,
               name: str | None = None) -> np.ndarray:  # fmt: skip
    """The mask of an image prepared as ``views`` (its crops, :func:`~pipeline.embed.imaging.prepare_views`),
    cut with the same boxes: ``(K, H, W)`` uint8, ``bucket`` = ``(H, W)``.

    ``data``: the mask file's bytes, or the image's own when ``where`` is ``"alpha"``; ``name`` picks the
    plugin of a format without a magic number. Raises ImageFailure ``mask_unusable`` (cannot be decoded, no
    alpha channel) or ``mask_mismatch`` (another size than the image, display orientation).
    """
    plane = _plane(data, where == MASK_ALPHA, max_pixels, name)
    oh, ow = views[0].original_size
    if plane.size != (ow, oh):
        raise ImageFailure("mask_mismatch", f"the mask is {plane.width}x{plane.height}, its image {ow}x{oh} "
                           "(display orientation): a mask must be its image's size")  # fmt: skip
    rh, rw = views[0].resized_size
    sx, sy = ow / rw, oh / rh
    bh, bw = bucket
    out = np.empty((len(views), bh, bw), np.uint8)
    for k, view in enumerate(views):
        top, left = view.crop_top_left
        box = (left * sx, top * sy, (left + bw) * sx, (top + bh) * sy)
        out[k] = np.asarray(plane.resize((bw, bh), Image.Resampling.BOX, box=box), np.uint8)
    return out


def variant_masks(masks: np.ndarray, flips: int, grid: tuple[int, int]) -> np.ndarray:
    """``(b, K, H, W)`` masks of ``b`` images' K crops -> ``(b * K * flips, h, w)`` at the latent grid: the
    variants in the order of :func:`pipeline.embed.samples.variant_pixels` (mirrored like the image), each
    :func:`to_latent_grid`."""
    return to_latent_grid(variant_pixels(masks[..., None], flips)[..., 0], grid)


def to_latent_grid(masks: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """``(n, H, W)`` uint8 pixel masks -> ``(n, h, w)`` uint8 at the latent grid ``(h, w)``: the mean of each
    ``(H / h) x (W / w)`` block, rounded. The sides must divide (a bucket is a multiple of the VAE's factor)."""
    n, H, W = masks.shape
    h, w = grid
    assert H % h == 0 and W % w == 0, f"mask {H}x{W} does not divide into the latent grid {h}x{w}"
    blocks = masks.reshape(n, h, H // h, w, W // w).astype(np.float32)  # (n, h, fy, w, fx)
    return np.rint(blocks.mean(axis=(2, 4))).astype(np.uint8)


def fetch_masks(fs, root: str, rows: list[dict]) -> dict[int, bytes | BaseException]:
    """The bytes of the mask files of ``rows`` (those whose ``mask`` is a path, not ``alpha``), by row
    position, read concurrently (:func:`manifests.storage.read_many`: failures come back as exceptions): a
    loose file whole, a tar member by its byte range in the row's ``container`` (one ranged read)."""
    files = [i for i, r in enumerate(rows) if r.get("mask") and r["mask"] != MASK_ALPHA]
    columns = [i for i in files if _column_of(rows[i])]
    files = [i for i in files if not _column_of(rows[i])]
    out: dict[int, bytes | BaseException] = {}
    for name in {_column_of(rows[i]) for i in columns}:  # parquet: the mask column, by row group like the images
        at = [i for i in columns if _column_of(rows[i]) == name]
        found = fetch_parquet_images(fs, root, [{**rows[i], "size": rows[i]["mask_size"]} for i in at], name)
        out.update(zip(at, found))
    if not files:
        return out
    paths, starts, ends = [], [], []
    for i in files:
        row, offset = rows[i], rows[i].get("mask_offset")
        paths.append(join(root, row["mask"] if offset is None else row["container"]))
        starts.append(0 if offset is None else int(offset))
        ends.append(None if offset is None else int(offset) + int(row["mask_size"]))
    return {**out, **dict(zip(files, read_many(fs, paths, starts, ends)))}


def _column_of(row: dict) -> str | None:
    """The parquet column of a row's mask (``mask`` = ``column:NAME``), else None."""
    mask = row.get("mask") or ""
    return mask[len("column:"):] if mask.startswith("column:") else None


def row_mask(row: dict, blob: bytes | BaseException, views: list[Prepared], bucket: tuple[int, int],
             max_pixels: int, storage_options: dict | None) -> np.ndarray:  # fmt: skip
    """The loss mask of manifest ``row`` cut like its image's ``views`` (:func:`mask_views`): ``blob`` is the
    mask file's bytes or read failure, or the image's own bytes for ``alpha``. Raises ImageFailure
    (``mask_missing`` for a mask file that is gone, ``read_failed``, or :func:`mask_views`' kinds)."""
    where = row["mask"]
    if isinstance(blob, BaseException):
        if isinstance(blob, FileNotFoundError):
            raise ImageFailure("mask_missing", f"mask {where} not found: {redact(str(blob), storage_options)}")
        raise read_failure(blob, storage_options)
    try:
        name = row["filename"] if where == MASK_ALPHA else where
        return mask_views(blob, where, views, bucket, max_pixels, name=name)
    except ImageFailure as e:
        raise ImageFailure(e.kind, f"mask {where}: {e.message}" if where != MASK_ALPHA else e.message) from None
