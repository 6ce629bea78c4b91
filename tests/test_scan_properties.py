"""No file can fail a scan: property tests over the header probe (in-process) and a few whole scans.

Whatever the bytes (random, a real signature followed by junk, a valid header declaring a side of
0, 2^31 or 2^32 - 127, an absurd EXIF orientation, megabytes of metadata before the frame header),
the probe returns a checked result whose values fit the manifest's columns; a whole scan of such
files commits, every listed file is in exactly one of samples/errors, and every sample has
``1 <= width, height < 2^31`` and the size Pillow gives after ``exif_transpose`` (where Pillow can
decode it at all: pixel data cut short after a sound header is embed's ``decode_failed``, since the
scan never reads pixels).
"""

from __future__ import annotations

import io
import struct
import tempfile
import zlib
from functools import lru_cache
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from manifests.manifest import read_manifest
from manifests.schema import ERROR_KINDS, MAX_PIXELS
from pipeline import ScanJob, run
from pipeline.scan import ScanConfig
from pipeline.sources.headers import MAX_HEADER_BYTES, probe_header
from pipeline.sources.results import INT32_LIMIT, Header, Probe, checked
from tests.corpus import png_declaring, truth

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
U32 = 2**32
# declared sides that broke, or could break, a column: 0, negative, int32's edge, > 2^32
SIDES = st.one_of(st.sampled_from([0, 1, 2, 65535, 2**31 - 1, 2**31, 2**32 - 127, 2**32 - 1]),
                  st.integers(-(2**33), 2**33))  # fmt: skip
SIGNATURES = [b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF89a", b"BM", b"II*\0", b"MM\0*", b"RIFF\0\0\0\0WEBP",
              b"8BPS", b"qoif", b"\0\0\1\0", b"DDS ", b"\0\0\0\x0cjP  \r\n\x87\n", b"\0\0\0\x18ftypavif",
              b"\0\0\0\x18ftypheic", b"\xff\x0a", b"P6\n", b"icns", b"SIMPLE  =", b""]  # fmt: skip


def assert_valid(p: Probe, max_pixels: int = MAX_PIXELS) -> None:
    """The contract of a checked probe: every value fits its manifest column."""
    assert p.error is None or p.error in ERROR_KINDS
    assert 1 <= p.orientation <= 8 and p.bytes_read >= 0 and p.requests >= 0
    assert p.format is None or (isinstance(p.format, str) and len(p.format) <= 32)
    if p.error is None:
        assert 1 <= p.width < INT32_LIMIT and 1 <= p.height < INT32_LIMIT and p.width * p.height <= max_pixels
        assert p.message is None
    else:
        assert (p.width is None) == (p.height is None)
        assert p.width is None or (0 <= p.width < INT32_LIMIT and 0 <= p.height < INT32_LIMIT)
        assert isinstance(p.message, str) and p.message and len(p.message) <= 600
        p.message.encode("utf-8")  # no lone surrogates: Arrow would refuse the row


def probe(data: bytes, **kw) -> Probe:
    p = probe_header(lambda s, e: data[s:e], len(data), **kw)
    assert_valid(p, kw.get("max_pixels", MAX_PIXELS))
    return p


@PROPERTY
@given(st.sampled_from(SIGNATURES), st.binary(max_size=400))
def test_arbitrary_bytes_give_a_valid_probe(signature, tail):
    probe(signature + tail)


def bmp(w: int, h: int) -> bytes:
    info = struct.pack("<IIIHHIIIIII", 40, w % U32, h % U32, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 54 + 64, 0, 0, 54) + info + b"\0" * 64


def gif(w: int, h: int) -> bytes:
    return b"GIF89a" + struct.pack("<HHBBB", w % 65536, h % 65536, 0, 0, 0) + b",\0\0\0\0\1\0\1\0\0\2\2D\1\0;"


def jpeg(w: int, h: int) -> bytes:
    data = bytearray(_small_jpeg())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", h % 65536, w % 65536)
    return bytes(data)


@lru_cache(maxsize=1)
def _small_jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "JPEG")
    return buf.getvalue()


def webp(w: int, h: int) -> bytes:
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\0\0\0\0" + ((w - 1) % 2**24).to_bytes(3, "little")
    vp8x += ((h - 1) % 2**24).to_bytes(3, "little")
    return b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x


def tiff(w: int, h: int) -> bytes:
    entries = [(256, 4, 1, w % U32), (257, 4, 1, h % U32), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1),
               (273, 4, 1, 8), (277, 3, 1, 1), (278, 4, 1, 1), (279, 4, 1, 1)]  # fmt: skip
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHLL", *e) for e in entries) + b"\0\0\0\0"
    return b"II*\0" + struct.pack("<L", 8) + ifd


def psd(w: int, h: int) -> bytes:
    return b"8BPS" + struct.pack(">H6xHLLHH", 1, 3, h % U32, w % U32, 8, 3) + b"\0" * 64


def qoi(w: int, h: int) -> bytes:
    return b"qoif" + struct.pack(">LLBB", w % U32, h % U32, 3, 0) + b"\0" * 16


def png(w: int, h: int) -> bytes:
    return png_declaring(w % U32, h % U32)


BUILDERS = [bmp, gif, jpeg, webp, tiff, psd, qoi, png]


@PROPERTY
@given(st.sampled_from(BUILDERS), SIDES, SIDES, st.sampled_from([MAX_PIXELS, 10_000]))
def test_absurd_declared_sizes_give_a_valid_probe(build, w, h, max_pixels):
    p = probe(build(w, h), max_pixels=max_pixels)
    if p.error is None:
        assert p.width * p.height <= max_pixels


def test_the_bmp_that_failed_a_scan_is_a_too_many_pixels_row():
    p = probe(bmp(4294967169, 20))
    assert p.error == "too_many_pixels" and (p.width, p.height) == (None, None)  # not int32: not in the columns
    assert "4294967169x20" in p.message


def test_zero_and_negative_sides_are_invalid_headers():
    for w, h in ((0, 10), (10, 0), (-5, 7)):
        p = checked(Header(width=w, height=h, format="PNG"), MAX_PIXELS)
        assert p.error == "invalid_header" and f"{w}x{h}" in p.message
    p = checked(Header(width="wide", height=1.5, format="X" * 500, message="\udcff"), MAX_PIXELS)
    assert p.error == "invalid_header" and len(p.format) == 32
    p = checked(Header(width=10**100, height=2), MAX_PIXELS)
    assert p.error == "invalid_header" and (p.width, p.height) == (None, None)
    p = checked(Header(error="nonsense", message="caf\udce9"), MAX_PIXELS)
    assert p.error == "not_an_image" and p.message.encode("utf-8")


@PROPERTY
@given(st.one_of(st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.text(max_size=5), st.none(),
                 st.tuples(st.integers(0, 9), st.integers(0, 9)), st.lists(st.integers(), max_size=2)))  # fmt: skip
def test_any_orientation_value_is_1_to_8(value):
    p = checked(Header(width=30, height=20, orientation=value), MAX_PIXELS)
    assert_valid(p)
    assert (p.width, p.height) == ((20, 30) if p.orientation >= 5 else (30, 20))


def _exif(orientation: int, kind: int) -> bytes:
    value = struct.pack("<H", orientation % 65536) if kind == 3 else struct.pack("<L", orientation % U32)
    entry = struct.pack("<HHL", 0x0112, kind, 1) + value.ljust(4, b"\0")
    return b"II*\0" + struct.pack("<LH", 8, 1) + entry + b"\0" * 4


@PROPERTY
@given(st.integers(-5, 2**33), st.sampled_from([3, 4, 1, 5, 7, 9]))
def test_absurd_exif_orientation_values_match_exif_transpose(orientation, kind):
    buf = io.BytesIO()
    Image.new("RGB", (30, 20)).save(buf, "JPEG", exif=_exif(orientation, kind))
    data = buf.getvalue()
    p = probe(data)
    try:
        expected = truth(data)
    except Exception:  # Pillow itself cannot apply it; the probe must still give a valid row
        return
    assert p.error is None and (p.width, p.height) == expected


def test_megabytes_of_metadata_before_the_frame_header():
    # 40 APP segments of 64 KB (2.6 MB) of maker notes before the frame header: found, a few requests
    base = io.BytesIO()
    Image.new("RGB", (30, 20)).save(base, "JPEG")
    data = base.getvalue()
    junk = b"".join(b"\xff\xe4" + struct.pack(">H", 65535) + bytes(65533) for _ in range(40))
    data = data[:2] + junk + data[2:]
    p = probe(data)
    assert (p.width, p.height) == (30, 20) and p.bytes_read < 8 * 2**20 and p.requests <= 8
    # and a PNG whose chunks before IHDR's image data run past the probe's cap: unsupported, never read whole
    text = b"".join(_png_chunk(b"tEXt", b"k\0" + bytes(2**20)) for _ in range(MAX_HEADER_BYTES // 2**20 + 2))
    blob = png_declaring(30, 20)
    blob = blob[:33] + text + blob[33:]
    reads = []
    p = probe_header(lambda s, e: reads.append(e - s) or blob[s:e], len(blob))
    assert_valid(p)
    assert sum(reads) <= MAX_HEADER_BYTES


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


# --- whole scans: the assembly and the commit (real Ray, few examples) ----------------------------

HOSTILE = st.one_of(
    st.tuples(st.sampled_from(BUILDERS), SIDES, SIDES).map(lambda t: t[0](t[1], t[2])),
    st.tuples(st.sampled_from(SIGNATURES), st.binary(max_size=64)).map(lambda t: t[0] + t[1]),
    st.tuples(st.integers(1, 300), st.integers(1, 300), st.integers(0, 9)).map(
        lambda t: _photo(t[0], t[1], t[2])),
)


def _photo(w: int, h: int, orientation: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), "green").save(buf, "JPEG", exif=_exif(orientation, 3))
    return buf.getvalue()


@pytest.mark.ray
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(files=st.lists(HOSTILE, min_size=1, max_size=8),
       exts=st.lists(st.sampled_from(["jpg", "png", "bmp", "gif", "webp", "tif", "psd", "qoi"]), min_size=8,
                     max_size=8))  # fmt: skip
def test_a_scan_of_hostile_files_commits_every_file_exactly_once(ray_local, files, exts):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ds"
        root.mkdir()
        names = [f"f{i}.{ext}" for i, ext in zip(range(len(files)), exts)]
        for name, data in zip(names, files):
            (root / name).write_bytes(data)
        meta = run(ScanJob(source=str(root), out=str(Path(tmp) / "m"), config=ScanConfig(progress=False))).meta
        m = read_manifest(str(Path(tmp) / "m"))
        samples = {r["filename"]: r for r in m.samples.to_pylist()}
        errors = {r["filename"]: r for r in m.errors.to_pylist()}
        assert not samples.keys() & errors.keys() and sorted(samples.keys() | errors.keys()) == sorted(names)
        assert meta.counts.samples + meta.counts.errors == len(names)
        for name, row in samples.items():
            assert 1 <= row["width"] < INT32_LIMIT and 1 <= row["height"] < INT32_LIMIT
            try:
                expected = truth((root / name).read_bytes())
            except Exception:  # pixel data cut short after a sound header: embed's decode_failed, never read here
                continue
            assert (row["width"], row["height"]) == expected, name
        for part in meta.parts.errors:  # error rows round-trip: every value fitted its column
            assert pq.read_table(Path(tmp) / "m" / part.path).num_rows == part.rows
        assert isinstance(m.errors, pa.Table)
