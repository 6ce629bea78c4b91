"""Which kinds of files a scan reads (``--format``); the files of the other kinds are counted as ignored.

``auto`` (the default) reads loose image files and the members of ``.tar`` shards into one manifest
(a mixed folder: Pillow's test images and one ``hopper.tar``); ``files`` only loose images, ``tar``
only shards, ``parquet`` only the image column of ``.parquet`` files. What a scan does not read is
counted under its extension in ``ignored_extensions`` (``tar``, ``parquet``, ``jpg``, ...), never
dropped. A compressed shard (``.tar.gz``/``.tgz``) cannot be read by byte range: ``--format tar``
refuses it with what to do, every other scan counts it as ignored and the summary line says what to
do once; a source of nothing but compressed shards, or parquet files, is refused with the option or
step that scans it.
"""

from __future__ import annotations

from manifests.errors import UsageError
from manifests.storage import redact
from pipeline.sources.containers import compressed_shards_message
from pipeline.sources.listing import Listing, extension

__all__ = ["select_kinds"]


def _ignore(listing: Listing, key: str, n: int = 1) -> None:
    if n:
        listing.ignored_extensions[key] = listing.ignored_extensions.get(key, 0) + n


def select_kinds(listing: Listing, source: str, fmt: str, *, videos: bool = False) -> tuple[bool, bool]:
    """Keep in ``listing`` the kinds of files ``--format fmt`` scans and count the others as ignored.

    Returns ``(loose, containers)``: whether there are loose images (or their link errors) to scan,
    and containers (tar shards; with ``parquet``, parquet files). Raises UsageError, saying what
    to do, when the source holds nothing the format reads but compressed shards or parquet files,
    or when ``--format tar`` meets a compressed shard. Video files are counted as ignored unless ``videos``
    (``--frames``: :mod:`pipeline.scan.video` scans them).
    """
    if not videos:
        for entry in listing.videos:
            _ignore(listing, extension(entry.name))
        listing.videos = []
    if fmt == "tar" and listing.compressed_shards:
        raise UsageError(compressed_shards_message(listing.compressed_shards, source))
    if fmt == "auto" and listing.compressed_shards and not (listing.images or listing.link_errors or
                                                            listing.shards or listing.parquet):  # fmt: skip
        raise UsageError(compressed_shards_message(listing.compressed_shards, source))
    if fmt != "parquet":
        _parquet_files_ignored(listing, source)
    for name in listing.compressed_shards:
        _ignore(listing, "tgz" if name.lower().endswith(".tgz") else "tar.gz")
    listing.compressed_shards = []
    if fmt in ("tar", "parquet"):
        for entry in listing.images:
            _ignore(listing, extension(entry.name))
        for _, kind, _ in listing.link_errors:
            _ignore(listing, f"({kind.replace('_', ' ')})")
        listing.images, listing.link_errors = [], []
    if fmt in ("files", "parquet"):
        _ignore(listing, "tar", len(listing.shards))
        listing.shards = []
    if fmt == "parquet" and not listing.parquet:
        raise UsageError(f"--format parquet: no .parquet files under {redact(source)}; check the path")
    if fmt == "tar" and not listing.shards:
        raise UsageError(f"--format tar: no .tar shards under {redact(source)}; check the path")
    containers = listing.parquet if fmt == "parquet" else listing.shards
    return bool(listing.images or listing.link_errors), bool(containers)


def _parquet_files_ignored(listing: Listing, source: str) -> None:
    """Without --format parquet, parquet files are other files (a caption table beside images, the
    per-shard metadata img2dataset writes), unless they are all the source holds: then the user most
    likely meant to scan them."""
    if not listing.parquet:
        return
    if not (listing.images or listing.link_errors or listing.shards or listing.compressed_shards):
        raise UsageError(
            f"{redact(source)} holds {len(listing.parquet)} .parquet files (e.g. {listing.parquet[0].name}) and "
            "no image files or tar shards: to scan the images inside them, add --format parquet --image-column "
            "COLUMN (binary image bytes, or a HuggingFace Image struct) and, if they have captions, "
            "--caption-column COLUMN"
        )
    _ignore(listing, "parquet", len(listing.parquet))
    listing.parquet = []
