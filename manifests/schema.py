"""The manifest's columns, in one place, and the stable ``sample_id``.

``samples/*.parquet`` holds one row per usable image; ``errors/*.parquet`` one row per listed image
file that cannot be used. Every listed image is in exactly one of the two.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa

__all__ = [
    "FORMAT_VERSION",
    "SAMPLES_SCHEMA",
    "ERRORS_SCHEMA",
    "ERROR_KINDS",
    "ADDED_COLUMNS",
    "CONTAINER_COLUMNS",
    "CONDITIONING_COLUMNS",
    "MASK_COLUMNS",
    "MASK_ALPHA",
    "MASK_INFIX",
    "VIDEO_COLUMNS",
    "VIDEO_SAMPLES_SCHEMA",
    "VIDEO_ERRORS_SCHEMA",
    "table_schemas",
    "LOCATION_COLUMNS",
    "MAX_PIXELS",
    "sample_id",
    "sample_ids",
    "image_range",
]

FORMAT_VERSION = 1

# The most pixels an image may declare (width x height) to be a sample: Pillow refuses to open an
# image above 2 * Image.MAX_IMAGE_PIXELS (178,956,970 px, ~13.4k x 13.4k), so a larger limit would let
# the scan accept images that no embed can decode. ``scan --max-pixels`` can only lower it; the limit
# a manifest was scanned with is its ``_manifest.json`` ``max_pixels``, and embed decodes up to that.
MAX_PIXELS = 2 * 89_478_485

# Where the bytes of an image inside a container are (null for a loose file): a WebDataset tar shard
# holds them at bytes [member_offset, member_offset + size) of ``container``, so one ranged read
# fetches them (:func:`image_range`); a parquet file (``scan --format parquet``) in row ``row_index``
# of row group ``row_group`` of its image column (the manifest's ``summary.image_column``), ``size``
# being the image's byte length. Parquet gives no byte range of one value: embed reads the image
# column of a row group once for all the rows of a unit in it (the cost is a row group's column
# chunk per unit, not a ranged read per image; pipeline/embed/parquet_images.py).
# ``filename`` of a tar member's row is ``<container>/<member name>``, of a parquet row
# ``<container>/<row>`` with ``row`` its 0-based number in the whole file (over all row groups):
# unique and readable. ``etag`` and ``mtime`` are the container's; ``container_size`` is its size
# in bytes, so that a rescan reuses every row of an unchanged container without reading it.
CONTAINER_FIELDS = (
    pa.field("container", pa.string()),  # the shard or parquet file, relative to the source root
    pa.field("container_size", pa.int64()),  # bytes of the container when scanned
    pa.field("member_offset", pa.int64()),  # tar: byte offset of the image's bytes in the shard
    pa.field("row_group", pa.int32()),  # parquet: row group of the image
    pa.field("row_index", pa.int64()),  # parquet: row within that row group
)
CONTAINER_COLUMNS = tuple(f.name for f in CONTAINER_FIELDS)
# where a row's image is: what image_range and embed's fetch read of a row
LOCATION_COLUMNS = ("filename", "container", "container_size", "member_offset", "row_group", "row_index", "size")

# A paired conditioning image (``scan --conditioning``; ControlNet maps, edit/reference pairs), null without
# one. ``conditioning`` is its path relative to the manifest's conditioning root (``_manifest.json``
# ``conditioning.root``: the same relative path as ``filename`` under another root, or the value of a
# ``--captions`` table column, relative to the source root); its size and ETag/mtime let a rescan and
# embed's source key notice a changed conditioning image. The pair shares the target's bucket.
CONDITIONING_FIELDS = (
    pa.field("conditioning", pa.string()),
    pa.field("conditioning_size", pa.int64()),  # bytes of the conditioning image when scanned
    pa.field("conditioning_etag", pa.string()),
    pa.field("conditioning_mtime", pa.float64()),
)
CONDITIONING_COLUMNS = tuple(f.name for f in CONDITIONING_FIELDS)

# A loss mask (``scan --masks``), null without one: where the sample's mask is. ``"alpha"``: the image's
# own alpha channel (its header declares one: RGBA, LA, a palette with transparency); otherwise the path
# of a mask file beside the image, relative to the source root (``a/b.mask.png`` for ``a/b.jpg``:
# :data:`MASK_INFIX`), or for a tar member the mask member beside it in the same shard
# (``<shard>/<key>.mask.png``, as ``filename``) at bytes [mask_offset, mask_offset + mask_size) of
# ``container``: one ranged read. Grey levels 0..255 (255 = inside, where the loss counts); embed stores it
# at the latent grid (``SampleRecord.mask``). Mask files and members are never samples themselves.
MASK_FIELDS = (
    pa.field("mask", pa.string()),
    pa.field("mask_offset", pa.int64()),  # tar: byte offset of the mask member's bytes in the shard
    pa.field("mask_size", pa.int64()),  # bytes of the mask file or member when scanned
    pa.field("mask_etag", pa.string()),  # a mask file's ETag / mtime: a changed mask re-embeds its sample
    pa.field("mask_mtime", pa.float64()),
)
MASK_COLUMNS = tuple(f.name for f in MASK_FIELDS)
MASK_ALPHA = "alpha"
MASK_INFIX = ".mask"  # the mask of <stem>.<ext> is <stem>.mask.<any image extension>
# A video manifest's rows (``scan --frames``; manifests/frames.py); an image manifest has no such columns. ``width`` and
# ``height`` are the display size; ``bucket`` is ``WxHxF``. ``frames`` is the frame count, how it was
# found in ``frame_count_from`` (index | tag | duration*fps: pipeline/sources/video.py), ``clips`` the
# non-overlapping clips of the bucket's frame count the video holds (``clip_starts`` where they begin,
# when they were cut at scene changes). An image there has frames 1, clips 1.
VIDEO_FIELDS = (
    pa.field("frames", pa.int32()),
    pa.field("fps", pa.float64()),
    pa.field("duration", pa.float64()),  # seconds
    pa.field("codec", pa.string()),  # FFmpeg's decoder name: h264, hevc, vp9, av1, ...
    pa.field("frame_count_from", pa.string()),
    pa.field("clips", pa.int32()),
    # each clip's first frame when the clips were cut inside shots (bucketeer rebucket --scenes); null: clip i
    # starts at frame i * F (fixed strides)
    pa.field("clip_starts", pa.list_(pa.int32())),
    # with clip_starts, when the shots were captioned (annotate --task scenes,caption): each clip's index into the
    # row's captions (caption when it has one), the caption of the shot it lies in; null otherwise
    pa.field("clip_captions", pa.list_(pa.int32())),
)
VIDEO_COLUMNS = tuple(f.name for f in VIDEO_FIELDS)

# what incremental rescans and audits need comes after the five contract columns
SAMPLES_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.uint64(), nullable=False),
        pa.field("filename", pa.string(), nullable=False),  # relative to the source root, '/'-separated
        pa.field("width", pa.int32(), nullable=False),  # display orientation (after EXIF orientation)
        pa.field("height", pa.int32(), nullable=False),
        pa.field("caption", pa.string()),  # null when the image has none
        pa.field("bucket", pa.string(), nullable=False),  # "WxH"
        pa.field("size", pa.int64(), nullable=False),  # bytes of the image file
        pa.field("etag", pa.string()),  # object-store ETag, when the store gives one
        pa.field("mtime", pa.float64()),  # seconds since the epoch, when the store gives one
        pa.field("format", pa.string()),  # Pillow's format name: JPEG, PNG, WEBP, ...
        pa.field("orientation", pa.int8()),  # EXIF orientation tag 1..8 (1 when absent)
        pa.field("bytes_read", pa.int64()),  # how much of the file the scan read
        pa.field("caption_source", pa.string()),  # version of what gave the caption (below)
        # every caption of the sample when it has more than one (caption == captions[0]); null otherwise
        pa.field("captions", pa.list_(pa.string())),
        *CONTAINER_FIELDS,
        *CONDITIONING_FIELDS,
        *MASK_FIELDS,
    ]
)

ERRORS_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.uint64(), nullable=False),
        pa.field("filename", pa.string(), nullable=False),
        pa.field("error", pa.string(), nullable=False),  # one of ERROR_KINDS
        pa.field("message", pa.string(), nullable=False),
        pa.field("size", pa.int64()),
        pa.field("etag", pa.string()),
        pa.field("mtime", pa.float64()),
        pa.field("width", pa.int32()),  # known for e.g. too_small / too_many_pixels rejects
        pa.field("height", pa.int32()),
        pa.field("caption", pa.string()),  # kept so a rebucket can bring a reject back
        pa.field("format", pa.string()),
        pa.field("orientation", pa.int8()),
        pa.field("bytes_read", pa.int64()),
        pa.field("caption_source", pa.string()),
        # every caption of the sample when it has more than one (caption == captions[0]); null otherwise
        pa.field("captions", pa.list_(pa.string())),
        *CONTAINER_FIELDS,
        *CONDITIONING_FIELDS,
        *MASK_FIELDS,
    ]
)

# a video manifest's tables (scan --frames): the image tables and VIDEO_FIELDS; image manifests never have them
VIDEO_SAMPLES_SCHEMA = pa.schema([*SAMPLES_SCHEMA, *VIDEO_FIELDS])
VIDEO_ERRORS_SCHEMA = pa.schema([*ERRORS_SCHEMA, *VIDEO_FIELDS])


def table_schemas(video: bool) -> tuple[pa.Schema, pa.Schema]:
    """``(samples, errors)`` schemas of an image manifest, or of a video one (``_manifest.json`` ``frame_ladder``)."""
    return (VIDEO_SAMPLES_SCHEMA, VIDEO_ERRORS_SCHEMA) if video else (SAMPLES_SCHEMA, ERRORS_SCHEMA)


# ``caption_source``: the exact version of what the caption was taken from, so that a rescan
# re-reads a caption exactly when its source changed (never by timestamps):
#   "sidecar:<size>:<etag, else mtime>:<sidecar path>"  a .txt/.caption file (path relative to the
#                                                       root, last, so a ':' in it is unambiguous)
#   "table:<version>"                                   the --captions table; version = hash of its
#                                                       {filename: caption} content
#   "member:<container>:<member name>"                  a .txt/.caption/.json member of a tar shard
#   "column:<container>:<column>"                       the caption column of a parquet file
#   "sidecars:<v1>|<v2>|..."                            numbered sidecars (img.txt, img.1.txt, ...): the
#                                                       sidecar versions above, joined in caption order
#   null                                                no caption source, or a sidecar that could not
#                                                       be read, or a manifest written before the column
#                                                       existed: unknown, read again on the next scan

# nullable columns added after FORMAT_VERSION 1 shipped: parts written before lack them and read as nulls
ADDED_COLUMNS = frozenset({"caption_source", "captions", *CONTAINER_COLUMNS, *CONDITIONING_COLUMNS, *MASK_COLUMNS})

ERROR_KINDS = (
    "empty",  # zero bytes
    "truncated",  # a known format whose header ends early
    "not_an_image",  # bytes that no decoder recognises (HTML named .jpg, random bytes)
    "unsupported",  # an image format Pillow knows but bucketeer cannot use
    "invalid_header",  # a header declaring what no image has: a side below 1 or beyond 64 bits
    "too_many_pixels",  # above the manifest's max_pixels: declared (scan, never decoded) or decoded (embed)
    "too_small",  # shorter side below the bucket spec's min_side
    "read_failed",  # storage refused or lost the object
    "decode_failed",  # (embed) the full decode failed although the header was fine
    "duplicate_key",  # a tar shard key (WebDataset sample) with more than one image member
    "corrupt_container",  # a tar shard whose headers stop making sense; members after that point are unread
    "conditioning_missing",  # (scan --conditioning) the sample's conditioning image is not there
    "conditioning_mismatch",  # its size (display orientation) differs from the image's
    "conditioning_unusable",  # its header cannot be read (the message gives the kind: truncated, not_an_image, ...)
    "broken_link",  # a symbolic link (or a tar shard's link member) to nothing there
    "link_loop",  # a symbolic link that leads back to itself
    "mask_missing",  # (embed) the sample's mask file is not there any more
    "mask_mismatch",  # (embed) its mask's size (display orientation) differs from the image's
    "mask_unusable",  # (embed) its mask cannot be decoded (the message gives the kind)
    "not_a_video",  # (scan --frames) a video file PyAV cannot open, or one without a video stream
    "too_short",  # (scan --frames) fewer frames than the shortest frame bucket (rebucket --scenes: no shot that long)
    "no_scenes",  # (rebucket --scenes) a video without an up-to-date scenes annotation (annotate --task scenes)
)


def sample_id(filename: str) -> int:
    """Stable uint64 id of a sample: the first 8 bytes (big-endian) of blake2b(relative path).

    The path is relative to the dataset root and ``/``-separated, so the id survives moving the
    dataset between buckets or machines. 2^64 ids make a collision among 10^9 files ~3e-2 %
    likely; the scan checks for collisions and fails loudly.
    """
    digest = hashlib.blake2b(filename.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def sample_ids(filenames: Iterable[str]) -> np.ndarray:
    """:func:`sample_id` for many names, as a uint64 array."""
    return np.fromiter((sample_id(f) for f in filenames), dtype=np.uint64)


def image_range(row: Mapping[str, Any]) -> tuple[str, int | None, int | None]:
    """Where a manifest row's image bytes are: ``(path relative to the root, start, end)`` in bytes.

    A loose file is read whole (``start`` and ``end`` None); a tar member is bytes
    ``[member_offset, member_offset + size)`` of its ``container``: one ranged read. ``row`` needs
    ``filename`` and, for rows of containers, ``container``, ``member_offset`` and ``size``.
    Raises ValueError for a row of a parquet file (``row_group`` set): no byte range holds one
    value of a parquet column; it is read by row group (see the comment on CONTAINER_FIELDS).
    """
    container = row.get("container")
    if container is None:
        return row["filename"], None, None
    offset = row.get("member_offset")
    if offset is None:
        what = "a parquet row, read by row group," if row.get("row_group") is not None else "a container row"
        raise ValueError(f"{row['filename']}: {what} has no byte range (member_offset is null)")
    return container, int(offset), int(offset) + int(row["size"])
