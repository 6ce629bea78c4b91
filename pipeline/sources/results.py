"""What a header probe found, checked at one boundary before any of it reaches a manifest row.

A parser fills a :class:`Header` with what the file *declares*: sides of any size or sign (a BMP
can declare a width of 4,294,967,169), an orientation of any type, a format name and a message
built from untrusted bytes. :func:`checked` is the only way from a Header to a :class:`Probe`, the
typed result the scan turns into rows, and it guarantees what the manifest's columns hold:

- a usable image has ``1 <= width, height`` in display orientation (EXIF orientations 5-8 swap
  the stored sides, as ``ImageOps.exif_transpose`` does) and ``width * height <= max_pixels``,
  so both sides fit the int32 columns (``max_pixels`` is at most MAX_PIXELS < 2^31);
- a declared side below 1, or one that is not a (64-bit) integer, is an ``invalid_header`` error;
- an error row keeps the declared sides only when both fit int32 (the message always has them);
- ``orientation`` is 1..8; a value outside, or of another type, reads as 1 unless Pillow's
  ``exif_transpose`` would act on it (it looks the value up among 2..8);
- ``error`` is one of :data:`manifests.schema.ERROR_KINDS`; ``format`` and ``message`` are valid
  UTF-8 text of bounded length (a non-UTF-8 byte in an exception's text cannot reach Arrow).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from manifests.schema import ERROR_KINDS

__all__ = ["Header", "Probe", "checked", "INT32_LIMIT"]

INT32_LIMIT = 2**31  # width and height columns are int32
_SWAPS_SIDES = frozenset({5, 6, 7, 8})  # orientations that rotate by 90 degrees
_TRANSPOSES = {k: k for k in range(2, 9)}  # the orientations exif_transpose acts on
_MAX_FORMAT = 32
_MAX_MESSAGE = 600


@dataclass
class Header:
    """What a parser read from one file, as declared (untrusted): sides as stored, before orientation."""

    width: Any = None
    height: Any = None
    format: Any = None
    orientation: Any = 1
    error: str | None = None  # one of ERROR_KINDS, when the parser already knows the file is unusable
    message: Any = None
    alpha: bool = False  # the header declares an alpha channel (RGBA, LA, a palette or PNG with transparency)


@dataclass(frozen=True)
class Probe:
    """One probed file, checked (see the module docstring): safe to write as a manifest row."""

    width: int | None
    height: int | None
    format: str | None
    orientation: int
    error: str | None
    message: str | None
    bytes_read: int
    requests: int
    alpha: bool = False  # a usable image whose header declares an alpha channel (scan --masks alpha)


def _text(value: Any, limit: int) -> str | None:
    if value is None:
        return None
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception:  # e.g. an int of more digits than Python will print
        text = f"<{type(value).__name__}>"
    text = text[: 4 * limit].encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates: not UTF-8
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _side(value: Any) -> int | None:
    """A declared side as an int, or None when it is no integer a header field could hold."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            if not float(value).is_integer():
                return None
            value = int(value)
        except (TypeError, ValueError, OverflowError):
            return None
    value = int(value)
    return value if value.bit_length() <= 64 else None


def _orientation(value: Any) -> int:
    try:
        return _TRANSPOSES.get(value, 1)  # a dict lookup, like exif_transpose's (6.0 and a rational 6/1 count)
    except TypeError:  # unhashable
        return 1


def _fits(width: int | None, height: int | None) -> tuple[int | None, int | None]:
    if width is None or height is None or not (0 <= width < INT32_LIMIT and 0 <= height < INT32_LIMIT):
        return None, None
    return width, height


def checked(header: Header, max_pixels: int, *, bytes_read: int = 0, requests: int = 0) -> Probe:
    """The :class:`Probe` for ``header``: validated, in display orientation, pixel limit applied."""
    fmt = _text(header.format, _MAX_FORMAT)
    io = {"bytes_read": max(0, int(bytes_read)), "requests": max(0, int(requests))}
    width, height = _side(header.width), _side(header.height)
    orientation = _orientation(header.orientation)
    if header.error is not None:
        kind = header.error if header.error in ERROR_KINDS else "not_an_image"
        message = _text(header.message, _MAX_MESSAGE) or kind
        return Probe(*_fits(width, height), fmt, orientation, kind, message, **io)
    if width is None or height is None:
        message = f"declares an impossible size: {_text(header.width, 40)} x {_text(header.height, 40)}"
        return Probe(None, None, fmt, orientation, "invalid_header", message, **io)
    if width < 1 or height < 1:
        message = f"declares a size of {width}x{height}"
        return Probe(*_fits(width, height), fmt, orientation, "invalid_header", message, **io)
    if orientation in _SWAPS_SIDES:
        width, height = height, width
    if width * height > max_pixels:
        message = (f"declares {width}x{height} = {width * height:,} pixels, above the limit of {max_pixels:,} "
                   "(--max-pixels); not decoded")  # fmt: skip
        return Probe(*_fits(width, height), fmt, orientation, "too_many_pixels", message, **io)
    return Probe(width, height, fmt, orientation, None, None, **io, alpha=header.alpha is True)
