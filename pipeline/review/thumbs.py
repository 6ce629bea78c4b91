"""The review page's images: JPEGs of manifest rows, read as embed reads them, cached on a local disk.

    cache = ThumbCache(manifest, "decisions/thumbs", storage_options)
    cache.jpeg(position, size=256)      # bytes, or None when the image cannot be read

Only a manifest row (by its position) is ever read: the page sends a sample id, the server finds its row,
and the row's location (loose file, tar member, parquet cell; S3 by ranged reads) is read by
:func:`pipeline.report.thumbs.thumbnails`, the report's reader over embed's
(:func:`pipeline.embed.imaging.fetch_images`); a video's first frame by PyAV over ranged reads, as the
report's contact sheets read it (:func:`pipeline.report.video.decode_frames`). A cached file is named by
the sample id, the row's image key (size and etag or mtime: :func:`manifests.annotations.image_key`) and
the size, so a rescan that saw the image change reads it again.

Decodes are bounded: a JPEG is decoded at a reduced scale (Pillow's draft mode, never more than twice the
size asked for), any other format whole, so one larger than :data:`PREVIEW_PIXELS` is refused
(:class:`PreviewRefused`, a 422 with its reason) before a byte is read; and at most :data:`DECODES` rows are
read and decoded at once, whatever the number of requests (a 6000x6000 RGBA PNG decoded whole for a
thumbnail peaks at ~690 MiB; one of 16 MP at ~300 MiB).
"""

from __future__ import annotations

import io
import os
import tempfile
import threading
from typing import Any

import numpy as np

from manifests.annotations import image_key
from manifests.manifest import Manifest
from manifests.storage import open_url
from pipeline.report.thumbs import thumbnails

__all__ = ["ThumbCache", "PreviewRefused", "THUMB_SIZE", "FULL_SIZE", "PREVIEW_PIXELS", "DECODES"]

THUMB_SIZE = 256  # the grid's cells (long side, pixels)
FULL_SIZE = 2048  # the detail view: "full size" up to this long side (a browser shows no larger on a screen)
PREVIEW_PIXELS = 16_000_000  # a non-JPEG image decoded whole for a preview: 16 MP of RGBA peak at ~300 MiB
DECODES = 2  # rows read and decoded at once, over every request
_DRAFTED = {"JPEG", "MPO"}  # formats Pillow decodes at a reduced scale (draft mode)


class PreviewRefused(Exception):
    """A row the page does not decode (too many pixels for its format); the message says why."""


class ThumbCache:
    """JPEGs of manifest rows, each encoded once per (sample, image key, size) into ``folder``."""

    def __init__(self, manifest: Manifest, folder: str, storage_options: dict[str, Any] | None = None,
                 keys: np.ndarray | None = None):  # fmt: skip
        """``keys``: the rows' image keys when already computed (:attr:`DecisionLog.image_keys`)."""
        self.manifest, self.folder = manifest, folder
        self.storage_options = dict(storage_options or {})
        self.keys = image_key(manifest.samples) if keys is None else keys  # (n,) uint64
        self.ids = manifest.samples.column("sample_id").to_numpy()
        self.decoding = threading.BoundedSemaphore(DECODES)
        os.makedirs(folder, exist_ok=True)

    def path(self, position: int, size: int) -> str:
        return os.path.join(self.folder, f"{int(self.ids[position]):016x}-{int(self.keys[position]):016x}-{size}.jpg")

    def jpeg(self, position: int, size: int = THUMB_SIZE) -> bytes | None:
        """Row ``position``'s image as a JPEG, the long side at most ``size``; None when it cannot be read.
        Raises PreviewRefused for a non-JPEG of more than :data:`PREVIEW_PIXELS`."""
        path = self.path(position, size)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            pass
        row = self.manifest.samples.slice(int(position), 1).to_pylist()[0]
        pixels = int(row.get("width") or 0) * int(row.get("height") or 0)
        video = (row.get("frames") or 1) > 1
        if not video and str(row.get("format") or "").upper() not in _DRAFTED and pixels > PREVIEW_PIXELS:
            raise PreviewRefused(f"too large to preview: {row.get('format') or 'this format'} at {pixels / 1e6:.0f} "
                                 f"MP is decoded whole, and the page decodes at most {PREVIEW_PIXELS / 1e6:.0f} MP")
        with self.decoding:  # at most DECODES rows in memory at once, whatever the requests
            if video:
                data = self._video_frame(row, size)
            else:
                (data,) = thumbnails(self.manifest, [row], self.storage_options, size=size, image_format="JPEG")
        if data is None:
            return None
        fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # two requests for one image: either file is whole
        return data

    def _video_frame(self, row: dict, size: int) -> bytes | None:
        """A video row's first frame (PyAV over ranged reads, as the report's contact sheets read it)."""
        from pipeline.embed.job import image_column
        from pipeline.report.video import decode_frames, video_reader

        fs, root = open_url(self.manifest.source, self.storage_options)
        try:
            read_range, nbytes = video_reader(fs, root, row, image_column(self.manifest.meta))
            (image,), _ = decode_frames(read_range, nbytes, (0,), long_side=size)
        except Exception:  # PyAV's errors by version, a failed read: the page shows "cannot be read"
            return None
        buf = io.BytesIO()
        image.convert("RGB").save(buf, "JPEG", quality=85)
        return buf.getvalue()
