"""Sample thumbnails for the report: read as embed and annotate read images, and shown in grids.

:func:`thumbnails` reads manifest rows' images with one read each (loose file, tar member, parquet
row: :func:`pipeline.embed.imaging.fetch_images`), decodes them upright (EXIF) and downscales the
long side; :class:`ThumbGrid` is a row of them with a label and a detail line each, which the page
renders as small inline images (:func:`grid_html`), not as figures.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from typing import Any

from manifests.manifest import Manifest
from manifests.schema import MAX_PIXELS
from manifests.storage import open_url

__all__ = ["THUMB_PIXELS", "GRID_PIXELS", "Thumb", "ThumbGrid", "thumbnails", "grid_html", "GRID_CSS"]

THUMB_PIXELS = 192  # the caption grid's thumbnails (PNG figures)
GRID_PIXELS = 128  # the score and duplicate grids' thumbnails (JPEG, inline: a page holds a few hundred)


def thumbnails(manifest: Manifest, rows: list[dict], storage_options: dict[str, Any] | None, *,
               size: int = THUMB_PIXELS, image_format: str = "PNG") -> list[bytes | None]:  # fmt: skip
    """``image_format`` (PNG or JPEG) thumbnails of ``rows`` (manifest rows), the long side at most
    ``size`` pixels; None where an image cannot be read or decoded."""
    from pipeline.annotate.workers import decode_for_caption
    from pipeline.embed.imaging import ImageFailure, fetch_images
    from pipeline.embed.job import image_column

    if not rows:
        return []
    fs, root = open_url(manifest.source, storage_options)
    blobs = fetch_images(fs, root, rows, image_column=image_column(manifest.meta))
    out: list[bytes | None] = []
    for row, blob in zip(rows, blobs):
        try:
            if isinstance(blob, BaseException):
                raise ImageFailure("read_failed", str(blob))
            image = decode_for_caption(blob, row["width"], row["height"], size,
                                       int(manifest.max_pixels or MAX_PIXELS), row["filename"])  # fmt: skip
        except ImageFailure:
            out.append(None)
            continue
        buf = io.BytesIO()
        image.save(buf, image_format, **({"quality": 85} if image_format == "JPEG" else {}))
        out.append(buf.getvalue())
    return out


@dataclass(frozen=True)
class Thumb:
    sample_id: int
    label: str  # the filename
    detail: str  # e.g. "aesthetic 0.913", "keeper", "similarity 0.987"
    image: bytes | None  # JPEG; None: the image could not be read (shown as a grey box)


@dataclass(frozen=True)
class ThumbGrid:
    name: str  # unique on the page: the element id is "grid-<name>"
    title: str
    thumbs: list[Thumb] = field(default_factory=list)


GRID_CSS = """
.grid { margin-top: 16px; background: #fff; padding: 10px; box-shadow: 0 1px 2px rgba(0,0,0,.08); }
.grid h3 { margin: 0 0 8px; font-size: 13px; }
.thumbs { display: flex; flex-wrap: wrap; gap: 8px; }
.thumb { margin: 0; width: 132px; padding: 0; box-shadow: none; }
.thumb img, .thumb .missing { width: 128px; height: 128px; object-fit: contain; background: #eceef2; display: block; }
.thumb figcaption { font-size: 11px; margin-top: 2px; word-break: break-all; }
.thumb.keeper img { outline: 3px solid #3b6fb6; }
"""


def grid_html(grid: ThumbGrid) -> str:
    """One grid: a heading and its thumbnails in order, each with its filename and detail line."""
    esc = html.escape
    out = [f'<div class="grid" id="grid-{esc(grid.name)}"><h3>{esc(grid.title)}</h3><div class="thumbs">']
    for thumb in grid.thumbs:
        keeper = " keeper" if thumb.detail == "keeper" else ""
        out.append(f'<figure class="thumb{keeper}" data-sample-id="{thumb.sample_id}">')
        if thumb.image is None:
            out.append('<div class="missing">unreadable</div>')
        else:
            src = "data:image/jpeg;base64," + base64.b64encode(thumb.image).decode("ascii")
            out.append(f'<img alt="{esc(thumb.label)}" src="{src}">')
        out.append(f"<figcaption>{esc(thumb.label)}<br>{esc(thumb.detail)}</figcaption></figure>")
    out.append("</div></div>")
    return "".join(out)
