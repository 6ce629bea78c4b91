"""Header probing, captions and listing: pure functions, no Ray, no S3 (retries: tests/test_retry.py)."""

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from pipeline.sources.captions import CaptionTable, decode_caption, load_caption_table, sidecar_stem
from pipeline.sources.headers import FIRST_READ, RangeReader, StorageFailure, probe_header
from pipeline.sources.listing import _between, classify, list_source
from tests.corpus import make_corpus, png_declaring


class CountingFile:
    """A file's bytes behind ``read_range``, counting requests (what storage would serve)."""

    def __init__(self, data: bytes):
        self.data = data
        self.calls: list[tuple[int, int]] = []

    def __call__(self, start: int, end: int) -> bytes:
        self.calls.append((start, end))
        return self.data[start:end]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def test_every_corpus_file_matches_pillow_full_decode(corpus):
    for rel in corpus.images:
        data = (corpus.root / rel).read_bytes()
        header = probe_header(CountingFile(data), len(data))
        if rel in corpus.sizes:
            assert header.error is None, (rel, header.message)
            assert (header.width, header.height) == corpus.sizes[rel], rel
            assert header.bytes_read <= max(len(data), FIRST_READ)
        else:
            assert header.error == corpus.errors[rel], (rel, header)
            assert header.message


def test_orientation_is_recorded_and_swaps_sides(corpus):
    for k in range(1, 9):
        data = (corpus.root / f"orient/jpeg_o{k}.jpg").read_bytes()
        h = probe_header(CountingFile(data), len(data))
        assert h.orientation == k
        assert (h.width, h.height) == ((24, 40) if k >= 5 else (40, 24))
    for rel in ("orient/png_o6.png", "orient/webp_o6.webp", "orient/webp_o8_lossless.webp", "orient/tiff_o6.tif"):
        data = (corpus.root / rel).read_bytes()
        h = probe_header(CountingFile(data), len(data))
        assert h.orientation in (6, 8) and (h.width, h.height) == (24, 40), rel


def _frame_header_offset(data: bytes) -> int:
    pos = 2  # after SOI; every segment is FF, marker, 16-bit length (which counts itself)
    while data[pos + 1] not in (0xC0, 0xC2):
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return pos


def test_far_frame_header_reads_more_but_not_everything():
    # 600 KB of ICC before the frame header, then ~2 MB of noisy pixels
    rng = np.random.default_rng(0)
    im = Image.fromarray(rng.integers(0, 255, (900, 1000, 3), np.uint8))
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=95, icc_profile=rng.bytes(600_000))
    data = buf.getvalue()
    sof = _frame_header_offset(data)
    assert sof > 256 * 1024 and len(data) > sof + 1_000_000
    f = CountingFile(data)
    h = probe_header(f, len(data))
    assert (h.width, h.height) == (1000, 900)
    assert sof < h.bytes_read < sof + 1_000_000  # read past the header, never the pixel data
    assert h.requests == len(f.calls) <= 6  # fetches double on sequential misses
    assert h.bytes_read == sum(e - s for s, e in f.calls)


def test_small_header_is_one_request_of_at_most_64k():
    rng = np.random.default_rng(1)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (400, 600, 3), np.uint8)).save(buf, "JPEG", quality=95)
    data = buf.getvalue()
    assert len(data) > 2 * FIRST_READ
    f = CountingFile(data)
    h = probe_header(f, len(data))
    assert (h.width, h.height) == (600, 400) and f.calls == [(0, FIRST_READ)] and h.bytes_read == FIRST_READ


def test_pixel_limit_is_configurable_and_never_decodes():
    data = png_declaring(60000, 60000)
    h = probe_header(CountingFile(data), len(data))
    assert h.error == "too_many_pixels" and (h.width, h.height) == (60000, 60000)
    assert "3,600,000,000" in h.message
    data = png_declaring(100, 100)
    assert probe_header(CountingFile(data), len(data), max_pixels=9_999).error == "too_many_pixels"
    assert probe_header(CountingFile(data), len(data), max_pixels=10_000).error is None


def test_storage_failures_are_not_image_errors():
    def broken(start, end):
        raise ConnectionResetError("connection reset by peer")

    with pytest.raises(StorageFailure) as e:
        probe_header(broken, 1000)
    assert isinstance(e.value.cause, ConnectionResetError)


def test_range_reader_seek_and_read_across_chunks():
    data = bytes(range(256)) * 1000
    f = CountingFile(data)
    r = RangeReader(f, len(data), first_read=100)
    assert r.read(10) == data[:10]
    r.seek(150_000)
    assert r.read(300) == data[150_000:150_300]
    r.seek(-5, io.SEEK_END)
    assert r.read(100) == data[-5:] and r.hit_eof
    assert r.bytes_read == sum(e - s for s, e in f.calls)


@pytest.mark.parametrize(
    "raw, expected",
    [
        (b"\xef\xbb\xbfa red fox", "a red fox"),
        (b"line one\r\nline  two\r\n", "line one line two"),
        (b"  padded \t\n\n", "padded"),
        ("café crème".encode("latin-1"), "café crème"),
        (b"smart \x93quotes\x94", "smart \u201cquotes\u201d"),  # Windows-1252, what editors write
        (b"\x81\x8d", "\x81\x8d"),  # undefined in cp1252: Latin-1 maps every byte
        ("utf-16 text".encode("utf-16"), "utf-16 text"),
        (b" \r\n ", None),
        (b"", None),
    ],
)
def test_caption_decoding(raw, expected):
    assert decode_caption(raw) == expected


def test_sidecar_stem():
    assert sidecar_stem("a/b/img.final.JPG") == "a/b/img.final"
    assert sidecar_stem("img.png") == "img"


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_caption_tables(tmp_path, fmt):
    rows = {"file_name": ["a.jpg", "./sub/b.png", "c.webp"], "text": ["  first\r\ncaption ", "second", None]}
    path = tmp_path / f"meta.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.table(rows), path)
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(dict(zip(rows, v))) + "\n" for v in zip(*rows.values())))
    else:
        path.write_text('file_name,text\na.jpg,"  first\r\ncaption "\n./sub/b.png,second\nc.webp,\n')
    expected = {"a.jpg": "first caption", "sub/b.png": "second", "c.webp": None}
    table = load_caption_table(str(path))
    assert table.captions == expected
    # the version hashes the content as read, so every format of the same table agrees on it
    assert table.version == CaptionTable.of(dict(reversed(expected.items()))).version
    assert table.version != CaptionTable.of({**expected, "c.webp": "third"}).version


def test_caption_table_errors_name_the_problem(tmp_path):
    bad = tmp_path / "t.csv"
    bad.write_text("name,words\na.jpg,x\n")
    with pytest.raises(ValueError, match="needs a filename column"):
        load_caption_table(str(bad))
    (tmp_path / "t.xlsx").write_text("x")
    with pytest.raises(ValueError, match="unknown table format"):
        load_caption_table(str(tmp_path / "t.xlsx"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_caption_table(str(tmp_path / "missing.parquet"))


def test_listing_classifies_and_counts(tmp_path):
    corpus = make_corpus(tmp_path)
    import fsspec

    listing = list_source(fsspec.filesystem("file"), str(tmp_path))
    assert [e.name for e in listing.images] == corpus.images
    assert listing.ignored == len(corpus.ignored)
    assert listing.sidecars["cap/other"].name == "cap/other.caption"
    assert all(e.mtime and e.size >= 0 for e in listing.images)
    assert classify("a/._x.jpg") == "hidden" and classify(".git/HEAD") == "hidden"
    assert classify("x.TIFF") == "image" and classify("x.txt") == "sidecar" and classify("README") == "other"


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=12), st.one_of(st.none(), st.text(min_size=1, max_size=12)))
def test_key_range_cut_is_strictly_inside(lo, hi):
    lo = "p/" + lo
    hi = None if hi is None else "p/" + hi
    if hi is not None and hi <= lo:
        return
    mid = _between(lo, hi, "p/")
    if mid is not None:
        assert lo < mid and (hi is None or mid < hi)


def test_key_range_cut_exists_for_typical_keys():
    assert _between("ds/img_000999.jpg", None, "ds/") is not None
    assert _between("ds/a/img_000999.jpg", "ds/z", "ds/") is not None
