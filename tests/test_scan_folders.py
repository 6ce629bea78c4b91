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


def _tar(path: Path, members: list[tuple[str, bytes | None, str | None, bytes | None]]) -> None:
    """A tar of ``(name, data, link target, link type)`` members: data for a file, else a link."""
    import tarfile

    with tarfile.open(path, "w") as tf:
        for name, data, target, kind in members:
            info = tarfile.TarInfo(name)
            if data is not None:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                info.type, info.linkname = kind, target
                tf.addfile(info)


def test_mixed_folder_scans_loose_images_and_shard_members_and_rescans_reuse_both(tmp_path, ray_local, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"loose{i}.png").write_bytes(image_bytes("PNG", (40 + i, 30)))
    _tar(src / "hopper.tar", [("k0.jpg", image_bytes("JPEG", (50, 20)), None, None), ("k0.txt", b"hopper", None, None)])
    (src / "hopper.parquet").write_bytes(b"PAR1 per-shard metadata, as img2dataset writes")
    (src / "old.tar.gz").write_bytes(b"\x1f\x8b not really")
    result = scan(src, tmp_path / "m")
    s = result.meta.summary
    assert (s.listed, s.samples, s.images_loose, s.images_in_shards, s.shards) == (4, 4, 3, 1, 1)
    assert s.ignored_extensions == {"parquet": 1, "tar.gz": 1}
    line = capsys.readouterr().out
    assert "3 loose images and 1 tar shards holding 1 images" in line and "gzip -dc" in line
    rows = rows_of(tmp_path / "m")
    assert rows["hopper.tar/k0.jpg"]["caption"] == "hopper" and rows["loose2.png"]["width"] == 42
    again = scan(src, tmp_path / "m").meta
    assert (again.summary.reused, again.summary.shards_reused, again.summary.files_read) == (3, 1, 0)
    assert again.fingerprint == result.fingerprint
    # one kind only: the others are counted as ignored by extension
    files = scan(src, tmp_path / "files", ScanConfig(progress=False, format="files")).meta.summary
    assert files.samples == 3 and files.ignored_extensions == {"parquet": 1, "tar": 1, "tar.gz": 1}
    (src / "old.tar.gz").unlink()
    tar = scan(src, tmp_path / "tar", ScanConfig(progress=False, format="tar")).meta.summary
    assert tar.samples == 1 and tar.ignored_extensions == {"parquet": 1, "png": 3}


def test_links_land_in_rows_or_counts(tmp_path, ray_local):
    src = tmp_path / "src"
    src.mkdir()
    (src / "real.png").write_bytes(image_bytes("PNG", (33, 44)))
    (src / "alias.png").symlink_to("real.png")
    (src / "a.jpg").symlink_to("b.jpg")
    (src / "b.jpg").symlink_to("a.jpg")
    (src / "gone.jpg").symlink_to("nowhere.jpg")
    (src / "gone.txt").symlink_to("nowhere.txt")
    (src / "passwd.jpg").symlink_to("/etc/passwd")
    jpg = image_bytes("JPEG", (64, 48))
    _tar(src / "links.tar", [
        ("x.jpg", jpg, None, None), ("x.txt", b"the original", None, None),
        ("hard.jpg", None, "x.jpg", b"1"), ("dir/soft.jpg", None, "../x.jpg", b"2"),
        ("dead.jpg", None, "missing.jpg", b"2"), ("loop1.jpg", None, "loop2.jpg", b"2"),
        ("loop2.jpg", None, "loop1.jpg", b"2"), ("dead.json", None, "missing.json", b"2"),
    ])  # fmt: skip
    import tarfile

    assert {m.type for m in tarfile.open(src / "links.tar").getmembers()} == {b"0", b"1", b"2"}
    result = scan(src, tmp_path / "m")
    rows = rows_of(tmp_path / "m")
    assert (rows["alias.png"]["width"], rows["alias.png"]["height"]) == (33, 44)
    assert rows["a.jpg"]["error"] == rows["b.jpg"]["error"] == "link_loop"
    assert rows["gone.jpg"]["error"] == "broken_link" and "nowhere.jpg" in rows["gone.jpg"]["message"]
    assert rows["passwd.jpg"]["error"] == "not_an_image" and "root" not in rows["passwd.jpg"]["message"]
    assert "bytes of text" in rows["passwd.jpg"]["message"]
    for link in ("links.tar/hard.jpg", "links.tar/dir/soft.jpg"):  # read as the member they name
        assert (rows[link]["width"], rows[link]["member_offset"]) == (64, rows["links.tar/x.jpg"]["member_offset"])
    assert rows["links.tar/dead.jpg"]["error"] == "broken_link"
    assert rows["links.tar/loop1.jpg"]["error"] == rows["links.tar/loop2.jpg"]["error"] == "link_loop"
    s = result.meta.summary
    assert s.ignored_extensions == {"(broken link)": 1} and s.ignored_members == {"json": 1}
    assert len(rows) == result.samples + result.errors == 12 and result.listed == 12
