"""Every format the installed Pillow (and plugins) opens is scanned and embedded; the rest is named.

AVIF and JPEG 2000 are Pillow's own; HEIC/HEIF and JPEG XL come from the optional extras ``heif``
and ``jxl`` (installed with ``dev``). Each is skipped, with the reason, where its codec is absent.
"""

from __future__ import annotations

import importlib.util
import io

import pytest
from PIL import Image, features

from manifests.buckets import BucketSpec
from manifests.manifest import read_manifest
from manifests.schema import sample_id
from pipeline import formats
from pipeline import ScanJob, run
from pipeline.scan import ScanConfig
from pipeline.embed.imaging import prepare_views
from pipeline.sources import listing
from tests.corpus import truth
from tests.embed_data import records_by_id, embed_cache

CODECS = {
    "avif": ("AVIF", features.check("avif"), "this Pillow has no AVIF codec (wheels since 11.3)"),
    "heic": ("HEIF", importlib.util.find_spec("pillow_heif") is not None, "pillow-heif is not installed"),
    "jxl": ("JXL", importlib.util.find_spec("pillow_jxl") is not None, "pillow-jxl-plugin is not installed"),
    "jp2": ("JPEG2000", features.check("jpg_2000"), "this Pillow has no OpenJPEG"),
}


def encoded(fmt: str, w: int, h: int, orientation: int = 1) -> bytes:
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    buf = io.BytesIO()
    kw = {} if fmt == "JPEG2000" else {"exif": exif.tobytes()}
    Image.effect_noise((w, h), 40).convert("RGB").save(buf, fmt, **kw)
    return buf.getvalue()


def test_image_extensions_are_what_this_pillow_can_identify_and_decode():
    exts = formats.IMAGE_EXTENSIONS
    assert {"jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "mpo", "qoi"} <= exts
    for ext, (_, present, _) in CODECS.items():
        assert (ext in exts) == present, ext
    # formats Pillow picks by extension alone are images too (the name picks the plugin)
    assert {"tga", "im", "pcd"} <= exts
    # header-only stubs, vector and video: not images
    assert not exts & {"h5", "grib", "bufr", "wmf", "eps", "ps", "mpg", "pdf", "txt"}


@pytest.fixture(scope="module")
def modern(tmp_path_factory, ray_local):
    """One folder with two images of every format whose codec is here (one EXIF-rotated), scanned once."""
    root = tmp_path_factory.mktemp("modern")
    files = {}
    for ext, (fmt, present, _) in CODECS.items():
        if present:
            files[f"a.{ext}"] = encoded(fmt, 96, 64)
            files[f"b.{ext}"] = encoded(fmt, 96, 64, orientation=6)
    for name, data in files.items():
        (root / "ds").mkdir(exist_ok=True)
        (root / "ds" / name).write_bytes(data)
    manifest = root / "manifest"
    run(ScanJob(source=str(root / "ds"), out=str(manifest), spec=SPEC, config=QUIET))
    return files, str(manifest)


SPEC = BucketSpec(area=64 * 64, step=32)
QUIET = ScanConfig(progress=False)


@pytest.mark.ray
@pytest.mark.parametrize("ext", sorted(CODECS))
def test_modern_formats_scan_and_decode_as_embed_does(modern, ext):
    fmt, present, reason = CODECS[ext]
    if not present:
        pytest.skip(reason)
    files, manifest = modern
    m = read_manifest(manifest)
    assert m.errors.num_rows == 0, m.errors.to_pylist()
    rows = {r["filename"]: r for r in m.samples.to_pylist() if r["filename"].endswith(ext)}
    assert sorted(rows) == [f"a.{ext}", f"b.{ext}"]
    for name, row in rows.items():
        assert (row["width"], row["height"]) == truth(files[name]) and row["format"] == fmt  # after exif_transpose
        bw, bh = map(int, row["bucket"].split("x"))
        (prepared,) = prepare_views(files[name], (bh, bw))  # embed's decoder, on the bytes embed fetches
        assert prepared.original_size == (row["height"], row["width"]) and prepared.pixels.shape == (bh, bw, 3)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("bucketeer_home")
@pytest.mark.full
def test_modern_formats_embed(modern, tmp_path):
    files, manifest = modern
    embed_cache(manifest, str(tmp_path / "cache"))
    records = records_by_id(str(tmp_path / "cache"))
    for row in read_manifest(manifest).samples.to_pylist():
        assert records[sample_id(row["filename"])].original_size == (row["height"], row["width"])


@pytest.mark.ray
def test_a_format_without_its_plugin_is_named_with_its_count(tmp_path, ray_local, monkeypatch, capsys):
    # this process may have pillow-heif: take it away from the scan's view, as on a machine without it
    without = formats.IMAGE_EXTENSIONS - {"heic", "heif", "hif", "heics", "heifs"}
    monkeypatch.setattr(listing, "IMAGE_EXTENSIONS", without)
    monkeypatch.setattr(formats, "image_extensions", lambda: without)
    root = tmp_path / "ds"
    root.mkdir()
    (root / "one.jpg").write_bytes(encoded("JPEG", 40, 24))
    for i in range(3):
        (root / f"phone_{i}.HEIC").write_bytes(b"\0\0\0\x18ftypheic" + bytes(100))
    (root / "notes.md").write_text("x")
    (root / "README").write_text("x")
    run(ScanJob(source=str(root), out=str(tmp_path / "m"), config=QUIET))
    line = capsys.readouterr().out
    assert "5 other files ignored: 3 .heic (pip install 'bucketeer[heif]'), 1 (no extension), 1 .md" in line
    meta = read_manifest(str(tmp_path / "m")).meta
    assert meta.summary.ignored_extensions == {"": 1, "heic": 3, "md": 1}
    assert meta.counts.to_json() == {"listed": 1, "ignored": 5, "samples": 1, "errors": 0}


def test_a_folder_of_only_unreadable_formats_says_which(tmp_path, monkeypatch):
    monkeypatch.setattr(listing, "IMAGE_EXTENSIONS", formats.IMAGE_EXTENSIONS - {"jxl"})
    monkeypatch.setattr(formats, "image_extensions", lambda: formats.IMAGE_EXTENSIONS - {"jxl"})
    (tmp_path / "a.jxl").write_bytes(b"\xff\x0a")
    with pytest.raises(ValueError, match=r"\(1 other files ignored: 1 \.jxl \(pip install 'bucketeer\[jxl\]'\)\)"):
        from pipeline import ScanJob, run

        run(ScanJob(source=str(tmp_path), out=str(tmp_path / "m"), spec=BucketSpec()))
