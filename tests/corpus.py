"""An awkward-case image corpus for the scan tests, with its ground truth.

Every image's expected ``(width, height)`` is what Pillow's full decode followed by
``ImageOps.exif_transpose`` gives, computed here after the file is written; broken files carry
the error kind the scan must report. Images are tiny so the corpus builds in well under a second.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

W, H = 40, 24  # not square, so a missed orientation swap shows


@dataclass
class Corpus:
    root: Path
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)  # usable image -> display size
    errors: dict[str, str] = field(default_factory=dict)  # broken image -> error kind
    captions: dict[str, str | None] = field(default_factory=dict)  # usable image -> expected caption
    ignored: list[str] = field(default_factory=list)  # files the scan must skip (and count)

    @property
    def images(self) -> list[str]:
        return sorted([*self.sizes, *self.errors])


def _pixels(mode: str = "RGB", w: int = W, h: int = H, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(arr, "RGB").convert(mode) if mode != "RGB" else Image.fromarray(arr, "RGB")


def _exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_declaring(width: int, height: int) -> bytes:
    """A small PNG whose IHDR declares ``width x height`` (a decompression bomb's header)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def _save(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def truth(data: bytes) -> tuple[int, int]:
    """Ground truth: full decode, then the EXIF orientation applied."""
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        return ImageOps.exif_transpose(im).size


def make_corpus(root: Path) -> Corpus:
    """Write the corpus under ``root`` and return what the scan must find."""
    c = Corpus(root)

    def put(rel: str, data: bytes) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def image(rel: str, data: bytes, caption: bytes | None = None, expect_caption: str | None = None) -> None:
        put(rel, data)
        c.sizes[rel] = truth(data)
        c.captions[rel] = None
        if caption is not None:
            put(rel.rsplit(".", 1)[0] + ".txt", caption)
            c.captions[rel] = expect_caption

    def broken(rel: str, data: bytes, kind: str) -> None:
        put(rel, data)
        c.errors[rel] = kind

    base = _pixels()
    for k in range(1, 9):
        image(f"orient/jpeg_o{k}.jpg", _save(base, "JPEG", exif=_exif(k)))
    image("orient/png_o6.png", _save(base, "PNG", exif=_exif(6)))
    image("orient/webp_o6.webp", _save(base, "WEBP", exif=_exif(6)))
    image("orient/webp_o8_lossless.webp", _save(base, "WEBP", lossless=True, exif=_exif(8)))
    image("orient/tiff_o6.tif", _save(base, "TIFF", exif=_exif(6)))
    image("orient/tiff_o5.TIFF", _save(base, "TIFF", exif=_exif(5)))

    # a frame header far from the start: 300 KB of ICC profile before SOF (Pillow splits it in APP2s)
    image("jpeg/far_header.jpg", _save(base, "JPEG", icc_profile=os.urandom(300_000), exif=_exif(6)))
    image("jpeg/progressive.jpg", _save(_pixels(w=64, h=48), "JPEG", progressive=True))
    image("jpeg/gray.jpeg", _save(base.convert("L"), "JPEG"))
    image("jpeg/cmyk.JPG", _save(base.convert("CMYK"), "JPEG"))
    image("png/16bit.png", _save(Image.fromarray(np.full((H, W), 40000, np.uint16)), "PNG"))
    image("png/palette.png", _save(base.convert("P"), "PNG"))
    image("webp/lossy.webp", _save(_pixels(w=50, h=30), "WEBP"))
    image("webp/lossless.webp", _save(_pixels(w=30, h=50), "WEBP", lossless=True))
    frames = [_pixels(w=32, h=20, seed=i).convert("P") for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    image("gif/animated.gif", buf.getvalue())
    image("bmp/plain.bmp", _save(_pixels(w=33, h=17), "BMP"))

    # names: unicode, spaces, %&+, deep folders, upper-case extensions
    image("ünïcødé/日本語 画像.png", _save(base, "PNG"))
    image("odd names/a b%20c&d+e.jpg", _save(base, "JPEG"))
    image("/".join(f"d{i}" for i in range(10)) + "/deep.jpg", _save(base, "JPEG"))
    image("UPPER.JPEG", _save(base, "JPEG"))

    # captions: BOM, CRLF, trailing blanks, latin-1 bytes, blank, .caption, missing
    small = _save(base, "JPEG")
    image("cap/bom.jpg", small, "\ufeffa red fox".encode(), "a red fox")
    image("cap/crlf.jpg", small, b"first line\r\nsecond  line\r\n", "first line second line")
    image("cap/trailing.jpg", small, b"  a cat   \n\n  \t", "a cat")
    image("cap/latin1.jpg", small, "café crème".encode("latin-1"), "café crème")
    image("cap/blank.jpg", small, b" \r\n\t ", None)
    image("cap/unicode.jpg", small, "ein Bär 🐻".encode(), "ein Bär 🐻")
    put("cap/other.caption", b"from a .caption file\n")
    image("cap/other.jpg", small)
    c.captions["cap/other.jpg"] = "from a .caption file"
    image("cap/missing.jpg", small)

    # broken files
    exif_jpeg = _save(base, "JPEG", exif=_exif(3))
    broken("bad/truncated.jpg", exif_jpeg[:100], "truncated")
    broken("bad/truncated.png", _save(base, "PNG")[:20], "truncated")
    broken("bad/empty.jpg", b"", "empty")
    broken("bad/random.jpg", b"\x13\x37" + np.random.default_rng(1).bytes(5000), "not_an_image")
    broken("bad/page.jpg", b"<!DOCTYPE html><html><body>404 Not Found</body></html>\n", "not_an_image")
    broken("bad/bomb.png", png_declaring(60000, 60000), "too_many_pixels")

    # not images, or hidden: listed by the store, skipped (and counted) by the scan
    for rel, data in {
        ".hidden.jpg": small,
        "cap/._bom.jpg": b"\x00\x05\x16\x07AppleDouble",
        ".cache/thumb.jpg": small,
        "notes.md": b"# notes\n",
        "data.json": b"{}",
    }.items():
        put(rel, data)
        c.ignored.append(rel)
    return c
