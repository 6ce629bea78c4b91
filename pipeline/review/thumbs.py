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
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Any

import numpy as np

from manifests.annotations import image_key
from manifests.manifest import Manifest
from manifests.storage import open_url
from pipeline.report.thumbs import thumbnails

__all__ = ["ThumbCache", "THUMB_SIZE", "FULL_SIZE"]

THUMB_SIZE = 256  # the grid's cells (long side, pixels)
FULL_SIZE = 2048  # the detail view: "full size" up to this long side (a browser shows no larger on a screen)


class ThumbCache:
    """JPEGs of manifest rows, each encoded once per (sample, image key, size) into ``folder``."""

    def __init__(self, manifest: Manifest, folder: str, storage_options: dict[str, Any] | None = None,
                 keys: np.ndarray | None = None):  # fmt: skip
        """``keys``: the rows' image keys when already computed (:attr:`DecisionLog.image_keys`)."""
        self.manifest, self.folder = manifest, folder
        self.storage_options = dict(storage_options or {})
        self.keys = image_key(manifest.samples) if keys is None else keys  # (n,) uint64
        self.ids = manifest.samples.column("sample_id").to_numpy()
        os.makedirs(folder, exist_ok=True)

    def path(self, position: int, size: int) -> str:
        return os.path.join(self.folder, f"{int(self.ids[position]):016x}-{int(self.keys[position]):016x}-{size}.jpg")

    def jpeg(self, position: int, size: int = THUMB_SIZE) -> bytes | None:
        """Row ``position``'s image as a JPEG, the long side at most ``size``; None when it cannot be read."""
        path = self.path(position, size)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            pass
        row = self.manifest.samples.slice(int(position), 1).to_pylist()[0]
        if (row.get("frames") or 1) > 1:
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
