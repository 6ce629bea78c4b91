"""A late clip of a long video: embed's decode with a seek to the keyframe before the clip vs from frame 0.

    .venv/bin/python benchmarks/video_seek.py [--frames 1440] [--start 1400] [--rounds 3]

Writes once (in ``--cache-dir``, default ``~/.cache/bucketeer/bench-seek``) one H.264 clip with PyAV, 640x360,
24 fps, ``--frames`` frames (a panning sinusoid; x264's defaults: a keyframe at least every 250 frames, B-frames),
then times, median of ``--rounds``, one thread, page cache warm, the decode of the 17-frame clip at ``--start``
(frames handed over as the embed workers take them, cropped images not kept):

1. before: a decode forward from frame 0 (what embed did before issue 39);
2. after: :func:`pipeline.embed.clips.decode_clip_frames` (a seek to the keyframe at or before the clip, then
   forward to it), checked frame-exact against 1;

each through a :class:`~pipeline.sources.headers.RangeReader` over the bytes in memory (as over object storage),
which also counts the bytes each read. Prints seconds, frames decoded and bytes read of each, the ratio, and the
load average (the machine may be shared: say so with the figures). Each round's figures go to
``benchmarks/results/video_seek.json`` (``benchmarks/results.py``; the two decodes interleaved within a round).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.embed import clips  # noqa: E402
from pipeline.sources.headers import RangeReader  # noqa: E402

from benchmarks.results import Run  # noqa: E402

W, H, CLIP = 640, 360, 17


def write_video(path: Path, frames: int) -> bytes:
    import av

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        x, y = np.arange(W, dtype=np.float32)[None, :], np.arange(H, dtype=np.float32)[:, None]
        tmp = path.with_suffix(".part.mp4")
        with av.open(str(tmp), "w") as container:
            stream = container.add_stream("libx264", rate=24)
            stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
            for i in range(frames):
                wave = 100 + 80 * np.sin(0.03 * (x + 3 * i) + 0.02 * y)  # (H, W)
                rgb = np.repeat(wave[..., None], 3, axis=2).astype(np.uint8)  # (H, W, 3)
                container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
            container.mux(stream.encode())
        tmp.rename(path)
    return path.read_bytes()


def decode(data: bytes, start: int, seek: bool) -> tuple[float, int, int, list[np.ndarray]]:
    """``(seconds, frames decoded, bytes read, the clip's frames)``."""
    reader = RangeReader(lambda a, b: data[a:b], len(data), 256 * 1024, max_bytes=1 << 62, max_fetch=8 << 20,
                         keep_chunks=4)  # fmt: skip
    got: dict[int, np.ndarray] = {}
    keep = lambda c, k, img: got.__setitem__(k, np.asarray(img))  # noqa: E731
    t = time.perf_counter()
    if seek:
        n = clips.decode_clip_frames(reader, [start], CLIP, keep)
    else:
        n = clips._decode_clips(reader, [start], CLIP, keep, seek=False)  # the forward decode, as before the seek
    return time.perf_counter() - t, n, reader.bytes_read, [got[k] for k in range(CLIP)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=1440)
    p.add_argument("--start", type=int, default=1400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache/bucketeer/bench-seek"))
    args = p.parse_args()
    data = write_video(Path(args.cache_dir) / f"long-{args.frames}.mp4", args.frames)
    run = Run("video_seek", "python benchmarks/video_seek.py" + "".join(f" {a}" for a in sys.argv[1:]), ["av"])
    runs = {False: [], True: []}
    for _ in range(args.rounds):
        with run.round():
            for seek in (False, True):
                runs[seek].append(decode(data, args.start, seek))
            before, after = runs[False][-1], runs[True][-1]
            run.add("forward from frame 0 (before): seconds", before[0], "s")
            run.add("seek to the keyframe before (after): seconds", after[0], "s")
            run.add("frames decoded: forward / seek", before[1] / after[1], "x")
            run.add("speed-up: forward / seek", before[0] / after[0], "x")
    for a, b in zip(runs[False][0][3], runs[True][0][3]):
        np.testing.assert_array_equal(a, b)  # frame-exact
    print(f"{W}x{H} H.264, {args.frames} frames ({len(data) / 1e6:.1f} MB); the {CLIP}-frame clip at frame "
          f"{args.start}; median of {args.rounds}; load average {os.getloadavg()[0]:.1f}; frames equal: yes")
    med = {}
    for seek, name in ((False, "forward from frame 0 (before)"), (True, "seek to the keyframe before (after)")):
        seconds = statistics.median(r[0] for r in runs[seek])
        med[seek] = seconds
        _, n, read, _ = runs[seek][0]
        print(f"{name:38} {seconds:8.3f} s {n:6d} frames decoded {read / 1e6:8.2f} MB read")
    print(f"speed-up: {med[False] / med[True]:.1f}x")
    run.save()


if __name__ == "__main__":
    main()
