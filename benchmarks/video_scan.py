"""Video scan throughput as marginal rates: ``bucketeer scan --frames`` (container headers only) vs
``ffprobe -count_frames`` and a full PyAV decode (what users run to learn every clip's frame count and size).

    .venv/bin/python benchmarks/video_scan.py [--small 500] [--large 2000] [--decode-small 20] [--decode-large 100]

Writes once (in ``--cache-dir``, default ``~/.cache/bucketeer/bench-video``) eight distinct clips with
PyAV: H.264 .mp4 (moov at the end, as FFmpeg writes it), .mov (MPEG-4 part 2), .mkv (H.264) and VP9
.webm, 320x180 to 640x360 (a panning gradient with fresh grain in every frame: 1-10 MB per clip),
121 to 241 frames (a sample table of that many entries), then hard-links them into folders of
``--small`` and ``--large`` files (the header bytes a scan reads are the same whatever the link). In one
run, page cache warm, each method scans both folders once per round (``--rounds``, default 3, the methods
interleaved within a round) and reports the **marginal** rate ``(large - small) / (t_large - t_small)``, so that
start-up, listing and commit drop out:

1. ``bucketeer scan --frames 17,33,49,81`` of the local folder (a warm in-process Ray; wall clock);
2. :func:`pipeline.sources.video.probe_video` alone, one thread (CPU seconds of this process);
3. a full PyAV decode of every frame (one thread, CPU seconds), on ``--decode-small``/``--decode-large``;
4. ``ffprobe -v error -threads 1 -count_frames -select_streams v:0 -show_entries stream=nb_read_frames,width,height
   FILE``, one process per file as a user's loop runs it (CPU seconds of the children, start-up of each
   process included: that is what each file costs), on the same files as 3;
5. ``ffprobe -count_packets`` (``nb_read_packets``: demuxes every packet, decodes none) likewise.

ffprobe comes from Debian's ``ffmpeg`` package (``apt-get install -y ffmpeg``); without an ``ffprobe``
binary on PATH rows 4 and 5 are printed as skipped. Prints bytes read per file, the ratios, and a
side-by-side table of the rates; every round's rates and ratios go to ``benchmarks/results/video_scan.json``
(``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from manifests.frames import FrameLadder  # noqa: E402
from manifests.manifest import read_manifest  # noqa: E402
from manifests.buckets import BucketSpec  # noqa: E402
from pipeline.ray_setup import loopback_only, ray_session  # noqa: E402
from pipeline.scan import ScanConfig, ScanJob, scan_dataset  # noqa: E402
from pipeline.sources.video import probe_video  # noqa: E402

from benchmarks.results import Run  # noqa: E402

loopback_only()

CLIPS = (("a.mp4", "libx264", 640, 360, 241), ("b.mp4", "libx264", 480, 270, 121), ("c.mov", "mpeg4", 640, 360, 161),
         ("d.mkv", "libx264", 480, 272, 181), ("e.webm", "libvpx-vp9", 320, 180, 121),
         ("f.mp4", "libx264", 360, 640, 201), ("g.mp4", "libx264", 480, 480, 145), ("h.mkv", "libx264", 640, 360, 129))


def write_clips(folder: Path) -> list[Path]:
    import av

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    rng = np.random.default_rng(0)
    for name, codec, w, h, frames in CLIPS:
        path = folder / name
        paths.append(path)
        if path.exists():
            continue
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 // w, y * 255 // h, (x + y) * 255 // (w + h)], -1).astype(np.int16)
        base = base.astype(np.uint8)
        with av.open(str(path) + ".part", "w", format=path.suffix[1:].replace("mkv", "matroska")) as c:
            s = c.add_stream(codec, rate=24)
            s.width, s.height, s.pix_fmt = w, h, "yuv420p"
            s.options = {"deadline": "realtime", "cpu-used": "8"} if codec == "libvpx-vp9" else \
                {"preset": "veryfast", "crf": "16"} if codec == "libx264" else {"qscale": "3"}  # fmt: skip
            for i in range(frames):  # a panning gradient with fresh grain: a camera-like bitrate
                img = np.clip(np.roll(base, 2 * i, axis=1) + rng.integers(-10, 10, (h, w, 3)), 0, 255).astype(np.uint8)
                for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
        os.replace(str(path) + ".part", path)
    return paths


def link_folder(clips: list[Path], folder: Path, n: int) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    for i in range(n):
        sub = folder / f"{i // 1000:04d}"
        sub.mkdir(parents=True, exist_ok=True)
        clip = clips[i % len(clips)]
        os.link(clip, sub / f"{i:06d}{clip.suffix}")
    return folder


def files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def timed_scan(folder: Path, out: Path) -> float:
    start = time.perf_counter()
    scan_dataset(ScanJob(source=str(folder), out=str(out), spec=BucketSpec(area=256 * 256, step=16),
                         frames=FrameLadder((17, 33, 49, 81)), config=ScanConfig(progress=False)))  # fmt: skip
    return time.perf_counter() - start


def timed_probe(paths: list[Path]) -> tuple[float, int, int]:
    start, read, total = time.process_time(), 0, 0
    for p in paths:
        size = p.stat().st_size
        with open(p, "rb") as fh:
            probe = probe_video(lambda a, b: os.pread(fh.fileno(), b - a, a), size)
        assert probe.error is None, (p, probe.message)
        read, total = read + probe.bytes_read, total + size
    return time.process_time() - start, read, total


def timed_decode(paths: list[Path]) -> float:
    import av

    start = time.process_time()
    for p in paths:
        with av.open(str(p)) as c:
            sum(1 for _ in c.decode(video=0))
    return time.process_time() - start


FFPROBE_COUNTS = {"frames": ("-count_frames", "nb_read_frames"), "packets": ("-count_packets", "nb_read_packets")}


def timed_ffprobe(paths: list[Path], ffprobe: str, count: str = "frames") -> float:
    """CPU seconds (user + system) of one ffprobe process per file; checks each printed count is a number."""
    option, entry = FFPROBE_COUNTS[count]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for p in paths:
        out = subprocess.run([ffprobe, "-v", "error", "-threads", "1", option, "-select_streams", "v:0",
                              "-show_entries", f"stream={entry},width,height", "-of", "csv=p=0", str(p)],
                             check=True, capture_output=True, text=True).stdout  # fmt: skip
        assert out.strip().split(",")[-1].isdigit(), (p, out)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def marginal(n_small: int, t_small: float, n_large: int, t_large: float) -> float:
    return (n_large - n_small) / max(t_large - t_small, 1e-9)


def measure_round(run: Run, args: argparse.Namespace, small: Path, large: Path, work: Path, r: int) -> None:
    """One round: every method on both folders, its marginal rate and ratios added to ``run``."""
    t_s = timed_scan(small, work / f"ms{r}")
    t_l = timed_scan(large, work / f"ml{r}")
    rows = read_manifest(str(work / f"ml{r}")).samples
    read = rows.column("bytes_read").to_numpy()
    size = rows.column("size").to_numpy()
    scan_rate = marginal(args.small, t_s, args.large, t_l)
    print(f"1. bucketeer scan --frames: {args.small} files {t_s:.2f} s, {args.large} files {t_l:.2f} s (wall) -> "
          f"marginal {scan_rate:,.0f} files/s; {np.median(read) / 1e3:.1f} KB read per file (median), "
          f"{100 * read.sum() / size.sum():.1f}% of the bytes")
    p_s = timed_probe(files(small))[0]
    p_l, got, total = timed_probe(files(large))
    probe_rate = marginal(args.small, p_s, args.large, p_l)
    print(f"2. probe_video, one thread: marginal {probe_rate:,.0f} files/s (CPU), {100 * got / total:.1f}% of bytes")
    d_files_s, d_files_l = files(small)[: args.decode_small], files(large)[: args.decode_large]
    d_s, d_l = timed_decode(d_files_s), timed_decode(d_files_l)
    decode_rate = marginal(args.decode_small, d_s, args.decode_large, d_l)
    print(f"3. full PyAV decode, one thread: marginal {decode_rate:,.1f} files/s (CPU)")
    print(f"   probe / decode (one thread each): {probe_rate / decode_rate:,.0f}x")
    table = [("bucketeer scan --frames (wall, Ray, 2 CPUs)", scan_rate),
             ("probe_video, one thread (CPU)", probe_rate),
             ("full PyAV decode, one thread (CPU)", decode_rate)]  # fmt: skip
    ffprobe = shutil.which("ffprobe")
    for row, count in ((4, "frames"), (5, "packets")):
        name = f"ffprobe -count_{count} -threads 1, a process per file (CPU)"
        if not ffprobe:
            print(f"{row}. {name}: skipped, no ffprobe binary on PATH (apt-get install -y ffmpeg)")
            table.append((name, None))
            continue
        f_s = timed_ffprobe(d_files_s, ffprobe, count)  # once: CPU seconds, which the load does not inflate
        f_l = timed_ffprobe(d_files_l, ffprobe, count)
        rate = marginal(len(d_files_s), f_s, len(d_files_l), f_l)
        print(f"{row}. {name}: marginal {rate:,.1f} files/s; probe_video is {probe_rate / rate:,.0f}x faster")
        table.append((name, rate))
    print(f"\nround {r + 1}, side by side (marginal files/s):")
    for name, rate in table:
        print(f"  {name:<58} {'skipped' if rate is None else f'{rate:,.1f}':>10}")
    run.add("bucketeer scan --frames 17,33,49,81 (wall, warm Ray, 2 CPUs)", scan_rate, "files/s")
    run.add("probe_video alone, one thread (CPU)", probe_rate, "files/s")
    run.add("full PyAV decode, one thread (CPU)", decode_rate, "files/s")
    run.add("bytes read per file, median", float(np.median(read)) / 1e3, "KB")
    run.add("bytes read, share of the file bytes", 100 * read.sum() / size.sum(), "%")
    run.add("probe_video / full PyAV decode", probe_rate / decode_rate, "x")
    for name, rate in table[3:]:
        if rate is not None:
            what = name.split(",")[0]
            run.add(f"{what} (CPU)", rate, "files/s")
            run.add(f"probe_video / {what}", probe_rate / rate, "x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=500)
    parser.add_argument("--large", type=int, default=2000)
    parser.add_argument("--decode-small", type=int, default=20)
    parser.add_argument("--decode-large", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/bucketeer/bench-video"))
    args = parser.parse_args()
    cache = Path(args.cache_dir)
    clips = write_clips(cache / "clips")
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"clips: {len(clips)} distinct, {sum(p.stat().st_size for p in clips) / len(clips) / 1e3:.0f} KB mean")
    work = Path(tempfile.mkdtemp(prefix="bench-video-"))
    try:
        small = link_folder(clips, work / "small", args.small)
        large = link_folder(clips, work / "large", args.large)
        run = Run("video_scan", "python benchmarks/video_scan.py" + "".join(f" {x}" for x in sys.argv[1:]), ["av"])
        with ray_session():
            timed_scan(small, work / "warm")  # Ray's workers started and imported
            for r in range(args.rounds):
                with run.round():
                    measure_round(run, args, small, large, work, r)
        print(f"load average at end: {os.getloadavg()[0]:.1f}")
        run.save()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
