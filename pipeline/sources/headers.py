"""Read an image's size and EXIF orientation from its first bytes, never its pixels.

:func:`probe_header` gets a ``read_range(start, end) -> bytes`` callable (one ranged GET on an
object store), the file size and usually the first read already done (``head``: the caller
fetches many of those at once, see :mod:`pipeline.sources.reading`). JPEG and WebP are parsed here
(:mod:`pipeline.sources.parsers`, the same answer as Pillow at a fraction of the cost); every other
format, and any JPEG the fast parser is unsure of, is identified by Pillow from those bytes
(:func:`pipeline.formats.open_image`). When Pillow asks for bytes further on (a frame header behind
a large ICC/XMP segment, a TIFF whose IFD is at the end) the :class:`RangeReader` fetches just
that range, doubling the fetch size on sequential misses, so a 400 KiB header costs a handful of
requests and the pixel data is never read. Plugins that need the whole file (AVIF, HEIF, JPEG XL)
get it, up to :data:`MAX_HEADER_BYTES`: a larger file of theirs is ``unsupported``.

Whatever a parser reports goes through :func:`pipeline.sources.results.checked` (display orientation,
the pixel limit, every value validated), so a file's problem stays that file's error row.
"""

from __future__ import annotations

import io
from typing import Callable

from PIL import Image

from manifests.schema import MAX_PIXELS
from pipeline.formats import format_name, named_format, open_image
from pipeline.sources.parsers import parse_jpeg, parse_webp, xmp_orientation
from pipeline.sources.results import Header, Probe, checked

__all__ = ["FIRST_READ", "MAX_HEADER_BYTES", "RangeReader", "StorageFailure", "probe_header"]

FIRST_READ = 64 * 1024
MAX_HEADER_BYTES = 64 * 1024 * 1024  # most a probe reads of one file; no header needs more
_EXIF_ORIENTATION = 0x0112
_SWAPS_SIDES = {5, 6, 7, 8}
# containers Pillow has no decoder for (without plugins); reported as unsupported, not not_an_image
_OTHER_IMAGE_SIGNATURES = {
    b"ftypheic": "HEIC",
    b"ftypheix": "HEIC",
    b"ftypmif1": "HEIF",
    b"ftypavif": "AVIF",
    b"\x00\x00\x00\x0cJXL ": "JPEG XL",
    b"\xff\x0a": "JPEG XL",
}


class StorageFailure(Exception):
    """A ranged read failed in storage (not in the image); carries the original exception."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


class RangeReader(io.RawIOBase):
    """A seekable, read-only file over ``read_range(start, end)``; fetches only what is read.

    ``head`` is the file's first bytes when they were fetched already. The first miss fetches
    ``first_read`` bytes; a miss right after the last fetch (sequential reading) fetches twice
    the previous amount, any other miss ``first_read`` bytes again. Reads stop at
    ``max_bytes`` fetched in all (``capped``); a fetch is at most ``max_fetch`` bytes, and with
    ``keep_chunks`` only that many fetched chunks besides the head are kept (a decoder reading a
    video forward then holds a few chunks, not the file). ``bytes_read`` and ``requests`` count what
    storage delivered. A storage exception is re-raised as :class:`StorageFailure` and kept in
    ``failure``, so no image decoder can mistake it for a broken file.
    """

    def __init__(
        self,
        read_range: Callable[[int, int], bytes],
        size: int,
        first_read: int = FIRST_READ,
        *,
        head: bytes | None = None,
        max_bytes: int = MAX_HEADER_BYTES,
        max_fetch: int = 64 * 1024 * 1024,
        keep_chunks: int | None = None,
    ):
        super().__init__()
        self._read_range = read_range
        self.size = size
        self.first_read = max(16, first_read)
        self.max_bytes = max_bytes
        self.max_fetch, self.keep_chunks = max_fetch, keep_chunks
        self._chunks: list[tuple[int, bytes]] = []  # (start, data), non-overlapping
        self._pos = 0
        self._next_fetch = self.first_read
        self._last_end = -1
        self.bytes_read = 0
        self.requests = 0
        self.hit_eof = False  # a read asked for bytes past the end of the file
        self.capped = False  # a read asked for more than max_bytes in all
        self.failure: BaseException | None = None
        self.head = b""
        if head is not None:
            self._store(0, head, len(head))
            self.requests, self.bytes_read = 1, len(head)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def _store(self, start: int, data: bytes, asked: int) -> None:
        if len(data) < asked:  # the object is shorter than listed (changed under us)
            self.size = start + len(data)
        if start == 0 and not self._chunks:
            self.head = data
        self._chunks.append((start, data))
        if self.keep_chunks is not None and len(self._chunks) > self.keep_chunks + 1:
            del self._chunks[1 if self._chunks[0][0] == 0 else 0]  # the oldest, but the head

    def _fetch(self, start: int, want: int) -> None:
        sequential = start == self._last_end
        amount = max(want, self._next_fetch if sequential else self.first_read)
        end = min(self.size, start + amount, start + self.max_bytes - self.bytes_read)
        if end <= start:
            self.capped = True
            return
        try:
            data = self._read_range(start, end)
        except Exception as e:  # storage, not image: must not be swallowed by a decoder
            self.failure = e
            raise StorageFailure(e) from e
        self.requests += 1
        self.bytes_read += len(data)
        self._store(start, data, end - start)
        self._last_end = start + len(data)
        self._next_fetch = min(2 * amount, self.max_fetch) if sequential else min(self.first_read * 2, self.max_fetch)

    def _cached(self, pos: int) -> tuple[bytes, int] | None:
        for start, data in self._chunks:
            if start <= pos < start + len(data):
                return data, pos - start
        return None

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.size - self._pos
        pos = self._pos
        if pos + n <= len(self.head):  # the common case: inside the first read
            self._pos = pos + n
            return self.head[pos : pos + n]
        out = bytearray()
        while n > 0:
            if self._pos >= self.size:
                self.hit_eof = True
                break
            hit = self._cached(self._pos)
            if hit is None:
                self._fetch(self._pos, n)
                hit = self._cached(self._pos)
                if hit is None:  # zero bytes came back (the object ends here), or the cap is reached
                    self.hit_eof = not self.capped
                    break
            data, offset = hit
            piece = data[offset : offset + n]
            out += piece
            self._pos += len(piece)
            n -= len(piece)
        return bytes(out)

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def probe_header(
    read_range: Callable[[int, int], bytes],
    size: int,
    *,
    max_pixels: int = MAX_PIXELS,
    first_read: int = FIRST_READ,
    head: bytes | None = None,
    name: str | None = None,
) -> Probe:
    """Probe one image file of ``size`` bytes through ``read_range(start, end)`` (end exclusive).

    ``head``: the file's first ``first_read`` bytes, when the caller has read them already; ``name``:
    the file's name, which picks the plugin of a format without a magic number (TGA, IM, PCD).
    Returns a checked :class:`~pipeline.sources.results.Probe`; unusable files give an ``error``
    kind (``empty``, ``truncated``, ``not_an_image``, ``unsupported``, ``invalid_header``,
    ``too_many_pixels``) and a message. Never raises for the file's content; raises
    :class:`StorageFailure` when storage fails, so the caller can retry or record ``read_failed``.
    """
    if size <= 0:
        return checked(Header(error="empty", message="the file is empty (0 bytes)"), max_pixels)
    reader = RangeReader(read_range, size, first_read, head=head)
    try:
        header = _parse(reader, name)
    except StorageFailure:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # untrusted bytes can make any parser fail (a Rust plugin's panic is a
        header = _failed(reader, f"{type(e).__name__}: {e}")  # BaseException); never the whole scan
    if reader.failure is not None:  # a decoder swallowed the storage error; surface it
        raise StorageFailure(reader.failure)
    if reader.capped and header.error is not None:
        header = Header(error="unsupported", format=header.format,
                        message=f"no header within the first {MAX_HEADER_BYTES >> 20} MiB of the file "
                        f"({size:,} bytes); not read further")  # fmt: skip
    return checked(header, max_pixels, bytes_read=reader.bytes_read, requests=reader.requests)


def _parse(reader: RangeReader, name: str | None) -> Header:
    reader.read(16)  # makes sure the first read is in hand
    head = reader.head
    signature = head[:16]
    if signature.startswith(b"\xff\xd8\xff"):
        header = parse_jpeg(head)
        if header is not None:
            return header
    elif len(signature) >= 12 and signature[:4] == b"RIFF" and signature[8:12] == b"WEBP":
        return parse_webp(reader)
    return _parse_with_pillow(reader, signature, name)


def _parse_with_pillow(reader: RangeReader, signature: bytes, name: str | None = None) -> Header:
    im, problems = open_image(reader, signature, name)  # reads the header only: nothing is decoded here
    if im is not None:
        width, height = im.size
        orientation = _orientation(im)
        if im.format == "TIFF" and orientation in _SWAPS_SIDES:
            # Pillow's TIFF plugin already reports the displayed size (it transposes on load);
            # undo that here so every format leaves the parser with the stored size
            width, height = height, width
        alpha = im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info
        return Header(width=width, height=height, format=format_name(im.format), orientation=orientation,
                      alpha=alpha)  # fmt: skip
    if reader.hit_eof or (problems and reader.size <= len(signature)):
        fmt = problems[0][0] if problems else "image"
        message = f"{fmt} header ends early: the file is cut off at {reader.size} bytes"
        return Header(error="truncated", format=fmt, message=message)
    if problems:
        fmt, e = problems[0]
        text = str(e) or type(e).__name__
        unsupported = any(w in text.lower() for w in ("unsupported", "not supported", "unknown"))
        kind = "unsupported" if unsupported else "not_an_image"
        how = f"named .{name.rsplit('.', 1)[-1]}" if name and fmt == named_format(name) else f"{fmt} signature"
        return Header(error=kind, format=fmt, message=f"{how} but Pillow cannot read it as {fmt}: {text}")
    for magic, other in _OTHER_IMAGE_SIGNATURES.items():
        if magic in signature[:16]:
            return Header(error="unsupported", format=other, message=f"{other} image: no decoder for it in this Pillow")
    return _failed(reader, "no image format recognises these bytes")


def _failed(reader: RangeReader, why: str) -> Header:
    if reader.hit_eof:
        return Header(error="truncated", message=f"the file ends early ({reader.size} bytes): {why}")
    return Header(error="not_an_image", message=why + _describe(reader))


def _describe(reader: RangeReader) -> str:
    """What the bytes look like, by kind and size only: a row never quotes a file's content (a link
    to /etc/passwd named .jpg must not put its first line into a manifest)."""
    head = reader.head[:512]
    if head.lstrip().lower().startswith((b"<!doctype", b"<html", b"<?xml", b"{", b"[")):
        kind = "text: HTML/XML/JSON"
    else:  # the last 3 bytes may cut a character in two
        kind = "text" if head and (_printable(head) or (len(head) > 3 and _printable(head[:-3]))) else "binary"
    return f" ({reader.size:,} bytes of {kind})"


def _printable(data: bytes) -> bool:
    try:
        return all(c.isprintable() or c in "\t\r\n" for c in data.decode("utf-8"))
    except UnicodeDecodeError:
        return False


def _orientation(im: Image.Image) -> object:
    """The orientation tag as Pillow's ``getexif()`` gives it (a broken EXIF block reads as 1, as in embed)."""
    try:
        if im.format == "PNG":
            # PngImageFile.getexif() decodes the whole image to look for an eXIf chunk after IDAT;
            # only an eXIf (or XMP) before the pixel data, where the PNG spec puts it, is read here
            exif = Image.Exif()
            if im.info.get("exif"):
                exif.load(im.info["exif"])
            if _EXIF_ORIENTATION in exif:
                return exif[_EXIF_ORIENTATION]
            xmp = im.info.get("XML:com.adobe.xmp")
            if isinstance(xmp, str):
                return xmp_orientation(xmp.encode("utf-8", "surrogatepass")) or 1
            return 1
        return im.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception:
        return 1
