"""bucketeer scan --frames: header-only video scan (PyAV over ranged reads) and WxHxF frame buckets.

The clips are written here with PyAV (tiny: 64x48, 5-40 frames) and every scanned figure is compared
with a full PyAV decode of the same file.
"""

from __future__ import annotations

import json
import os
import shutil
from fractions import Fraction

import numpy as np
import pytest

av = pytest.importorskip("av")

from manifests.buckets import BucketSpec  # noqa: E402
from manifests.errors import UsageError  # noqa: E402
from manifests.frames import FrameLadder, assign_frames, parse_video_bucket  # noqa: E402
from manifests.manifest import read_manifest  # noqa: E402
from manifests.schema import SAMPLES_SCHEMA  # noqa: E402
from pipeline.cli import main  # noqa: E402
from pipeline.scan import ScanConfig, ScanJob, run  # noqa: E402
from pipeline.sources.video import probe_video  # noqa: E402

H264 = "libx264" if "libx264" in av.codecs_available else "mpeg4"
LADDER = FrameLadder((9, 17))


def _write(path, codec: str, frames: int, *, size=(64, 48), rotate: int | None = None, options=None,
           pts: list[int] | None = None, seed: int = 0) -> None:  # fmt: skip
    """A clip of random frames; ``pts`` in milliseconds makes it variable-rate."""
    w, h = size
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=24)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        if options:
            stream.options = options
        if pts is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        if rotate is not None:
            stream.set_display_rotation(rotate)
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8), format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[i], Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _decoded(path) -> tuple[int, int, int]:
    """``(width, height, frames)`` of a full decode, in display orientation."""
    with av.open(str(path)) as container:
        frames = list(container.decode(video=0))
    first = frames[0]
    w, h = (first.height, first.width) if first.rotation % 180 else (first.width, first.height)
    return w, h, len(frames)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    _write(root / "h264.mp4", H264, 20)
    (root / "h264.txt").write_text("a red ball\n")
    _write(root / "long.mp4", H264, 40)  # 40 frames: 2 clips of 17
    _write(root / "short.mp4", H264, 5)  # below the shortest bucket: too_short
    _write(root / "mpeg4.mov", "mpeg4", 12)
    _write(root / "h264.mkv", H264, 20)
    if "libvpx-vp9" in av.codecs_available:
        _write(root / "vp9.webm", "libvpx-vp9", 20, options={"deadline": "realtime", "cpu-used": "8"})
    if hasattr(av.video.stream.VideoStream, "set_display_rotation"):
        _write(root / "rotated.mp4", H264, 10, rotate=90)
    _write(root / "vfr.mp4", H264, 12, pts=[0, 40, 50, 120, 130, 140, 300, 310, 320, 330, 500, 510])
    # > 1 MB: the first (lossless noise) frame is what find_stream_info reads beyond the moov box
    options = {"crf": "0", "preset": "ultrafast"} if H264 == "libx264" else {"qscale": "1"}
    _write(root / "big.mp4", H264, 40, size=(160, 120), options=options)
    (root / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom" + os.urandom(4000))
    from PIL import Image

    Image.new("RGB", (96, 64), "red").save(root / "still.png")
    return root


@pytest.fixture(scope="module")
def scanned(clips, ray_local, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("video-manifest") / "m")
    result = run(ScanJob(source=str(clips), out=out, spec=BucketSpec(area=64 * 64, step=16), frames=LADDER,
                         config=ScanConfig(progress=False)))  # fmt: skip
    return result, read_manifest(out)


def test_frame_ladder_and_clip_counts():
    assert FrameLadder.parse_rule("4k+1:max=81").frames == tuple(range(5, 82, 4))
    assert FrameLadder.parse_rule("4k+1:min=17:max=33").frames == (17, 21, 25, 29, 33)
    assert FrameLadder.parse_list("33,17, 17").frames == (17, 33)
    for bad in ("4k+1", "k+1:max=9", "0k+1:max=9"):
        with pytest.raises(UsageError, match="--frame-ladder"):
            FrameLadder.parse_rule(bad)
    with pytest.raises(UsageError, match="frame buckets"):
        FrameLadder.parse_list("1,17")
    bucket, clips, short = assign_frames(FrameLadder((17, 33)), np.array([5, 17, 32, 33, 65, 66, 200]))
    assert bucket.tolist() == [0, 17, 17, 33, 33, 33, 33]
    assert clips.tolist() == [0, 1, 1, 1, 1, 2, 6]  # frames // bucket: non-overlapping clips
    assert short.tolist() == [True] + [False] * 6
    assert parse_video_bucket("832x480x81") == (832, 480, 81)


def test_scan_matches_full_decode(scanned, clips):
    result, manifest = scanned
    rows = {r["filename"]: r for r in manifest.samples.to_pylist()}
    videos = [n for n in rows if not n.endswith(".png")]
    assert {"h264.mp4", "long.mp4", "mpeg4.mov", "h264.mkv", "vfr.mp4", "big.mp4"} <= set(videos)
    for name in videos:
        row = rows[name]
        assert (row["width"], row["height"], row["frames"]) == _decoded(clips / name), name
        w, h, f = parse_video_bucket(row["bucket"])
        assert f <= row["frames"] and row["clips"] == row["frames"] // f
    assert rows["h264.mp4"]["caption"] == "a red ball"
    assert rows["h264.mp4"]["frame_count_from"] == "index" and rows["h264.mkv"]["frame_count_from"] == "duration*fps"
    assert rows["long.mp4"]["bucket"].endswith("x17") and rows["long.mp4"]["clips"] == 2
    assert rows["vfr.mp4"]["frames"] == 12 and rows["h264.mp4"]["fps"] == pytest.approx(24)
    assert rows["h264.mp4"]["codec"] == ("h264" if H264 == "libx264" else "mpeg4")
    if "rotated.mp4" in rows:  # stored 64x48, displayed 48x64
        assert (rows["rotated.mp4"]["width"], rows["rotated.mp4"]["height"]) == (48, 64)
    # an image joins as a 1-frame sample
    still = rows["still.png"]
    assert (still["frames"], still["clips"]) == (1, 1) and still["bucket"].endswith("x1")
    errors = {r["filename"]: r for r in manifest.errors.to_pylist()}
    assert errors["short.mp4"]["error"] == "too_short" and errors["short.mp4"]["frames"] == 5
    assert errors["broken.mp4"]["error"] == "not_a_video"
    assert manifest.meta.frame_ladder == (9, 17)
    assert result.errors_by_kind == {"too_short": 1, "not_a_video": 1}


def test_header_reads_are_a_small_share_of_a_large_file(scanned, clips):
    _, manifest = scanned
    big = next(r for r in manifest.samples.to_pylist() if r["filename"] == "big.mp4")
    assert big["size"] > 1_000_000, "the test clip must be over 1 MB"
    assert big["bytes_read"] <= 0.05 * big["size"]
    path = str(clips / "big.mp4")
    with open(path, "rb") as fh:  # the probe alone: same figures, nothing decoded
        probe = probe_video(lambda a, b: os.pread(fh.fileno(), b - a, a), os.path.getsize(path))
    assert (probe.width, probe.height, probe.frames, probe.bytes_read) == (160, 120, 40, big["bytes_read"])


def test_plan_and_rebucket_take_a_video_manifest_embed_wants_a_video_vae(scanned, tmp_path, capsys):
    result, _ = scanned
    plan = str(tmp_path / "plan")  # plan takes a video manifest (tests/test_plan_video.py), and checks it
    assert main(["plan", result.url, "--out", plan, "--world-size", "1", "--max-tokens", "128",
                 "--leftover", "pad"]) == 0  # fmt: skip
    assert main(["plan", "--check", plan, result.url]) == 0
    assert main(["embed", result.url, "--out", str(tmp_path / "cache")]) == 2
    again = str(tmp_path / "re")  # rebucket with the scan's own options gives the scan's rows back
    assert main(["rebucket", result.url, "--out", again, "--resolution", "64", "--bucket-step", "16"]) == 0
    assert read_manifest(again).samples.to_pylist() == read_manifest(result.url).samples.to_pylist()
    assert read_manifest(again).errors.to_pylist() == read_manifest(result.url).errors.to_pylist()
    err = capsys.readouterr().err
    assert "clips need a video VAE: --family wan" in err


def test_image_scan_ignores_videos_and_rescans_over_a_video_manifest(scanned, clips, ray_local, tmp_path):
    """An image scan counts videos as ignored files and writes an image manifest, also where a video manifest
    was (its reused image rows lose the video columns); a video scan there gives the video manifest again."""
    result, video = scanned
    out = str(tmp_path / "m")
    shutil.copytree(result.url, out)
    images = run(ScanJob(source=str(clips), out=out, spec=BucketSpec(area=64 * 64, step=16),
                         config=ScanConfig(progress=False)))  # fmt: skip
    assert images.samples == 1 and images.meta.summary.ignored_extensions["mp4"] >= 5
    assert "frame_ladder" not in json.loads(open(os.path.join(out, "_manifest.json")).read())
    samples = read_manifest(out).samples
    assert samples.schema == SAMPLES_SCHEMA and samples.column("bucket").to_pylist() == ["80x48"]  # no video columns
    again = run(ScanJob(source=str(clips), out=out, spec=BucketSpec(area=64 * 64, step=16), frames=LADDER,
                        config=ScanConfig(progress=False)))  # fmt: skip
    def rows_of(manifest):
        return [{k: r[k] for k in ("filename", "bucket", "frames", "clips", "caption")}
                for r in manifest.samples.to_pylist()]  # fmt: skip

    assert again.meta.frame_ladder == (9, 17) and rows_of(read_manifest(out)) == rows_of(video)


def test_a_rescan_reuses_unchanged_videos_rows(scanned, clips, ray_local, tmp_path):
    """A video scan over its own manifest reads no header of an unchanged video (its row as before, its sidecar
    read again); a changed video is probed again, a read failure retried."""
    result, video = scanned
    source = tmp_path / "clips"
    shutil.copytree(clips, source)
    out = str(tmp_path / "m")
    first = run(ScanJob(source=str(source), out=out, spec=BucketSpec(area=64 * 64, step=16), frames=LADDER,
                        config=ScanConfig(progress=False)))  # fmt: skip
    _write(source / "long.mp4", H264, 60, seed=9)  # changed: 60 frames now
    (source / "h264.txt").write_text("a blue ball\n")  # a sidecar edit: its caption is read again
    again = run(ScanJob(source=str(source), out=out, spec=BucketSpec(area=64 * 64, step=16), frames=LADDER,
                        config=ScanConfig(progress=False)))  # fmt: skip
    loose = len([p for p in os.listdir(source) if p.rsplit(".", 1)[-1] in ("mp4", "mov", "mkv", "webm")])
    assert first.meta.summary.other["videos_reused"] == 0 and again.meta.summary.other["videos_reused"] == loose - 1
    before = {r["filename"]: r for r in video.samples.to_pylist()}  # the same files, scanned in the fixture
    rows = {r["filename"]: r for r in read_manifest(out).samples.to_pylist()}
    assert rows["long.mp4"]["frames"] == 60 and rows["long.mp4"]["bytes_read"] > 0
    assert rows["h264.mp4"]["caption"] == "a blue ball" and rows["h264.mp4"]["bytes_read"] == 0
    errors = {r["filename"]: r["error"] for r in read_manifest(out).errors.to_pylist()}
    assert errors == {r["filename"]: r["error"] for r in video.errors.to_pylist()}  # broken, too_short: kept
    for name, row in rows.items():
        if name not in ("long.mp4", "h264.mp4", "still.png"):
            same = ("width", "height", "frames", "fps", "duration", "codec", "format", "frame_count_from", "bucket",
                    "clips")  # fmt: skip
            assert {k: row[k] for k in same} == {k: before[name][k] for k in same}, name
