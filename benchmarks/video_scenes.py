"""Scene detection throughput: ``bucketeer annotate --task scenes`` vs PySceneDetect's own CLI on the same files.

    .venv/bin/python benchmarks/video_scenes.py [--videos 8] [--small 8] [--large 32] [--rounds 3]

Writes once (in ``--cache-dir``, default ``~/.cache/bucketeer/bench-scenes``) ``--videos`` distinct H.264 clips
with PyAV, 640x360, 24 fps, 240 frames each: four 60-frame shots (a different colour and a panning sinusoid
pattern each, hard cuts between them), hard-linked into folders of ``--small`` and ``--large`` files. Each method
runs on both, per round, and its **marginal** rate ``(large - small) / (t_large - t_small)`` drops start-up out
(median of ``--rounds``; page cache warm):

1. ``scenedetect -i FILE detect-content list-scenes -n`` (PySceneDetect's CLI, its defaults: OpenCV decode,
   frames downscaled to ~256 px wide), one process per file as a user's loop runs it: wall seconds;
2. PySceneDetect in-process (``scenedetect.detect(FILE, ContentDetector())``: the library alone, no process
   start), one thread: wall seconds;
3. :func:`pipeline.annotate.scenes.detect_scenes` alone (what the annotate workers run: PyAV decode at 256 px,
   ContentDetector + ThresholdDetector + motion), one thread: wall seconds;
4. ``bucketeer annotate MANIFEST --task scenes`` end to end (scan once before; a warm in-process Ray, one CPU
   worker, units of one video; a fresh ``--out`` each time): wall seconds of the job.

Prints videos/s and decoded frames/s of each, the ratios to the CLI (end to end / CLI: the target is >= 0.9),
whether our cuts equal the CLI's, and the load average (the machine may be shared: say so with the figures);
every round's rates and ratios go to ``benchmarks/results/video_scenes.json`` (``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from manifests.buckets import BucketSpec  # noqa: E402
from manifests.frames import FrameLadder  # noqa: E402
from pipeline.annotate.scenes import detect_scenes  # noqa: E402
from pipeline.ray_setup import loopback_only  # noqa: E402

from benchmarks.results import Run  # noqa: E402

loopback_only()

W, H, FRAMES, SHOT = 640, 360, 240, 60
CLI = shutil.which("scenedetect") or str(Path(sys.executable).with_name("scenedetect"))  # the venv's, else PATH's


def write_videos(folder: Path, n: int) -> list[Path]:
    """``n`` clips (module docstring), written once."""
    import av

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    x = np.arange(W, dtype=np.float32)[None, :]  # (1, W)
    y = np.arange(H, dtype=np.float32)[:, None]  # (H, 1)
    for v in range(n):
        path = folder / f"v{v:03d}.mp4"
        out.append(path)
        if path.exists():
            continue
        rng = np.random.default_rng(v)
        tmp = path.with_suffix(".part.mp4")
        with av.open(str(tmp), "w") as container:
            stream = container.add_stream("libx264", rate=24)
            stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
            for shot in range(FRAMES // SHOT):
                colour = rng.integers(30, 225, 3).astype(np.float32)
                fx, fy = rng.uniform(0.01, 0.05, 2)
                for i in range(SHOT):
                    wave = 40 * np.sin(fx * (x + 3 * i) + fy * y)  # (H, W): pans 3 px a frame
                    rgb = np.clip(colour[None, None, :] + wave[..., None], 0, 255).astype(np.uint8)  # (H, W, 3)
                    container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
            container.mux(stream.encode())
        tmp.rename(path)
    return out


def run_cli(path: Path) -> None:
    """``scenedetect -i FILE detect-content list-scenes -n`` (no CSV written), its printed scene list discarded."""
    subprocess.run([CLI, "-i", str(path), "detect-content", "list-scenes",
                    "-n"], capture_output=True, check=True)  # fmt: skip


def api_cuts(path: Path) -> list[int]:
    from scenedetect import ContentDetector, detect

    return [start.frame_num for start, _ in detect(str(path), ContentDetector())][1:]


def timed(fn, files: list[Path]) -> float:
    start = time.perf_counter()
    for f in files:
        fn(f)
    return time.perf_counter() - start


def linked(files: list[Path], folder: Path, n: int) -> list[Path]:
    """``n`` hard links to ``files`` in turn under ``folder`` (the same bytes, separate files to each tool)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        link = folder / f"l{i:04d}.mp4"
        if not link.exists():
            os.link(files[i % len(files)], link)
        out.append(link)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--videos", type=int, default=8, help="distinct videos written")
    p.add_argument("--small", type=int, default=8)
    p.add_argument("--large", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache/bucketeer/bench-scenes"))
    args = p.parse_args()
    if not Path(CLI).exists():
        sys.exit("benchmarks/video_scenes.py: the scenedetect CLI is not on PATH (pip install 'bucketeer[video]')")
    cache = Path(args.cache_dir)
    files = write_videos(cache / "videos", args.videos)
    sets = {n: linked(files, cache / f"set-{n}", n) for n in (args.small, args.large)}
    ours = {f: detect_scenes(str(f)).starts[1:].tolist() for f in files}
    agree = sum(ours[f] == api_cuts(f) for f in files)

    import ray

    from pipeline import AnnotateJob, ScanJob, run
    from pipeline.scan import ScanConfig

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    work = Path(tempfile.mkdtemp(prefix="bench-scenes-"))
    manifests = {}
    for n, linked_files in sets.items():
        manifests[n] = str(work / f"manifest-{n}")
        run(ScanJob(source=str(linked_files[0].parent), out=manifests[n], spec=BucketSpec(area=512 * 512),
                    frames=FrameLadder((17, 33, 49)), config=ScanConfig(progress=False)))  # fmt: skip

    def annotate(n: int, i: int) -> float:
        start = time.perf_counter()
        run(AnnotateJob(manifest=manifests[n], out=str(work / f"scenes-{n}-{i}"), tasks=("scenes",), device="cpu",
                        workers=1, unit_rows=1, torch_threads=1))  # fmt: skip
        return time.perf_counter() - start

    annotate(args.small, -1)  # warm: Ray Data's first pipeline of the process
    methods = {"cli": lambda n, i: timed(run_cli, sets[n]), "api": lambda n, i: timed(api_cuts, sets[n]),
               "ours": lambda n, i: timed(lambda f: detect_scenes(str(f)), sets[n]), "annotate": annotate}
    names = {"cli": "scenedetect CLI, a process per file", "api": "PySceneDetect in-process (detect())",
             "ours": "detect_scenes alone (PyAV 256 px, content+fade+motion)",
             "annotate": "bucketeer annotate --task scenes, end to end"}
    bench = Run("video_scenes", "python benchmarks/video_scenes.py" + "".join(f" {a}" for a in sys.argv[1:]),
                ["av", "scenedetect", "opencv-python-headless", "ray"])  # fmt: skip
    rates: dict[str, list[float]] = {k: [] for k in methods}
    for r in range(args.rounds):
        with bench.round():
            for name, method in methods.items():
                t_small, t_large = method(args.small, r), method(args.large, r)
                rates[name].append((args.large - args.small) / max(t_large - t_small, 1e-9))
            for name, label in names.items():
                bench.add(f"{label}: videos/s", rates[name][-1], "videos/s")
            cli = rates["cli"][-1]
            bench.add("annotate end to end / CLI", rates["annotate"][-1] / cli, "x", ">= 0.9")
            bench.add("PySceneDetect in-process / CLI", rates["api"][-1] / cli, "x")
            bench.add("detect_scenes alone / PySceneDetect in-process", rates["ours"][-1] / rates["api"][-1], "x")
            bench.add("videos whose cuts equal PySceneDetect's ContentDetector", agree, f"of {len(files)}")
    ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"{len(files)} distinct videos x {FRAMES} frames, {W}x{H} H.264; marginal rates over {args.small} and "
          f"{args.large} files, median of {args.rounds} rounds; {uptime}")
    print(f"cuts equal to PySceneDetect's ContentDetector on {agree} of {len(files)} videos")
    print(f"{'method':56} {'videos/s':>9} {'frames/s':>9} {'vs CLI':>7}  rounds (videos/s)")
    for k, name in names.items():
        print(f"{name:56} {med[k]:9.2f} {med[k] * FRAMES:9.0f} {med[k] / med['cli']:7.2f}  "
              f"{', '.join(f'{x:.2f}' for x in rates[k])}")
    bench.save()


if __name__ == "__main__":
    main()
