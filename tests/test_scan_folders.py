"""Folders as users have them (the scan of real files, with real Ray): formats Pillow picks by
extension, mixed folders of loose images and tar shards, links, empty and oversized captions."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import pytest
from PIL import Image

from manifests.manifest import read_manifest
from pipeline import ScanJob, run
from pipeline.embed.imaging import prepare_views
from pipeline.scan import ScanConfig

pytestmark = pytest.mark.ray
QUIET = ScanConfig(progress=False)


def scan(src: Path, out: Path, config: ScanConfig = QUIET):
    return run(ScanJob(source=str(src), out=str(out), config=config))


def rows_of(out: Path) -> dict[str, dict]:
    m = read_manifest(str(out))
    return {r["filename"]: r for r in m.samples.to_pylist() + m.errors.to_pylist()}


def image_bytes(fmt: str, size: tuple[int, int], mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():  # IM: deprecated in Pillow 13 (removed in 15), still read and written
        warnings.simplefilter("ignore", DeprecationWarning)
        Image.new(mode, size, 90).save(buf, fmt)
    return buf.getvalue()


# formats without a magic number (TGA, IM: Pillow picks them by extension) and others written by Pillow;
# PCD is read-only in Pillow, so no test file can be made for it
BY_NAME = {"a.tga": ("TGA", (37, 23)), "b.im": ("IM", (40, 31)), "c.pcx": ("PCX", (33, 65)),
           "d.TGA": ("TGA", (64, 48))}  # fmt: skip


def test_formats_pillow_picks_by_extension_are_samples_with_their_size(tmp_path, ray_local):
    src = tmp_path / "src"
    src.mkdir()
    for name, (fmt, size) in BY_NAME.items():
        (src / name).write_bytes(image_bytes(fmt, size))
    (src / "e.tga").write_bytes(b"not a targa file at all, just text\n" * 3)
    result = scan(src, tmp_path / "m")
    rows = rows_of(tmp_path / "m")
    for name, (fmt, (w, h)) in BY_NAME.items():
        row = rows[name]
        assert (row["width"], row["height"], row["format"], row.get("error")) == (w, h, fmt, None), name
    assert rows["e.tga"]["error"] == "not_an_image" and "named .tga" in rows["e.tga"]["message"]
    assert result.ignored == 0 and result.listed == 5
    # embed decodes them by the same name (no magic number to go by)
    views = prepare_views((src / "a.tga").read_bytes(), (16, 16), name="a.tga")
    assert views[0].original_size == (23, 37)


def test_empty_and_oversized_captions_are_counted_loose_and_in_shards(tmp_path, ray_local):
    import tarfile

    jpg = image_bytes("JPEG", (64, 64))
    big = b"word " * (300 * 1024)  # 1.5 MiB
    loose = tmp_path / "loose"
    loose.mkdir()
    for name, caption in (("a", b""), ("b", big), ("c", b"a cat")):
        (loose / f"{name}.jpg").write_bytes(jpg)
        (loose / f"{name}.txt").write_bytes(caption)
    result = scan(loose, tmp_path / "m1")
    s = result.meta.summary
    assert (s.no_caption, s.captions_truncated) == (1, 1)
    shards = tmp_path / "shards"
    shards.mkdir()
    with tarfile.open(shards / "00000.tar", "w") as tf:
        for name, caption in (("a", b""), ("b", big), ("c", b"a cat")):
            for member, data in ((f"{name}.jpg", jpg), (f"{name}.txt", caption)):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    s = scan(shards, tmp_path / "m2").meta.summary
    assert (s.no_caption, s.captions_truncated) == (1, 1)
    rows = rows_of(tmp_path / "m2")
    assert rows["00000.tar/a.jpg"]["caption"] is None and len(rows["00000.tar/b.jpg"]["caption"]) < len(big)
