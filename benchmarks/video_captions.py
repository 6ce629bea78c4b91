"""Shot captions throughput: ``bucketeer annotate --task scenes,caption`` vs the captioner alone on the same frames.

    .venv/bin/python benchmarks/video_captions.py [--small 4] [--large 64] [--rounds 3] [--max-new-tokens 16]

Writes once (in ``--cache-dir``, default ``~/.cache/bucketeer/bench-captions``) H.264 videos of 320x180, 24 fps,
96 frames: two 48-frame shots (a colour and a panning sinusoid each, a hard cut between), ``--large`` distinct
files, the first ``--small`` of them a folder of their own. Per round, on both folders (marginal rate ``(shots
large - shots small) / (t_large - t_small)``: start-up and model loading drop out):

1. the captioner alone: :class:`pipeline.annotate.video_captions.ShotCaptioner` (``--model default``, the tiny
   random Qwen2.5-VL, on the CPU, one torch thread) on each shot's 8 frames, picked beforehand by
   :func:`pipeline.annotate.scenes.detect_scenes` (not timed), in batches of ``--batch-size`` shots of a video,
   as the annotate worker batches them: the model's own cost;
2. ``bucketeer annotate MANIFEST --task scenes,caption`` end to end (a warm in-process Ray, one CPU worker of one
   torch thread, units of one video, a fresh ``--out`` each time): decode, shot detection, the same captioner.

Prints shot captions/s of each and their ratio (end to end / alone), with the load average (the machine may be
shared: say so with the figures); every round goes to ``benchmarks/results/video_captions.json``
(``benchmarks/results.py``). The tiny model's captions are noise; a real captioner's tokens cost far more than
the decode, so its ratio would sit nearer 1.
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

W, H, FRAMES, SHOT, PICKS = 320, 180, 96, 48, 8


def write_videos(folder: Path, n: int) -> list[Path]:
    """``n`` videos (module docstring), written once."""
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
            for _ in range(FRAMES // SHOT):
                colour = rng.integers(30, 225, 3).astype(np.float32)
                fx, fy = rng.uniform(0.02, 0.08, 2)
                for i in range(SHOT):
                    wave = 40 * np.sin(fx * (x + 3 * i) + fy * y)  # (H, W): pans 3 px a frame
                    rgb = np.clip(colour[None, None, :] + wave[..., None], 0, 255).astype(np.uint8)  # (H, W, 3)
                    container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
            container.mux(stream.encode())
        tmp.rename(path)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", type=int, default=4, help="videos in the small folder")
    p.add_argument("--large", type=int, default=64, help="videos in the large folder")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8, help="shots per generate")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache/bucketeer/bench-captions"))
    args = p.parse_args()
    cache = Path(args.cache_dir)
    files = write_videos(cache / "videos", args.large)
    small = cache / f"small-{args.small}"
    small.mkdir(exist_ok=True)
    for f in files[: args.small]:
        if not (small / f.name).exists():
            os.link(f, small / f.name)
    folders = {args.small: small, args.large: cache / "videos"}
    picked = {f: detect_scenes(str(f), keep=(PICKS,)) for f in files}
    shots = {n: sum(len(picked[f].starts) for f in files[:n]) for n in folders}

    import ray
    import torch

    from pipeline import AnnotateJob, ScanJob, run
    from pipeline.annotate.engines import DEFAULT_VIDEO_PROMPT, CaptionSpec
    from pipeline.annotate.video_captions import ShotCaptioner
    from pipeline.scan import ScanConfig

    torch.set_num_threads(1)
    home = os.environ.setdefault("BUCKETEER_HOME", str(cache / "home"))
    captioner = ShotCaptioner(CaptionSpec(model="default", home=home, prompt=DEFAULT_VIDEO_PROMPT,
                                          max_new_tokens=args.max_new_tokens, shot_frames=PICKS))  # fmt: skip

    def alone(n: int, i: int) -> float:
        start = time.perf_counter()
        for f in files[:n]:
            s = picked[f]
            frames = [s.kept.pick(int(a), int(k), PICKS) for a, k in zip(s.starts, s.frames)]
            fps = [s.rate * PICKS / int(k) for k in s.frames]
            for at in range(0, len(frames), args.batch_size):
                captioner.caption(frames[at : at + args.batch_size], fps[at : at + args.batch_size])
        return time.perf_counter() - start

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    work = Path(tempfile.mkdtemp(prefix="bench-captions-"))
    manifests = {}
    for n, folder in folders.items():
        manifests[n] = str(work / f"manifest-{n}")
        run(ScanJob(source=str(folder), out=manifests[n], spec=BucketSpec(area=W * H, step=16),
                    frames=FrameLadder((17, 33)), config=ScanConfig(progress=False)))  # fmt: skip

    def annotate(n: int, i: int) -> float:
        start = time.perf_counter()
        run(AnnotateJob(manifest=manifests[n], out=str(work / f"captions-{n}-{i}"), tasks=("scenes", "caption"),
                        device="cpu", workers=1, unit_rows=1, torch_threads=1, batch_size=args.batch_size,
                        max_new_tokens=args.max_new_tokens))  # fmt: skip
        return time.perf_counter() - start

    annotate(args.small, -1)  # warm: Ray Data's first pipeline of the process, the default model built
    methods = {"alone": alone, "annotate": annotate}
    names = {"alone": "ShotCaptioner alone on the picked frames", "annotate": "annotate --task scenes,caption"}
    bench = Run("video_captions", "python benchmarks/video_captions.py" + "".join(f" {a}" for a in sys.argv[1:]),
                ["transformers", "av", "scenedetect", "ray"])  # fmt: skip
    rates: dict[str, list[float]] = {k: [] for k in methods}
    for r in range(args.rounds):
        with bench.round():
            for name, method in methods.items():
                t_small, t_large = method(args.small, r), method(args.large, r)
                rates[name].append((shots[args.large] - shots[args.small]) / max(t_large - t_small, 1e-9))
            for name, label in names.items():
                bench.add(f"{label}: shot captions/s", rates[name][-1], "shots/s")
            bench.add("annotate end to end / captioner alone", rates["annotate"][-1] / rates["alone"][-1], "x")
    ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"{args.large} videos of {FRAMES} frames ({FRAMES // SHOT} shots), {W}x{H} H.264, {PICKS} frames a shot, "
          f"{args.max_new_tokens} new tokens; marginal over {shots[args.small]} and {shots[args.large]} shots, "
          f"median of {args.rounds} rounds; {uptime}")  # fmt: skip
    for k, name in names.items():
        print(f"{name:44} {med[k]:7.2f} shots/s  rounds: {', '.join(f'{x:.2f}' for x in rates[k])}")
    print(f"end to end / alone: {med['annotate'] / med['alone']:.2f}x")
    bench.save()


if __name__ == "__main__":
    main()
