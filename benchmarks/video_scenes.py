"""Scene detection throughput: ``bucketeer annotate --task scenes`` vs PySceneDetect's own CLI on the same files.

    .venv/bin/python benchmarks/video_scenes.py [--videos 8] [--rounds 3]

Writes once (in ``--cache-dir``, default ``~/.cache/bucketeer/bench-scenes``) ``--videos`` distinct H.264 clips
with PyAV, 640x360, 24 fps, 240 frames each: four 60-frame shots (a different colour and a panning sinusoid
pattern each, hard cuts between them). Then, per round (median of ``--rounds``; page cache warm):

1. ``scenedetect -i FILE detect-content list-scenes -n`` (PySceneDetect's CLI, its defaults: OpenCV decode,
   frames downscaled to ~256 px wide), one process per file as a user's loop runs it: wall seconds;
2. PySceneDetect in-process (``scenedetect.detect(FILE, ContentDetector())``: the library alone, no process
   start), one thread: wall seconds;
3. :func:`pipeline.annotate.scenes.detect_scenes` alone (what the annotate workers run: PyAV decode at 256 px,
   ContentDetector + ThresholdDetector + motion), one thread: wall seconds;
4. ``bucketeer annotate MANIFEST --task scenes`` end to end (scan once before; a warm in-process Ray, one CPU
   worker; a fresh ``--out`` each round): wall seconds of the job, and its steady-state rate (from its first unit
   done, units of one video).

Prints videos/s and decoded frames/s of each, the ratios to the CLI (end to end / CLI: the target is >= 0.9),
whether our cuts equal the CLI's, and the load average (the machine may be shared: say so with the figures).
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--videos", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache/bucketeer/bench-scenes"))
    args = p.parse_args()
    if not Path(CLI).exists():
        sys.exit("benchmarks/video_scenes.py: the scenedetect CLI is not on PATH (pip install 'bucketeer[video]')")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    files = write_videos(Path(args.cache_dir) / "videos", args.videos)
    ours = {f: detect_scenes(str(f)).starts[1:].tolist() for f in files}
    theirs = {f: api_cuts(f) for f in files}
    agree = sum(ours[f] == theirs[f] for f in files)

    import ray

    from pipeline import AnnotateJob, ScanJob, run
    from pipeline.scan import ScanConfig

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    work = Path(tempfile.mkdtemp(prefix="bench-scenes-"))
    manifest = str(work / "manifest")
    run(ScanJob(source=str(files[0].parent), out=manifest, spec=BucketSpec(area=512 * 512),
                frames=FrameLadder((17, 33, 49)), config=ScanConfig(progress=False)))  # fmt: skip

    def annotate(i: int) -> tuple[float, float | None]:
        start = time.perf_counter()
        result = run(AnnotateJob(manifest=manifest, out=str(work / f"scenes-{i}"), tasks=("scenes",), device="cpu",
                                 workers=1, unit_rows=1, torch_threads=1))  # fmt: skip
        return time.perf_counter() - start, result.images_per_second

    annotate(-1)  # warm: Ray Data's first pipeline of the process
    rows: dict[str, list[float]] = {"cli": [], "api": [], "ours": [], "annotate": [], "annotate_steady": []}
    for r in range(args.rounds):
        rows["cli"].append(timed(run_cli, files))
        rows["api"].append(timed(api_cuts, files))
        rows["ours"].append(timed(lambda f: detect_scenes(str(f)), files))
        seconds, steady = annotate(r)
        rows["annotate"].append(seconds)
        rows["annotate_steady"].append(len(files) / steady if steady else float("nan"))
    ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    n = len(files)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{n} videos x {FRAMES} frames, {W}x{H} H.264; median of {args.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.1f} (uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()})")  # noqa: E501
    print(f"cuts equal to PySceneDetect's ContentDetector on {agree} of {n} videos")
    names = {"cli": "scenedetect CLI, a process per file", "api": "PySceneDetect in-process (detect())",
             "ours": "detect_scenes alone (PyAV 256 px, content+fade+motion)",
             "annotate": "bucketeer annotate --task scenes, end to end",
             "annotate_steady": "bucketeer annotate, steady state (from its first unit)"}
    print(f"{'method':58} {'videos/s':>9} {'frames/s':>9} {'vs CLI':>7}")
    for k, name in names.items():
        rate = n / med[k]
        print(f"{name:58} {rate:9.2f} {rate * FRAMES:9.0f} {med['cli'] / med[k]:7.2f}")


if __name__ == "__main__":
    main()
