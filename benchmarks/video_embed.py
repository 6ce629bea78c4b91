"""Video embed throughput as marginal rates: ``bucketeer embed`` of a video manifest end to end vs the VAE alone.

    .venv/bin/python benchmarks/video_embed.py [--small 16] [--large 128] [--frames 17] [--size 64] [--rounds 3]

Writes ``--large`` distinct H.264 clips (``--size`` square, ``--frames`` frames each, a panning gradient
with grain) with PyAV, then in one run, on this machine's CPU with the tiny random Wan
(``--family wan --model default``: AutoencoderKLWan, UMT5):

1. ``bucketeer scan --frames F`` then ``bucketeer embed --family wan --model default`` of the first
   ``--small`` clips and of all ``--large`` (after an untimed embed of 2 clips that warms Ray and the model
   files; wall clock of each embed, model loading included), marginal rate ``(large - small) / (t_large -
   t_small)``: clips/s with the reads, the PyAV decode in the workers, the crop, the VAE, gzip and the
   commits; and the embed's own steady-state rate of the large run (first unit result to last);
2. the VAE alone (``AutoencoderKLWan.encode``, the same batch size and torch threads) on the same clips
   already decoded and cropped, timed on ``small`` and ``large`` clips: its marginal clips/s.

The end-to-end rate over the VAE-alone rate is what the pipeline keeps of the encoder's speed. Each of
``--rounds`` rounds (default 3) measures both, one after the other, and writes its figures to
``benchmarks/results/video_embed.json`` (``benchmarks/results.py``); the clips and the warm-up are made once.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from manifests.buckets import BucketSpec  # noqa: E402
from manifests.frames import FrameLadder  # noqa: E402
from pipeline.ray_setup import loopback_only  # noqa: E402

from benchmarks.results import Run  # noqa: E402

loopback_only()


def write_clips(folder: Path, n: int, size: int, frames: int) -> list[Path]:
    import av

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size]
    paths = []
    for i in range(n):
        path = folder / f"clip_{i:04d}.mp4"
        with av.open(str(path), "w") as container:
            stream = container.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=24)
            stream.width = stream.height = size
            stream.pix_fmt = "yuv420p"
            for t in range(frames):
                base = np.stack([(xx + 3 * t + 11 * i) % 256, (yy * 2 + t) % 256, (xx + yy + 29 * i) % 256], -1)
                img = np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)
                for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        (folder / f"clip_{i:04d}.txt").write_text(f"a moving pattern number {i}\n")
        paths.append(path)
    return paths


def end_to_end(folder: Path, work: Path, frames: int, size: int, batch: int, threads: int) -> tuple[float, float]:
    """Seconds of one ``bucketeer embed`` (scan first, not timed) of ``folder``, and its steady clips/s."""
    from pipeline.embed import EmbedJob, run as embed
    from pipeline.scan import ScanConfig, ScanJob, run as scan

    manifest, cache = str(work / "m"), str(work / "c")
    scan(ScanJob(source=str(folder), out=manifest, spec=BucketSpec(area=size * size, step=16),
                 frames=FrameLadder((frames,)), config=ScanConfig(progress=False)))  # fmt: skip
    t = time.perf_counter()
    result = embed(EmbedJob(manifest=manifest, out=cache, family="wan", model="default", device="cpu", dtype="bf16",
                            batch_size=batch, shard_records=4 * batch, torch_threads=threads))  # fmt: skip
    seconds = time.perf_counter() - t
    assert result.errors == 0, result
    return seconds, result.images_per_second or 0.0


def decoded(paths: list[Path], frames: int, size: int) -> np.ndarray:
    """(n, F, H, W, 3) uint8: the clips as the workers decode and crop them."""
    from pipeline.embed.clips import decode_clip_frames
    from pipeline.embed.imaging import cover_and_crop, crop_resized

    out = np.zeros((len(paths), frames, size, size, 3), np.uint8)
    for i, path in enumerate(paths):
        def keep(c, k, img, i=i):
            resized, top_left = cover_and_crop((img.height, img.width), (size, size))
            out[i, k] = crop_resized(img, resized, top_left, (size, size))

        decode_clip_frames(str(path), [0], frames, keep)
    return out


def vae_alone(clips: np.ndarray, batch: int, threads: int) -> float:
    """Seconds for the tiny Wan VAE (as the embed workers load it) to encode ``clips`` in batches of ``batch``."""
    import torch

    from pipeline.embed.loading import EncoderSource, quiet_loading

    from pipeline.embed.latents import LatentSpec

    quiet_loading()
    torch.set_num_threads(threads)
    enc = LatentSpec(EncoderSource("default", "vae", family="wan")).load()
    enc.encode(clips[:1])  # warm-up
    t = time.perf_counter()
    for start in range(0, len(clips), batch):
        enc.encode(clips[start : start + batch])
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=16)
    parser.add_argument("--large", type=int, default=128)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="clips per VAE pass (a unit: 4 batches)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, of the embed's VAE actor and alone")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    run = Run("video_embed", "python benchmarks/video_embed.py" + "".join(f" {a}" for a in sys.argv[1:]), ["ray"])
    import ray

    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = write_clips(root / "all", args.large, args.size, args.frames)
        folders = {}
        for n in (2, args.small):
            folders[n] = root / f"first{n}"
            folders[n].mkdir()
            for p in paths[:n]:
                os.link(p, folders[n] / p.name)
                os.link(p.with_suffix(".txt"), folders[n] / p.with_suffix(".txt").name)
        folders[args.large] = root / "all"
        end_to_end(folders[2], root / "warm", args.frames, args.size, args.batch_size, args.threads)  # not reported
        clips = decoded(paths, args.frames, args.size)
        marginal = lambda t: (args.large - args.small) / (t[args.large] - t[args.small])  # noqa: E731
        for r in range(args.rounds):
            with run.round():
                runs = {n: end_to_end(folders[n], root / f"work{n}-{r}", args.frames, args.size, args.batch_size,
                                      args.threads) for n in (args.small, args.large)}  # fmt: skip
                e2e = {n: runs[n][0] for n in (args.small, args.large)}
                alone = {n: vae_alone(clips[:n], args.batch_size, args.threads) for n in (args.small, args.large)}
                print(f"round {r + 1}: clips {args.size}x{args.size}x{args.frames} (H.264), tiny Wan on CPU, batch "
                      f"{args.batch_size}, {args.threads} torch thread(s); load average {os.getloadavg()[0]:.1f}")
                print(f"  bucketeer embed end to end: {args.small} clips {e2e[args.small]:.1f}s, {args.large} clips "
                      f"{e2e[args.large]:.1f}s -> marginal {marginal(e2e):.2f} clips/s (steady state of the "
                      f"{args.large}: {runs[args.large][1]:.2f} clips/s)")
                print(f"  VAE alone on decoded clips:  {args.small} clips {alone[args.small]:.1f}s, {args.large} "
                      f"clips {alone[args.large]:.1f}s -> marginal {marginal(alone):.2f} clips/s")
                print(f"  end to end / VAE alone: {marginal(e2e) / marginal(alone):.2f}", flush=True)
                for n in (args.small, args.large):
                    run.add(f"bucketeer embed end to end, {n} clips", e2e[n], "s")
                    run.add(f"VAE alone on decoded clips, {n} clips", alone[n], "s")
                run.add("bucketeer embed end to end: marginal rate", marginal(e2e), "clips/s")
                run.add(f"bucketeer embed: steady state of the {args.large}-clip run (first unit to last)",
                        runs[args.large][1], "clips/s")  # fmt: skip
                run.add("VAE alone: marginal rate", marginal(alone), "clips/s")
                run.add("end to end / VAE alone (marginal)", marginal(e2e) / marginal(alone), "x")
    ray.shutdown()
    run.save()


if __name__ == "__main__":
    main()
