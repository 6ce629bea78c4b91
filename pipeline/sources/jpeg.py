"""A JPEG's header from byte ranges, skipping the bodies of EXIF and ICC segments.

A camera JPEG carries 10-60 KB of EXIF (maker notes, a thumbnail) and often an ICC profile before
its frame header; read sequentially, they are most of the bytes a header probe reads. The size is in
the frame header and the orientation in the EXIF block's first directory, near the block's start.
:func:`sparse_jpeg_header` walks the segments by their lengths, reads of an EXIF or ICC segment only
its first :data:`KEEP` bytes and stands zeros in for the rest (never read), and hands the result to
:func:`pipeline.sources.parsers.parse_jpeg`, which reads nothing in those bodies but the EXIF block's
first directory. The answer is Pillow's exactly when that directory lies within the kept bytes, which
is checked (:func:`~pipeline.sources.parsers.exif_orientation` on the kept bytes alone must be sure);
otherwise, and for anything unusual, the caller probes the usual way.
"""

from __future__ import annotations

from typing import Callable

from pipeline.sources.parsers import UNSURE, exif_orientation, parse_jpeg
from pipeline.sources.results import Header

__all__ = ["KEEP", "sparse_jpeg_header"]

KEEP = 4096  # bytes read of a skipped segment: its signature and the EXIF block's first directory
_SKIPPABLE = {0xE1: b"Exif\0\0", 0xE2: b"ICC_PROFILE\0"}
_MAX_SEGMENTS = 512


def sparse_jpeg_header(read_range: Callable[[int, int], bytes], size: int, head: bytes, window: int) -> Header | None:
    """Size and orientation of the JPEG of ``size`` bytes whose first bytes are ``head``, or None to probe it
    the usual way. ``read_range(start, end)`` fetches more, at least ``window`` bytes a time. Storage
    exceptions propagate."""
    buf = bytearray(head)  # the file's bytes from offset 0, zeros standing in for skipped bodies

    def have(end: int) -> bool:
        end = min(end, size)
        while len(buf) < end:
            data = read_range(len(buf), min(size, max(end, len(buf) + window)))
            if not data:
                return False
            buf.extend(data)
        return True

    pos = 2
    for _ in range(_MAX_SEGMENTS):
        if not have(pos + 4) or len(buf) < pos + 4 or buf[pos] != 0xFF:
            return None
        marker, length = buf[pos + 1], (buf[pos + 2] << 8) | buf[pos + 3]
        end = pos + 2 + length
        signature = _SKIPPABLE.get(marker)
        if signature and end > len(buf) + window and have(pos + 4 + KEEP) and buf.startswith(signature, pos + 4):
            kept = min(end, pos + 4 + KEEP)
            if marker == 0xE1 and exif_orientation(bytes(buf[pos + 10 : kept])) is UNSURE:
                return None  # its first directory is not within the kept bytes (or is unusual)
            del buf[kept:]
            buf.extend(bytes(end - kept))
        elif not have(end) or len(buf) < end:
            return None
        if marker == 0xDA:
            return parse_jpeg(bytes(buf[:end]))
        pos = end
    return None
