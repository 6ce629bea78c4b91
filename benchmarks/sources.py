"""Scan of WebDataset tar shards as marginal rates: bucketeer's header walk vs decoding every image.

    .venv/bin/python benchmarks/sources.py [--per-shard 500] [--small 2000] [--large 12000] [--latency-ms 20]

Generates once (in ``--cache-dir``, default ``~/.cache/bucketeer/bench-sources``, ~2.4 GB for 12,000
images) tar shards of ``--per-shard`` samples, each ``key.jpg`` (photo-like JPEGs of ~200 KB in
seven shapes; a fifth with a camera-like EXIF block of 8-40 KB, every other one of those rotated
by EXIF; ``--exif-every 0`` for none) + ``key.txt`` + ``key.json`` (img2dataset's layout). 200
distinct JPEGs are repeated across the samples: neither method caches anything between images, so
repetition changes no figure and keeps generation short. In one run and one warm local Ray (start-up excluded):

1. ``bucketeer scan`` of the local shards;
2. the same through an object-store stand-in that answers every request after ``--latency-ms``, any
   number in flight (:class:`benchmarks.scan.LatencyStorage`; no HTTP or signing cost);
3. the alternative a user has today: iterate every shard with ``tarfile`` (what ``webdataset`` does
   underneath) and decode every image with Pillow (+ ``exif_transpose``) to learn its size, one
   process per CPU, on ``--alternative`` shard counts (a smaller pair: it is far slower). It reads
   every byte of every shard.

Each rate is **marginal**: ``(large - small) / (t_large - t_small)``, best of two runs at each size,
so Ray start-up, listing and the manifest commit drop out. Prints requests and bytes read per image,
the bytes read as a share of the shards' bytes, and the ratio to the alternative.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from PIL import Image, ImageChops, ImageOps

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.scan import WORDS, LatencyStorage, marginal  # noqa: E402
from manifests.buckets import BucketSpec  # noqa: E402
from pipeline.ray_setup import loopback_only  # noqa: E402
from pipeline.scan import ScanConfig, scan_dataset  # noqa: E402

loopback_only()  # before ray is imported: local Ray listens on 127.0.0.1 only

SHAPES = ((800, 600), (600, 800), (900, 506), (506, 900), (700, 700), (960, 480), (820, 615))
DISTINCT = 200


def photos(n: int = DISTINCT, exif_every: int = 5) -> list[bytes]:
    """``n`` photo-like JPEGs of ~200 KB (a smooth colour field plus grain); every ``exif_every``-th
    (0: none) with a camera-like EXIF block of 8-40 KB, every other one of those rotated."""
    rng = np.random.default_rng(7)
    noise = Image.fromarray(rng.integers(0, 48, (1000, 1000, 3), dtype=np.uint8))
    out = []
    for i in range(n):
        r = np.random.default_rng(i)
        w, h = SHAPES[i % len(SHAPES)]
        coarse = r.integers(0, 200, (h // 24, w // 24, 3), dtype=np.uint8)  # (h/24, w/24, 3)
        smooth = Image.fromarray(coarse).resize((w, h), Image.Resampling.BILINEAR)
        ox, oy = r.integers(0, 1000 - w + 1), r.integers(0, 1000 - h + 1)
        kwargs = {"quality": int(r.integers(82, 90))}
        if exif_every and i % exif_every == 0:  # a camera's EXIF block: maker notes of 8-40 KB
            exif = Image.Exif()
            exif[0x0112] = 6 if i % (2 * exif_every) == 0 else 1
            exif.get_ifd(0x8769)[0x927C] = r.bytes(int(r.integers(8_000, 40_000)))
            kwargs["exif"] = exif.tobytes()
        buf = io.BytesIO()
        ImageChops.add(smooth, noise.crop((ox, oy, ox + w, oy + h))).save(buf, "JPEG", **kwargs)
        out.append(buf.getvalue())
    return out


def write_shards(folder: Path, count: int, per_shard: int, images: list[bytes]) -> None:
    """``count`` shards of ``per_shard`` samples each under ``folder``; written once."""
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(count):
        path = folder / f"{k:05d}.tar"
        if path.exists():
            continue
        tmp = path.with_suffix(".partial")
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
            for j in range(per_shard):
                i = k * per_shard + j
                key = f"{i:09d}"
                caption = " ".join(np.random.default_rng(i).choice(WORDS, 12))
                meta = json.dumps({"caption": caption, "url": f"https://example.invalid/{key}.jpg", "key": key})
                for name, data in ((f"{key}.jpg", images[i % len(images)]), (f"{key}.txt", caption.encode()),
                                   (f"{key}.json", meta.encode())):  # fmt: skip
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime = len(data), 1_700_000_000
                    tf.addfile(info, io.BytesIO(data))
        tmp.rename(path)


def subset(cache: Path, shards: int) -> Path:
    """A folder holding the first ``shards`` shards of the corpus (hard links: same page cache)."""
    root = cache / "sets" / f"s{shards}"
    root.mkdir(parents=True, exist_ok=True)
    for k in range(shards):
        link = root / f"{k:05d}.tar"
        if not link.exists():
            os.link(cache / "shards" / link.name, link)
    return root


def run_scan(root: Path, out: Path, fs=None) -> dict:
    start = time.perf_counter()
    meta = scan_dataset(str(root), str(out), spec=BucketSpec(), config=ScanConfig(progress=False), fs=fs)
    seconds = time.perf_counter() - start
    s = meta["summary"]
    assert s["errors"] == 0 and s["images_read"] == s["listed"] == s["samples"], s  # a real, complete scan
    shutil.rmtree(out)  # a fresh manifest each run: nothing is reused
    return {"images": s["listed"], "seconds": seconds, "requests": s["requests"], "bytes": s["bytes_read"],
            "shard_bytes": s["shard_bytes"]}  # fmt: skip


def decode_shard(path: str) -> tuple[int, int]:
    """The alternative for one shard: stream it, decode every image to learn its display size."""
    images = read = 0
    with tarfile.open(path, "r|") as tf:  # a stream, as webdataset reads a shard
        for member in tf:
            data = tf.extractfile(member).read() if member.isfile() else b""
            read += len(data)
            if member.name.endswith(".jpg"):
                with Image.open(io.BytesIO(data)) as im:
                    ImageOps.exif_transpose(im).size  # noqa: B018 (the size is the point)
                    images += 1
    return images, os.path.getsize(path)


def run_alternative(root: Path, cpus: int) -> dict:
    paths = sorted(str(p) for p in root.glob("*.tar"))
    start = time.perf_counter()
    with Pool(cpus) as pool:
        done = pool.map(decode_shard, paths)
    seconds = time.perf_counter() - start
    total = sum(b for _, b in done)
    return {"images": sum(n for n, _ in done), "seconds": seconds, "requests": len(paths), "bytes": total,
            "shard_bytes": total}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-shard", type=int, default=500)
    parser.add_argument("--small", type=int, default=2000, help="images in the small set (whole shards)")
    parser.add_argument("--large", type=int, default=12000, help="images in the large set (whole shards)")
    parser.add_argument("--alternative", default="1,3", help="the two shard counts for the alternative")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--cache-dir", default="~/.cache/bucketeer/bench-sources")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--exif-every", type=int, default=5,
                        help="every n-th distinct JPEG carries an 8-40 KB EXIF block (0: none); a new --cache-dir")
    args = parser.parse_args()
    small_shards, large_shards = args.small // args.per_shard, args.large // args.per_shard
    alt_small, alt_large = (int(x) for x in args.alternative.split(","))

    import ray

    cache = Path(args.cache_dir).expanduser().resolve()
    print(f"corpus: {cache} ({large_shards} shards x {args.per_shard} samples)", flush=True)
    images = photos(exif_every=args.exif_every)
    sizes = np.array([len(b) for b in images])
    write_shards(cache / "shards", large_shards, args.per_shard, images)
    small, large = subset(cache, small_shards), subset(cache, large_shards)
    shard_gb = sum(p.stat().st_size for p in large.glob("*.tar")) / 1e9
    print(f"  {large_shards * args.per_shard:,} images, {shard_gb:.2f} GB of shards; JPEGs median "
          f"{np.median(sizes) / 1e3:.0f} KB ({sizes.min() / 1e3:.0f}-{sizes.max() / 1e3:.0f} KB)", flush=True)
    # workers import LatencyStorage from benchmarks.scan (an fsspec class cannot be pickled by value)
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "manifest"
        run_scan(small, out)  # warm-up: Ray workers start, shards enter the page cache
        rows.append(("bucketeer scan, local shards", *marginal(lambda r: run_scan(r, out), small, large,
                                                                      count="images")))
        slow = LatencyStorage(args.latency_ms / 1000)
        rows.append((f"bucketeer scan, +{args.latency_ms:g} ms per request", *marginal(
            lambda r: run_scan(r, out, fs=slow), small, large, count="images")))  # fmt: skip
    ray.shutdown()
    alt = ("tarfile stream + Pillow decode of every image (local)",
           *marginal(lambda r: run_alternative(r, args.cpus), subset(cache, alt_small), subset(cache, alt_large),
                    count="images"))
    rows.append(alt)

    base = alt[1]
    print(f"\nmarginal rates (best of two at {args.small:,} and {args.large:,} images; the alternative at "
          f"{alt_small * args.per_shard:,} and {alt_large * args.per_shard:,}), {args.cpus} CPUs\n")  # fmt: skip
    print("| method | images/s (marginal) | vs alternative | requests per image | bytes read per image | "
          "share of shard bytes read |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, rate, r in rows:
        print(f"| {name} | {rate:,.0f} | {rate / base:,.0f}x | {r['requests'] / r['images']:.3f} | "
              f"{r['bytes'] / r['images'] / 1024:,.1f} KiB | {100 * r['bytes'] / r['shard_bytes']:.2f}% |")
    local, slow_run = rows[0], rows[1]
    share = 100 * local[2]["bytes"] / local[2]["shard_bytes"]
    print(f"\ntargets (issue 15): bytes read <= 5% of the shard bytes: {share:.2f}%"
          f"; >= 20x the alternative: {local[1] / base:,.0f}x local, {slow_run[1] / base:,.0f}x at "
          f"+{args.latency_ms:g} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    import benchmarks.sources  # run as that module, so Ray workers can import LatencyStorage by name

    sys.exit(benchmarks.sources.main())
