"""Read an image's size and EXIF orientation from its first bytes, never its pixels.

:func:`probe_header` gets a ``read_range(start, end) -> bytes`` callable (one ranged GET on an
object store) and the file size. It reads the first ``first_read`` bytes (64 KiB by default:
enough for the header of almost every JPEG, PNG, WebP, GIF, BMP and TIFF) and lets Pillow
identify the file from them. When Pillow asks for bytes further on (a JPEG whose frame header
sits behind a large ICC/XMP segment, a TIFF whose IFD is at the end) the :class:`RangeReader`
fetches just that range, doubling the fetch size on sequential misses, so a 400 KiB header costs
a handful of requests and the pixel data is never read. WebP is parsed here (Pillow's WebP
plugin reads the whole file): RIFF chunks give the canvas size and the ``EXIF`` chunk, reached by
seeking past the image data.

Width and height are in **display orientation**: EXIF orientations 5-8 (transposed or rotated by
90 degrees) swap them, as ``ImageOps.exif_transpose`` would. A declared pixel count above
``max_pixels`` (at most :data:`manifests.schema.MAX_PIXELS`) is reported as ``too_many_pixels``.
:func:`open_image` is Pillow's ``Image.open`` without its decompression-bomb check, so that the
manifest's limit, not Pillow's, decides; the embed job decodes with it too.
"""

from __future__ import annotations

import io
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, Callable

from PIL import Image

from manifests.errors import StorageError
from manifests.schema import MAX_PIXELS
from manifests.retry import is_permanent, with_retries
from manifests.storage import join, redact
from pipeline.scan.captions import decode_caption

__all__ = [
    "FIRST_READ",
    "Header",
    "RangeReader",
    "StorageFailure",
    "open_image",
    "probe_header",
    "probe_files",
]

FIRST_READ = 64 * 1024
# orientations that rotate by 90 degrees: the displayed image is the stored one transposed
_SWAPS_SIDES = {5, 6, 7, 8}
_EXIF_ORIENTATION = 0x0112
# containers Pillow has no decoder for (without plugins); reported as unsupported, not not_an_image
_OTHER_IMAGE_SIGNATURES = {
    b"ftypheic": "HEIC",
    b"ftypheix": "HEIC",
    b"ftypmif1": "HEIF",
    b"ftypavif": "AVIF",
    b"\x00\x00\x00\x0cJXL ": "JPEG XL",
    b"\xff\x0a": "JPEG XL",
}

Image.init()  # register every plugin once, so identification never imports mid-probe


class StorageFailure(Exception):
    """A ranged read failed in storage (not in the image); carries the original exception."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


@dataclass
class Header:
    """What the probe learnt about one file. ``error`` is None for a usable image."""

    width: int | None = None
    height: int | None = None
    format: str | None = None
    orientation: int = 1
    bytes_read: int = 0
    requests: int = 0
    error: str | None = None  # one of manifests.schema.ERROR_KINDS
    message: str | None = None


class RangeReader(io.RawIOBase):
    """A seekable, read-only file over ``read_range(start, end)``; fetches only what is read.

    The first miss fetches ``first_read`` bytes; a miss right after the last fetch (sequential
    reading) fetches twice the previous amount, any other miss ``first_read`` bytes again.
    ``bytes_read`` and ``requests`` count what storage delivered. A storage exception is
    re-raised as :class:`StorageFailure` and kept in ``failure``, so no image decoder can mistake
    it for a broken file.
    """

    def __init__(self, read_range: Callable[[int, int], bytes], size: int, first_read: int = FIRST_READ):
        super().__init__()
        self._read_range = read_range
        self.size = size
        self.first_read = max(16, first_read)
        self._chunks: list[tuple[int, bytes]] = []  # (start, data), non-overlapping
        self._pos = 0
        self._next_fetch = self.first_read
        self._last_end = -1
        self.bytes_read = 0
        self.requests = 0
        self.hit_eof = False  # a read asked for bytes past the end of the file
        self.failure: BaseException | None = None

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

    def _fetch(self, start: int, want: int) -> None:
        sequential = start == self._last_end
        amount = max(want, self._next_fetch if sequential else self.first_read)
        end = min(self.size, start + amount)
        try:
            data = self._read_range(start, end)
        except Exception as e:  # storage, not image: must not be swallowed by a decoder
            self.failure = e
            raise StorageFailure(e) from e
        self.requests += 1
        self.bytes_read += len(data)
        if len(data) < end - start:  # the object is shorter than listed (changed under us)
            self.size = start + len(data)
        self._chunks.append((start, data))
        self._last_end = start + len(data)
        self._next_fetch = min(2 * amount, 64 * 1024 * 1024) if sequential else self.first_read * 2

    def _cached(self, pos: int) -> tuple[bytes, int] | None:
        for start, data in self._chunks:
            if start <= pos < start + len(data):
                return data, pos - start
        return None

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.size - self._pos
        out = bytearray()
        while n > 0:
            if self._pos >= self.size:
                self.hit_eof = True
                break
            hit = self._cached(self._pos)
            if hit is None:
                self._fetch(self._pos, n)
                hit = self._cached(self._pos)
                if hit is None:  # zero bytes came back: the object ends here
                    self.hit_eof = True
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
) -> Header:
    """Probe one image file of ``size`` bytes through ``read_range(start, end)`` (end exclusive).

    Returns a :class:`Header`; broken files give ``error`` (``empty``, ``truncated``,
    ``not_an_image``, ``unsupported``, ``too_many_pixels``) and a message. Raises
    :class:`StorageFailure` when storage fails, so the caller can retry or record ``read_failed``.
    """
    if size <= 0:
        return Header(error="empty", message="the file is empty (0 bytes)")
    reader = RangeReader(read_range, size, first_read)
    try:
        header = _probe(reader, max_pixels)
    except StorageFailure:
        raise
    except Exception as e:  # untrusted bytes can make any parser fail; never the whole scan
        header = _failed(reader, f"{type(e).__name__}: {e}")
    if reader.failure is not None:  # a decoder swallowed the storage error; surface it
        raise StorageFailure(reader.failure)
    header.bytes_read, header.requests = reader.bytes_read, reader.requests
    return header


def _probe(reader: RangeReader, max_pixels: int) -> Header:
    signature = reader.read(16)
    reader.seek(0)
    if len(signature) >= 12 and signature[:4] == b"RIFF" and signature[8:12] == b"WEBP":
        header = _probe_webp(reader)
    else:
        header = _probe_with_pillow(reader, signature)
    if header.error is None:
        assert header.width is not None and header.height is not None
        if header.width < 1 or header.height < 1:
            message = f"declares a size of {header.width}x{header.height}"
            return Header(format=header.format, error="not_an_image", message=message)
        if header.orientation in _SWAPS_SIDES:
            header.width, header.height = header.height, header.width
        if header.width * header.height > max_pixels:
            header.error = "too_many_pixels"
            header.message = (
                f"declares {header.width}x{header.height} = {header.width * header.height:,} pixels, above the limit "
                f"of {max_pixels:,} (--max-pixels); not decoded"
            )
    return header


def open_image(fp: IO[bytes], signature: bytes) -> tuple[Image.Image | None, list[tuple[str, Exception]]]:
    """``Image.open`` of the seekable ``fp`` (whose first bytes are ``signature``) without Pillow's
    decompression-bomb check: the caller applies the manifest's pixel limit to ``im.size``.

    Returns ``(image, problems)``: the image is lazy (only its header is read), or None when no
    format opens it; ``problems`` are ``(format, exception)`` of formats whose signature matched
    but whose header could not be read. Formats without a signature check (TGA, IM, SPIDER, ...)
    are skipped: they would accept random bytes, and a dataset's .jpg/.png/.webp/.gif/.bmp/.tif
    files all carry a signature.
    """
    problems: list[tuple[str, Exception]] = []
    for fmt in Image.ID:
        factory, accept = Image.OPEN[fmt]
        verdict = accept(signature) if accept else None
        if not verdict or isinstance(verdict, str):
            continue
        fp.seek(0)
        try:
            return factory(fp, ""), problems
        except (SyntaxError, IndexError, TypeError, struct.error, OSError, EOFError, ValueError) as e:
            problems.append((fmt, e))  # the signature matched: remember why it could not be read
    return None, problems


def _probe_with_pillow(reader: RangeReader, signature: bytes) -> Header:
    im, problems = open_image(reader, signature)  # reads the header only: nothing is decoded here
    if im is not None:
        width, height = int(im.size[0]), int(im.size[1])
        orientation = _orientation(im)
        if im.format == "TIFF" and orientation in _SWAPS_SIDES:
            # Pillow's TIFF plugin already reports the displayed size (it transposes on load);
            # undo that here so every format leaves _probe with the stored size
            width, height = height, width
        return Header(width=width, height=height, format=_format_name(im.format or "image"), orientation=orientation)
    if reader.hit_eof or (problems and reader.size <= len(signature)):
        fmt = problems[0][0] if problems else "image"
        message = f"{fmt} header ends early: the file is cut off at {reader.size} bytes"
        return Header(error="truncated", format=fmt, message=message)
    if problems:
        fmt, e = problems[0]
        text = str(e) or type(e).__name__
        unsupported = any(w in text.lower() for w in ("unsupported", "not supported", "unknown"))
        kind = "unsupported" if unsupported else "not_an_image"
        return Header(error=kind, format=fmt, message=f"{fmt} signature but Pillow cannot read it: {text}")
    for magic, name in _OTHER_IMAGE_SIGNATURES.items():
        if magic in signature[:16]:
            return Header(error="unsupported", format=name, message=f"{name} image: no decoder for it in this Pillow")
    return _failed(reader, "no image format recognises these bytes")


def _failed(reader: RangeReader, why: str) -> Header:
    if reader.hit_eof:
        return Header(error="truncated", message=f"the file ends early ({reader.size} bytes): {why}")
    return Header(error="not_an_image", message=why + _describe(reader))


def _describe(reader: RangeReader) -> str:
    reader.seek(0)
    head = reader.read(16)
    if head.lstrip().lower().startswith((b"<!doctype", b"<html", b"<?xml", b"{")):
        return " (it looks like text: HTML/XML/JSON)"
    return f" (starts with {head[:8].hex(' ')})"


def _format_name(fmt: str) -> str:
    # MPO is a JPEG with extra pictures after the first (cameras write them); Pillow reads it as JPEG
    return "JPEG" if fmt == "MPO" else fmt


def _orientation(im: Image.Image) -> int:
    if im.format == "PNG":
        # PngImageFile.getexif() decodes the whole image to look for an eXIf chunk after IDAT;
        # only an eXIf before the pixel data (where the PNG spec puts it) is read here
        raw = im.info.get("exif")
        if not raw:
            return 1
        exif = Image.Exif()
        exif.load(raw)
        value = exif.get(_EXIF_ORIENTATION, 1)
    else:
        value = im.getexif().get(_EXIF_ORIENTATION, 1)
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _probe_webp(reader: RangeReader) -> Header:
    # RIFF: "RIFF" u32 size "WEBP", then chunks: fourcc, u32 little-endian size, payload padded to even
    reader.seek(12)
    width = height = None
    has_exif = False
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
            has_exif = bool(payload[0] & 0x08)
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
        elif fourcc == b"EXIF":
            exif = Image.Exif()
            exif.load(reader.read(length))
            value = exif.get(_EXIF_ORIENTATION, 1)
            orientation = value if isinstance(value, int) and 1 <= value <= 8 else 1
            if not width:
                return _webp_truncated(reader)
            return Header(width=width, height=height, format="WEBP", orientation=orientation)
        if width is not None and not has_exif:
            return Header(width=width, height=height, format="WEBP")
        reader.seek(start + length + (length & 1))  # skip the payload (image data) without reading it
    if width is not None:  # the EXIF flag was set but no EXIF chunk exists: no orientation
        return Header(width=width, height=height, format="WEBP")
    return _webp_truncated(reader)


def _webp_truncated(reader: RangeReader) -> Header:
    return Header(error="truncated", format="WEBP", message=f"WebP ends before its frame header ({reader.size} bytes)")


def probe_files(
    fs,
    root: str,
    items: list[tuple[str, int, bool, str | None]],
    *,
    max_pixels: int = MAX_PIXELS,
    first_read: int = FIRST_READ,
    threads: int = 32,
) -> dict[str, Any]:
    """Probe many files of one filesystem with ``threads`` ranged reads in flight.

    ``items`` are ``(name, size, probe_image, sidecar_name_or_None)`` with names relative to
    ``root``. Returns one list per column, item order: ``name``, ``width``, ``height``, ``format``,
    ``orientation``, ``bytes_read``, ``requests``, ``error``, ``message`` (None for caption-only
    items), ``caption`` and ``caption_read`` (None when there is no sidecar). Transient
    storage errors are retried; when retries run out the file becomes a ``read_failed`` row.
    Raises StorageError (message redacted) for a permanent failure such as access denied.
    """

    def read_image(name: str, size: int) -> Header:
        path = join(root, name)
        try:
            return probe_header(
                lambda start, end: with_retries(lambda: fs.cat_file(path, start=start, end=end)),
                size, max_pixels=max_pixels, first_read=first_read,
            )  # fmt: skip
        except StorageFailure as failure:
            if is_permanent(failure.cause):
                raise StorageError(f"reading {name}: {redact(str(failure.cause))}") from None
            return Header(error="read_failed", message=redact(f"{type(failure.cause).__name__}: {failure.cause}"))

    def read_caption(name: str) -> tuple[str | None, bool]:
        try:
            data = with_retries(lambda: fs.cat_file(join(root, name)))
        except Exception as e:
            if is_permanent(e):
                raise StorageError(f"reading {name}: {redact(str(e))}") from None
            return None, False  # counted as a caption that could not be read; the image stays usable
        return decode_caption(data), True

    def one(item: tuple[str, int, bool, str | None]) -> tuple[Header | None, str | None, bool]:
        name, size, probe, sidecar = item
        header = read_image(name, size) if probe else None
        caption, ok = read_caption(sidecar) if sidecar else (None, False)
        return header, caption, ok

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(items))), thread_name_prefix="probe") as pool:
        results = list(pool.map(one, items))
    names = ("name", "width", "height", "format", "orientation", "bytes_read", "requests", "error", "message",
             "caption", "caption_read")  # fmt: skip
    columns: dict[str, list] = {k: [] for k in names}
    for (name, _, _, sidecar), (header, caption, ok) in zip(items, results):
        columns["name"].append(name)
        for key in ("width", "height", "format", "orientation", "bytes_read", "requests", "error", "message"):
            columns[key].append(getattr(header, key) if header else None)
        columns["caption"].append(caption)
        columns["caption_read"].append(ok if sidecar else None)
    return columns
