"""The fast header parsers agree with Pillow: on real files, on mutated ones, and on hand-built EXIF.

The reference is the probe's Pillow path (``Image.open`` through the same ranged reader); a fast
parser may decline (None, UNSURE) but must never give another answer than Pillow's.
"""

from __future__ import annotations

import io
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from pipeline.sources.headers import RangeReader, _parse_with_pillow, probe_header
from pipeline.sources.parsers import UNSURE, exif_orientation, parse_jpeg, parse_webp
from pipeline.sources.results import checked
from tests.corpus import truth

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pillow_probe(data: bytes):
    """What the probe says when Pillow alone reads the header (the reference for the fast parsers)."""
    reader = RangeReader(lambda s, e: data[s:e], len(data))
    try:
        header = _parse_with_pillow(reader, data[:16])
    except Exception as e:
        return ("raises", type(e).__name__)
    p = checked(header, 10**9)
    return (p.width, p.height, p.orientation) if p.error is None else ("error", p.error)


def fast_probe(data: bytes):
    header = parse_jpeg(data)
    if header is None:
        return None
    p = checked(header, 10**9)
    return (p.width, p.height, p.orientation) if p.error is None else ("error", p.error)


def _exif(orientation=None, maker_note: int = 0) -> bytes:
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    if maker_note:
        exif.get_ifd(0x8769)[0x927C] = b"m" * maker_note
    return exif.tobytes()


def _jpeg(w: int, h: int, mode: str = "RGB", **kw) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), "red" if mode != "L" else 128).save(buf, "JPEG", **kw)
    return buf.getvalue()


def _xmp(orientation: int) -> bytes:
    return f'<x:xmpmeta><rdf:Description tiff:Orientation="{orientation}"/></x:xmpmeta>'.encode()


@pytest.fixture(scope="module")
def jpegs() -> list[bytes]:
    """Real JPEGs of the kinds a dataset holds: orientations by EXIF and XMP, progressive, CMYK, ..."""
    out = [_jpeg(40, 24), _jpeg(40, 24, "L"), _jpeg(40, 24, "CMYK"), _jpeg(33, 17, progressive=True)]
    out += [_jpeg(40, 24, exif=_exif(k)) for k in range(1, 9)]
    out += [_jpeg(40, 24, exif=_exif(6, maker_note=5000), icc_profile=b"p" * 3000, comment=b"a comment")]
    out += [_jpeg(40, 24, xmp=_xmp(8)), _jpeg(40, 24, exif=_exif(3), xmp=_xmp(6))]
    out += [_jpeg(40, 24, exif=_exif(), xmp=_xmp(5))]
    out += [_jpeg(64, 48, restart_marker_blocks=1, subsampling=0, qtables="web_high")]
    return out


def test_fast_jpeg_parse_equals_pillow_and_the_displayed_size(jpegs):
    for data in jpegs:
        fast = fast_probe(data)
        assert fast is not None, "a plain JPEG must not need Pillow"
        assert fast == pillow_probe(data)
        assert fast[:2] == truth(data)  # the size Pillow gives after decode and exif_transpose


@PROPERTY
@given(data=st.data())
def test_mutated_jpeg_headers_get_pillows_answer_or_none(jpegs, data):
    base = bytearray(data.draw(st.sampled_from(jpegs)))
    sos = base.index(b"\xff\xda")
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["byte", "cut", "insert"]))
        at = data.draw(st.integers(2, sos + 8))
        if kind == "byte":
            base[at % len(base)] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            base = base[: max(3, at)]
        else:
            base[at:at] = data.draw(st.sampled_from([b"\xff", b"\xff\xff", b"\xff\xe1\x00\x08Exif\0\0",
                                                     b"\xff\xfe\x00\x04ab", b"\xff\xc8", b"\x00"]))  # fmt: skip
    blob = bytes(base)
    fast = fast_probe(blob)
    if fast is not None:
        assert fast == pillow_probe(blob)


def _ifd(order: str, entries: list[tuple[int, int, int, bytes]], offset: int = 8) -> bytes:
    head = (b"II*\0" if order == "<" else b"MM\0*") + struct.pack(order + "L", offset)
    body = struct.pack(order + "H", len(entries)) + b"".join(
        struct.pack(order + "HHL", tag, kind, count) + value.ljust(4, b"\0")[:4] for tag, kind, count, value in entries
    )
    return head + b"\0" * (offset - 8) + body + b"\0\0\0\0"


entry = st.tuples(
    st.sampled_from([0x0112, 0x0112, 0x010F, 0x8769, 0x011A]),
    st.integers(0, 13),
    st.sampled_from([0, 1, 1, 2, 2**31]),
    st.binary(min_size=4, max_size=4),
)


@PROPERTY
@given(st.sampled_from("<>"), st.lists(entry, max_size=5), st.sampled_from([8, 8, 12, 3, 500]))
def test_exif_orientation_equals_pillows_getexif(order, entries, offset):
    block = _ifd(order, entries, max(offset, 8))
    if offset < 8:
        block = block[:offset]
    ours = exif_orientation(block)
    if ours is UNSURE:
        return
    tags = Image.Exif()
    tags.load(b"Exif\0\0" + block)
    assert ours == tags.get(0x0112)


def test_exif_orientation_reads_short_and_long_values():
    assert exif_orientation(_ifd("<", [(0x0112, 3, 1, struct.pack("<H", 6))])) == 6
    assert exif_orientation(_ifd(">", [(0x0112, 4, 1, struct.pack(">L", 8))])) == 8
    assert exif_orientation(_ifd("<", [(0x010F, 2, 4, b"abc\0")])) is None
    assert exif_orientation(b"") is None  # an empty block: Pillow reads no tags
    assert exif_orientation(b"MM\0+" + b"\0" * 12) is UNSURE  # BigTIFF: Pillow's business
    assert exif_orientation(_ifd("<", [(0x0112, 3, 1, b"\x06\0"), (0x0112, 3, 1, b"\x03\0")])) is UNSURE


@pytest.mark.parametrize("lossless", [False, True])
@pytest.mark.parametrize("meta", [{}, {"exif": 6}, {"xmp": 8}, {"exif": 3, "xmp": 6}, {"exif": None, "xmp": 5}])
def test_webp_parse_equals_pillow(lossless, meta):
    kw = {"lossless": lossless}
    if "exif" in meta:
        kw["exif"] = _exif(meta["exif"])
    if "xmp" in meta:
        kw["xmp"] = _xmp(meta["xmp"])
    buf = io.BytesIO()
    Image.new("RGB", (40, 24), "blue").save(buf, "WEBP", **kw)
    data = buf.getvalue()
    header = parse_webp(RangeReader(lambda s, e: data[s:e], len(data)))
    p = checked(header, 10**9)
    assert (p.width, p.height) == truth(data)
    with Image.open(io.BytesIO(data)) as im:
        assert p.orientation == (im.getexif().get(0x0112) or 1)


def test_png_orientation_from_exif_or_xmp_before_the_pixels():
    from PIL import PngImagePlugin

    for exif, xmp in ((6, None), (None, 8), (3, 6)):
        info = PngImagePlugin.PngInfo()
        if xmp:
            info.add_itxt("XML:com.adobe.xmp", _xmp(xmp).decode())
        buf = io.BytesIO()
        Image.new("RGB", (40, 24)).save(buf, "PNG", pnginfo=info, **({"exif": _exif(exif)} if exif else {}))
        data = buf.getvalue()
        p = probe_header(lambda s, e: data[s:e], len(data))
        assert (p.width, p.height) == truth(data), (exif, xmp)
