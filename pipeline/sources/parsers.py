"""Fast header parsers for the common formats: the answer Pillow would give, for a fraction of its cost.

:func:`parse_jpeg` walks a JPEG's segments in the bytes of the first ranged read, and
:func:`exif_orientation` / :func:`xmp_orientation` read the orientation the way Pillow's
``getexif()`` does. They answer only when the bytes are plainly well formed and everything they
need is in hand; on anything unusual (a segment Pillow would refuse, fill bytes, a second EXIF
block, an MPO index, a header past the first read) they return None and the caller asks Pillow,
so a parsed size is always Pillow's (``tests/test_scan_parsers.py`` checks this differentially).

:func:`parse_webp` reads RIFF chunks through a seekable reader, because Pillow's WebP plugin reads
the whole file: the canvas size from ``VP8X`` (or the first frame's header) and the orientation
from the ``EXIF`` chunk, else the ``XMP`` one, reached by seeking past the image data.

Sizes are as stored; :func:`pipeline.sources.headers.checked` applies the orientation and checks
every value before it reaches a table.
"""

from __future__ import annotations

import re
import struct
from typing import IO

from PIL import Image

from pipeline.sources.results import Header

__all__ = ["UNSURE", "parse_jpeg", "exif_orientation", "xmp_orientation", "parse_webp"]

UNSURE = object()  # exif_orientation: Pillow must decide

_ORIENTATION = 0x0112
# Pillow's getexif() falls back to this XMP pattern when EXIF has no orientation tag
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')
_XMP_PREFIX = b"http://ns.adobe.com/xap/1.0/\x00"
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF, 0xDE})
# segments with a length that Pillow's JPEG plugin reads (standalone markers and 0xC8 are left to it)
_SEGMENTS = _SOF | {0xC4, 0xCC, 0xDB, 0xDC, 0xDD, 0xDF, 0xFE} | set(range(0xE0, 0xF0))


def parse_jpeg(head: bytes) -> Header | None:
    """Size and orientation of the JPEG whose first bytes are ``head``, or None to ask Pillow.

    Walks the segments up to the start of scan as Pillow's plugin does (the last frame header
    gives the size), refusing whatever Pillow would refuse or treat specially.
    """
    n = len(head)
    pos = 2
    size = exif = xmp = None
    while True:
        if pos + 4 > n or head[pos] != 0xFF:
            return None  # the header runs past the first read, or junk between segments
        marker = head[pos + 1]
        if marker != 0xDA and marker not in _SEGMENTS:
            return None  # fill bytes, a standalone marker or an unknown one
        length = (head[pos + 2] << 8) | head[pos + 3]
        end = pos + 2 + length
        if length < 2 or end > n:
            return None
        if marker == 0xDA:
            break
        start = pos + 4
        if marker in _SOF:
            # precision 8, 1/3/4 components: anything else Pillow refuses ("cannot handle ...")
            if length < 8 or head[start] != 8 or head[start + 5] not in (1, 3, 4):
                return None
            size = ((head[start + 3] << 8) | head[start + 4], (head[start + 1] << 8) | head[start + 2])
        elif marker == 0xE1:
            if head.startswith(b"Exif\0\0", start, end):
                if exif is not None:
                    return None  # Pillow joins several EXIF segments into one block
                exif = head[start + 6 : end]
            elif head.startswith(_XMP_PREFIX, start, end):
                xmp = head[start + len(_XMP_PREFIX) : end]
        elif marker == 0xE2:
            if head.startswith(b"MPF\0", start, end):
                return None  # an MPO: Pillow reads its picture index
            if head.startswith(b"ICC_PROFILE\0", start, end) and length - 2 < 14:
                return None
        elif marker in (0xE0, 0xEE):  # JFIF and Adobe segments: Pillow reads a 16-bit field at offset 5
            if head.startswith(b"JFIF" if marker == 0xE0 else b"Adobe", start, end) and length - 2 < 7:
                return None
        elif marker == 0xED:
            if head.startswith(b"Photoshop 3.0\0", start, end):
                return None  # Pillow parses its resource blocks, and fails on some
        elif marker == 0xDB and not _quantization_tables_ok(head, start, end):
            return None
        pos = end
    if size is None:
        return None
    orientation = exif_orientation(exif) if exif is not None else None
    if orientation is UNSURE:
        return None
    if orientation is None and xmp:
        orientation = xmp_orientation(xmp)
    return Header(width=size[0], height=size[1], format="JPEG", orientation=1 if orientation is None else orientation)


def _quantization_tables_ok(head: bytes, pos: int, end: int) -> bool:
    while pos < end:  # each table: a precision/id byte, then 64 values of 1 or 2 bytes; Pillow refuses a short one
        pos += 1 + (64 if head[pos] < 16 else 128)
        if pos > end:
            return False
    return True


# bytes per value of each TIFF field type (BYTE, ASCII, SHORT, LONG, RATIONAL, ... , IFD)
_TIFF_TYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4}


def exif_orientation(block: bytes) -> int | None | object:
    """The orientation tag of an EXIF block's first directory (the TIFF structure after
    ``Exif\\0\\0``): its value, None when the block has none, :data:`UNSURE` when the block is
    not one a plain parse can read exactly as Pillow does."""
    if not block:
        return None  # Pillow reads an empty block as no tags
    if block.startswith(b"Exif\0\0") or len(block) < 8:
        return UNSURE
    order = {b"II*\0": "<", b"MM\0*": ">"}.get(block[:4])
    if order is None:
        return UNSURE
    (ifd,) = struct.unpack_from(order + "L", block, 4)
    if ifd < 8 or ifd + 2 > len(block):
        return UNSURE
    (count,) = struct.unpack_from(order + "H", block, ifd)
    entries = block[ifd + 2 : ifd + 2 + 12 * count]
    if len(entries) < 12 * count:
        return UNSURE
    found = None
    for tag, kind, values, value in struct.iter_unpack(order + "HHL4s", entries):
        size = _TIFF_TYPE_SIZES.get(kind, 0) * values
        if size > 4 and struct.unpack_from(order + "L", value)[0] + size > len(block):
            return UNSURE  # any value stored past the block's end: Pillow then drops the whole directory
        if tag != _ORIENTATION:
            continue
        if found is not None or values != 1 or kind not in (3, 4):
            return UNSURE  # a repeated tag, or a value that is not one SHORT or LONG
        found = struct.unpack_from(order + ("H" if kind == 3 else "L"), value)[0]
    return found


def xmp_orientation(xmp: bytes) -> int | None:
    """``tiff:Orientation`` in an XMP packet, read as Pillow's ``getexif()`` reads it; else None."""
    match = _XMP_ORIENTATION.search(xmp)
    return int(match[2]) if match else None


def parse_webp(reader: IO[bytes]) -> Header:
    """Size and orientation of a WebP file read through the seekable ``reader`` (see the module doc)."""
    # RIFF: "RIFF" u32 size "WEBP", then chunks: fourcc, u32 little-endian size, payload padded to even
    reader.seek(12)
    width = height = None
    exif = xmp = None
    flags = 0
    while True:
        head = reader.read(8)
        if len(head) < 8:
            break
        fourcc, length = head[:4], struct.unpack("<I", head[4:])[0]
        start = reader.tell()
        if fourcc == b"VP8X":
            payload = reader.read(10)
            if len(payload) < 10:
                break
            flags = payload[0]
            width = 1 + int.from_bytes(payload[4:7], "little")
            height = 1 + int.from_bytes(payload[7:10], "little")
        elif fourcc == b"VP8 " and width is None:
            payload = reader.read(10)
            if len(payload) < 10 or payload[3:6] != b"\x9d\x01\x2a":
                return Header(error="not_an_image", format="WEBP", message="WebP VP8 chunk without a frame header")
            width = struct.unpack("<H", payload[6:8])[0] & 0x3FFF
            height = struct.unpack("<H", payload[8:10])[0] & 0x3FFF
        elif fourcc == b"VP8L" and width is None:
            payload = reader.read(5)
            if len(payload) < 5 or payload[0] != 0x2F:
                return Header(error="not_an_image", format="WEBP", message="WebP VP8L chunk without its signature")
            bits = int.from_bytes(payload[1:5], "little")
            width, height = 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
            flags |= 0x10 if bits >> 28 & 1 else 0  # alpha_is_used, as VP8X's alpha flag
        elif fourcc == b"EXIF" and exif is None:
            exif = reader.read(length)
        elif fourcc == b"XMP " and xmp is None:
            xmp = reader.read(length)
        # VP8X flags say which metadata chunks follow the image data: 0x08 EXIF, 0x04 XMP
        wanted = (exif is None and flags & 0x08) or (xmp is None and flags & 0x04)
        if width is not None and not wanted:
            break
        reader.seek(start + length + (length & 1))  # skip the payload (image data) without reading it
    if width is None:
        return Header(error="truncated", format="WEBP", message="WebP ends before its frame header")
    # VP8X flag 0x10: the image has alpha (an ALPH chunk or a VP8L image that uses it)
    return Header(width=width, height=height, format="WEBP", orientation=_orientation(exif, xmp),
                  alpha=bool(flags & 0x10))  # fmt: skip


def _orientation(exif: bytes | None, xmp: bytes | None) -> object:
    """Orientation from an EXIF block and an XMP packet, as Pillow's ``getexif()`` finds it."""
    value = None
    if exif:
        try:
            tags = Image.Exif()
            tags.load(exif)
            value = tags.get(_ORIENTATION)
        except Exception:  # a broken EXIF block is not a broken image: embed reads it as orientation 1 too
            return 1
    if value is None and xmp:
        value = xmp_orientation(xmp)
    return 1 if value is None else value
