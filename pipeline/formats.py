"""The image formats bucketeer reads and how it opens one: a single place for the scan and embed.

The formats are those the installed Pillow decodes, plus what the optional plugins add when they
are installed (:func:`register_plugins`, run on import): pillow-heif for HEIC/HEIF (the ``heif``
extra) and pillow-jxl-plugin for JPEG XL (the ``jxl`` extra). Pillow's own wheels read AVIF
since 11.3. The scan takes a file as an image by its extension (:data:`IMAGE_EXTENSIONS`), and
both the scan and embed open it by its first bytes (:func:`open_image`), so a format counts only
when Pillow can also tell it from those bytes and decode it. Left out, as ignored files: formats
Pillow identifies by file name alone (TGA, IM, PCD, IPTC; embed sees bytes, not names), stub
plugins without a decoder (BUFR, GRIB, HDF5, WMF), MPEG (header only) and EPS/PS (Ghostscript).

The scan, the embed workers and every Ray worker of a job must have the same extras installed:
a manifest that lists ``.heic`` images needs pillow-heif wherever it is embedded.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import IO

from PIL import Image, ImageFile

__all__ = [
    "IMAGE_EXTENSIONS",
    "register_plugins",
    "image_extensions",
    "missing_format_hint",
    "open_image",
    "format_name",
]

# optional plugins: (module, how to register it, the extra that installs it, the extensions it adds)
_PLUGINS = (
    ("pillow_heif", "register_heif_opener", "heif", ("heic", "heics", "heif", "heifs", "hif")),
    ("pillow_jxl", None, "jxl", ("jxl",)),
)
# formats Pillow opens that bucketeer cannot use: no decoder behind the header, or one outside Pillow
_NOT_DECODABLE = frozenset({"MPEG", "EPS"})
# formats opened through another one's plugin: an .mpo is a JPEG with more pictures after the first
_OPENED_AS = {"MPO": "JPEG"}


@lru_cache(maxsize=1)
def register_plugins() -> tuple[str, ...]:
    """Register the optional format plugins that are installed (once per process); their names."""
    found = []
    for module, register, _, _ in _PLUGINS:
        try:
            plugin = importlib.import_module(module)
        except ImportError:
            continue
        if register:
            getattr(plugin, register)()
        found.append(module)
    Image.init()  # every plugin imported now, so identification never imports mid-probe
    return tuple(found)


def _decodable(fmt: str) -> bool:
    fmt = _OPENED_AS.get(fmt, fmt)
    factory, accept = Image.OPEN.get(fmt, (None, None))
    if factory is None or accept is None or fmt in _NOT_DECODABLE:
        return False
    return not (isinstance(factory, type) and issubclass(factory, ImageFile.StubImageFile))


@lru_cache(maxsize=1)
def image_extensions() -> frozenset[str]:
    """Lower-case extensions (no dot) of the formats this process can identify and decode."""
    register_plugins()
    return frozenset(ext.lstrip(".").lower() for ext, fmt in Image.registered_extensions().items() if _decodable(fmt))


def missing_format_hint(extension: str) -> str | None:
    """For an ignored file extension of a known image format: what to install to read it; else None."""
    ext = extension.lower()
    if ext in image_extensions():
        return None
    for _, _, extra, extensions in _PLUGINS:
        if ext in extensions:
            return f"pip install 'bucketeer[{extra}]'"
    if ext in ("avif", "avifs"):
        return "a Pillow with AVIF support (its wheels since 11.3)"
    return None


def open_image(fp: IO[bytes], signature: bytes) -> tuple[Image.Image | None, list[tuple[str, Exception]]]:
    """``Image.open`` of the seekable ``fp`` (whose first bytes are ``signature``) without Pillow's
    decompression-bomb check: the caller applies the manifest's pixel limit to ``im.size``.

    Returns ``(image, problems)``: the image is lazy (only its header is read; some plugins,
    AVIF, HEIF and JPEG XL, read the whole file), or None when no format opens it; ``problems``
    are ``(format, exception)`` of formats whose signature matched but whose header could not
    be read. Formats without a signature check are skipped (see the module docstring).
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
        except Exception as e:  # untrusted bytes can fail a plugin any way: the signature matched, keep why
            problems.append((fmt, e))
    return None, problems


def format_name(fmt: str | None) -> str:
    """The manifest's ``format`` for Pillow's format name (MPO, a JPEG with extra pictures, is JPEG)."""
    fmt = fmt or "image"
    return _OPENED_AS.get(fmt, fmt)


register_plugins()
IMAGE_EXTENSIONS = image_extensions()
