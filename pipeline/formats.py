"""The image formats bucketeer reads and how it opens one: a single place for the scan and embed.

The formats are those the installed Pillow decodes, plus what the optional plugins add when they
are installed (:func:`register_plugins`, run on import): pillow-heif for HEIC/HEIF (the ``heif``
extra) and pillow-jxl-plugin for JPEG XL (the ``jxl`` extra). Pillow's own wheels read AVIF
since 11.3. The scan takes a file as an image by its extension (:data:`IMAGE_EXTENSIONS`), and
both the scan and embed open it by its first bytes (:func:`open_image`). Formats without a magic
number, which Pillow picks by file name alone (TGA, IM, PCD, IPTC), are opened by the plugin their
extension names when no signature matches: the scan passes the file name, embed the manifest's
``format`` (Pillow's lazy ``open`` reads only their header). Left out, as ignored files: stub plugins
without a decoder (BUFR, GRIB, HDF5, WMF), MPEG (header only) and EPS/PS (Ghostscript).

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
    "named_format",
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
    if factory is None or fmt in _NOT_DECODABLE:
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


def named_format(hint: str | None) -> str | None:
    """The format without a signature check that ``hint`` names: a file name or extension (``a.tga``,
    ``tga``) or a Pillow format name (``TGA``, a manifest's ``format``); else None."""
    if not hint:
        return None
    ext = "." + hint.rsplit("/", 1)[-1].rsplit(".", 1)[-1].lower()
    fmt = Image.EXTENSION.get(ext) or hint.upper()
    factory, accept = Image.OPEN.get(fmt, (None, None))
    return fmt if factory is not None and accept is None and _decodable(fmt) else None


def open_image(
    fp: IO[bytes], signature: bytes, hint: str | None = None
) -> tuple[Image.Image | None, list[tuple[str, Exception]]]:
    """``Image.open`` of the seekable ``fp`` (whose first bytes are ``signature``) without Pillow's
    decompression-bomb check: the caller applies the manifest's pixel limit to ``im.size``.

    Returns ``(image, problems)``: the image is lazy (only its header is read; some plugins,
    AVIF, HEIF and JPEG XL, read the whole file), or None when no format opens it; ``problems``
    are ``(format, exception)`` of formats whose signature matched (or that ``hint`` named) but
    whose header could not be read. A format without a signature check (TGA, IM, PCD) is tried
    only when ``hint``, a file name or format name (:func:`named_format`), names it.
    """
    problems: list[tuple[str, Exception]] = []
    named = named_format(hint)
    candidates = [(fmt, Image.OPEN[fmt]) for fmt in Image.ID] + ([(named, Image.OPEN[named])] if named else [])
    for i, (fmt, (factory, accept)) in enumerate(candidates):  # the signatures first, then the named format
        verdict = accept(signature) if accept else i == len(Image.ID)
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
