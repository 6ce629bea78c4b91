"""``bucketeer report`` of a video manifest: frame-count figures and a contact sheet per bucket whose
frames equal a full PyAV decode's, read from ranged reads, rendered by a real headless Chromium."""

from __future__ import annotations

import base64
import io
import os
import re

import numpy as np
import pytest

av = pytest.importorskip("av")

from manifests.buckets import BucketSpec  # noqa: E402
from manifests.manifest import read_manifest  # noqa: E402
from pipeline import ReportJob, run as report  # noqa: E402
from pipeline.report.video import clip_frame_indices, decode_frames  # noqa: E402
from pipeline.scan import ScanConfig, ScanJob, run as scan  # noqa: E402
from tests.test_report import _PROBE, MANIFEST_FIGURES, chromium_or_skip, run_chromium  # noqa: E402
from tests.test_video_scan import H264, LADDER, _write  # noqa: E402


def _full_decode(path) -> list[np.ndarray]:
    """Every frame of a full decode, RGB, upright (the display matrix applied as ``rotation`` degrees CCW)."""
    with av.open(str(path)) as container:
        return [np.rot90(f.to_ndarray(format="rgb24"), f.rotation // 90) for f in container.decode(video=0)]


def _pread(path):
    def read(start: int, end: int) -> bytes:
        with open(path, "rb") as fh:
            return os.pread(fh.fileno(), end - start, start)

    return read


@pytest.fixture(scope="module")
def video_manifest(tmp_path_factory, ray_local):
    root = tmp_path_factory.mktemp("report-clips")
    _write(root / "a.mp4", H264, 20)
    (root / "a.txt").write_text("a red ball\n")
    _write(root / "long.mp4", H264, 40, seed=1)
    _write(root / "b.mkv", H264, 12, seed=2)
    _write(root / "short.mp4", H264, 5, seed=3)  # too_short: no sheet
    if hasattr(av.video.stream.VideoStream, "set_display_rotation"):
        _write(root / "rotated.mp4", H264, 10, rotate=90, seed=4)
    from PIL import Image

    Image.new("RGB", (96, 64), "red").save(root / "still.png")
    out = str(tmp_path_factory.mktemp("report-video") / "m")
    scan(ScanJob(source=str(root), out=out, spec=BucketSpec(area=64 * 64, step=16), frames=LADDER,
                 config=ScanConfig(progress=False)))  # fmt: skip
    return root, out


def test_contact_sheet_frames_equal_a_full_decode(video_manifest, tmp_path):
    """First, middle and last frame of the first clip: the same pixels as a full decode's frames 0, F//2, F-1,
    upright; a long video is not read whole."""
    root, _ = video_manifest
    assert clip_frame_indices(17) == (0, 8, 16) and clip_frame_indices(2) == (0, 1)
    names = ["a.mp4", "b.mkv"] + (["rotated.mp4"] if (root / "rotated.mp4").exists() else [])
    for name in names:
        path = root / name
        images, read = decode_frames(_pread(path), path.stat().st_size, (0, 4, 8), long_side=1000)
        full = _full_decode(path)
        for index, image in zip((0, 4, 8), images):
            assert np.array_equal(np.asarray(image), full[index]), f"{name} frame {index}"
    if "rotated.mp4" in names:
        assert images[0].size == (48, 64)  # stored 64x48, displayed 48x64 as the scan's width/height
    # 120 frames with a keyframe every 12: frames 0, 8, 16 cost the header and the first GOPs, not the file
    long = tmp_path / "long.mp4"
    _write(long, H264, 120, size=(128, 96), options={"g": "12", "keyint_min": "12"}, seed=5)
    size, full = long.stat().st_size, _full_decode(long)
    for indices in ((0, 8, 16), (100,)):
        images, read = decode_frames(_pread(long), size, indices, long_side=1000)
        for index, image in zip(indices, images):
            assert np.array_equal(np.asarray(image), full[index]), f"long.mp4 frame {index}"
        assert read < 0.5 * size, f"frames {indices}: read {read} of {size} bytes"


def test_video_report_has_frame_figures_and_contact_sheets(video_manifest, tmp_path):
    from PIL import Image

    _, url = video_manifest
    out = tmp_path / "report.html"
    report(ReportJob(manifest=url, out=str(out), progress=False))
    page = out.read_text()
    figures = {p.stem for p in (tmp_path / "report_figures").glob("*.png")}
    assert figures == MANIFEST_FIGURES | {"video_frames", "frame_buckets"}
    manifest = read_manifest(url)
    videos = [r for r in manifest.samples.to_pylist() if r["frames"] > 1]
    buckets = sorted({r["bucket"] for r in videos})
    grids = dict(re.findall(r'<div class="grid" id="grid-sheet-([\dx]+)"><h3>[^<]*</h3><div class="thumbs">(.*?)'
                            r"</div></div>", page))  # fmt: skip
    assert sorted(grids) == buckets
    for bucket, body in grids.items():
        members = sorted((r for r in videos if r["bucket"] == bucket), key=lambda r: r["sample_id"])[:3]
        captions = re.findall(r"<figcaption>([^<]*)<br>frame (\d+) of (\d+)</figcaption>", body)
        clip = int(bucket.rsplit("x", 1)[1])
        assert captions == [(r["filename"], str(i), str(r["frames"])) for r in members
                            for i in clip_frame_indices(clip)]  # fmt: skip
        for data, row in zip(re.findall(r'src="data:image/jpeg;base64,([^"]+)"', body)[::3], members):
            assert Image.open(io.BytesIO(base64.b64decode(data))).size == (row["width"], row["height"])
    assert "frame counts from" in page and "images as 1-frame samples" in page


@pytest.mark.slow
def test_video_report_renders_in_headless_chromium(video_manifest, tmp_path):
    exe = chromium_or_skip()
    _, url = video_manifest
    out = tmp_path / "report.html"
    report(ReportJob(manifest=url, out=str(out), progress=False))
    probed = tmp_path / "probed.html"
    probed.write_text(out.read_text().replace("</body>", _PROBE + "</body>"))
    dom = run_chromium(exe, tmp_path, "--dump-dom", probed.as_uri())
    found = re.search(r'<pre id="probe">IMAGES (\d+) ([^<]*) GRIDS ([^<]*)</pre>', dom.stdout)
    assert found, f"probe did not run: {dom.stderr[-2000:]}"
    manifest = read_manifest(url)
    videos = [r for r in manifest.samples.to_pylist() if r["frames"] > 1]
    sheets = {b: min(3, sum(r["bucket"] == b for r in videos)) for b in {r["bucket"] for r in videos}}
    thumbs = sum(n * len(clip_frame_indices(int(b.rsplit("x", 1)[1]))) for b, n in sheets.items())
    items = [item.rsplit(":", 1) for item in found.group(2).split()]
    assert int(found.group(1)) == len(items) == len(MANIFEST_FIGURES) + 2 + thumbs
    for name, size in items:
        width, height = (int(v) for v in size.split("x"))
        assert width > 0 and height > 0, f"{name} did not decode in Chromium ({size})"
    grids = dict(item.split(":", 1) for item in found.group(3).split())
    assert grids == {f"grid-sheet-{b}": f"1:{n * len(clip_frame_indices(int(b.rsplit('x', 1)[1])))}"
                     for b, n in sheets.items()}, "each sheet: one row of its frames"  # fmt: skip
