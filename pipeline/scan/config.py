"""How a scan reads: :class:`ScanConfig`, the tuning and source-format options of ``bucketeer scan``,
checked once where they are built."""

from __future__ import annotations

from dataclasses import dataclass

from manifests.errors import UsageError
from manifests.schema import MAX_PIXELS
from pipeline.sources.headers import FIRST_READ
from pipeline.sources.tar import SHARD_WINDOW

__all__ = ["FORMATS", "ScanConfig"]

FORMATS = ("auto", "files", "tar", "parquet")  # --format (see pipeline/scan/kinds.py)


@dataclass(frozen=True, kw_only=True)
class ScanConfig:
    """Tuning of the scan; the defaults (those of the command line) suit a 2-64 core cluster reading from S3.

    Raises UsageError, naming the option, for a count below 1, a ``max_pixels`` above :data:`MAX_PIXELS`,
    an unknown ``format``, or parquet columns without ``format="parquet"``.
    """

    max_pixels: int = MAX_PIXELS  # declared pixel count above this -> too_many_pixels (recorded in the manifest)
    header_bytes: int = FIRST_READ  # first ranged read per image
    reads_in_flight: int = 128  # storage requests in flight per Ray task (object stores)
    files_per_task: int | None = None  # None: enough tasks to keep every CPU busy 4 times over
    progress: bool = True  # a bar on a terminal, else a line every $BUCKETEER_PROGRESS_SECONDS
    shard_window: int = SHARD_WINDOW  # tar shards: bytes read at each member header
    caption_field: str = "caption"  # tar shards: the field of a key's .json member that holds its caption
    format: str = "auto"  # auto: loose images and tar shards; files, tar or parquet: only that kind
    image_column: str = "image"  # parquet: the column of image bytes (binary, or HF's {"bytes", "path"} struct)
    caption_column: str | None = None  # parquet: the column of captions (None: no captions)
    masks: str | None = None  # --masks: "alpha", "files" or "alpha,files" (pipeline/scan/masks.py)

    def __post_init__(self) -> None:
        for name in ("max_pixels", "header_bytes", "reads_in_flight", "shard_window"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
        if self.format not in FORMATS:
            raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.format != "parquet" and (self.caption_column or self.image_column != "image"):
            raise UsageError("--image-column and --caption-column are for parquet sources: add --format parquet")
        if self.max_pixels > MAX_PIXELS:
            raise UsageError(f"--max-pixels {self.max_pixels:,} is above {MAX_PIXELS:,}: Pillow refuses to decode "
                             "larger images, so embed could not use them; the option can only lower the limit")
