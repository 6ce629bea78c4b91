"""Scan throughput: bucketeer's header-only scan vs ray.data.read_images vs a read-and-decode loop.

    .venv/bin/python benchmarks/scan.py [--files 500] [--latency-ms 20]

Generates (once, cached in bench-output/scan-corpus) realistic JPEGs of 1-3 MB in several shapes,
then, in one run and one Ray instance: (1) `bucketeer scan` on the folder, (2) `ray.data.read_images`
(the Ray-native way to get every image's size: it decodes every image), (3) a read-and-decode loop
(what a trainer's discovery does: open + load each file), and (4) the scan again with every
storage request delayed by --latency-ms through an fsspec wrapper (object-store latency).
Prints files/s, median bytes read per file, and the ratios to read_images.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from manifests.buckets import BucketSpec  # noqa: E402
from pipeline.ray_setup import loopback_only  # noqa: E402
from pipeline.scan import ScanConfig, scan_dataset  # noqa: E402

loopback_only()  # before ray is imported: local Ray listens on 127.0.0.1 only

SHAPES = ((2000, 1500), (1500, 2000), (2400, 1350), (1350, 2400), (1800, 1800), (2600, 1300), (2200, 1650))


class SlowStorage(AbstractFileSystem):
    """The local filesystem with ``latency_s`` added to every request (list, info, ranged read)."""

    protocol = "slow"
    cachable = False

    def __init__(self, latency_s: float, **kwargs):
        super().__init__(latency_s=latency_s)
        self.latency_s = latency_s
        self.local = LocalFileSystem()

    def find(self, path, **kwargs):
        time.sleep(self.latency_s)
        return self.local.find(path, **kwargs)

    def info(self, path, **kwargs):
        time.sleep(self.latency_s)
        return self.local.info(path, **kwargs)

    def isdir(self, path):
        return self.local.isdir(path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        time.sleep(self.latency_s)
        return self.local.cat_file(path, start=start, end=end)


def make_corpus(folder: Path, n: int) -> list[Path]:
    """``n`` photo-like JPEGs of 1-3 MB (noise over smooth colour fields), generated once."""
    folder.mkdir(parents=True, exist_ok=True)
    have = sorted(folder.glob("*.jpg"))
    if len(have) >= n:
        return have[:n]
    rng = np.random.default_rng(len(have))
    start = time.perf_counter()
    for i in range(len(have), n):
        w, h = SHAPES[i % len(SHAPES)]
        coarse = rng.integers(0, 256, (h // 32, w // 32, 3), dtype=np.uint8)  # (h/32, w/32, 3)
        smooth = np.asarray(Image.fromarray(coarse).resize((w, h), Image.Resampling.BILINEAR), np.int16)  # (h, w, 3)
        pixels = np.clip(smooth + rng.integers(-40, 41, (h, w, 1), dtype=np.int16), 0, 255).astype(np.uint8)
        kwargs = {"quality": int(rng.integers(88, 95))}
        if i % 10 == 0:  # a camera held sideways
            exif = Image.Exif()
            exif[0x0112] = 6
            kwargs["exif"] = exif.tobytes()
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", **kwargs)
        (folder / f"photo_{i:05d}.jpg").write_bytes(buf.getvalue())
        if i % 50 == 49:
            print(f"  generated {i + 1}/{n} ({time.perf_counter() - start:.0f} s)", flush=True)
    return sorted(folder.glob("*.jpg"))[:n]


def run_scan(folder: Path, out: Path, fs=None) -> dict:
    start = time.perf_counter()
    meta = scan_dataset(str(folder), str(out), spec=BucketSpec(), config=ScanConfig(progress=False), fs=fs)
    seconds = time.perf_counter() - start
    s = meta["summary"]
    assert s["errors"] == 0 and s["files_read"] == s["listed"], s  # a real, complete scan
    return {"files": s["listed"], "seconds": seconds, "median_bytes": s["median_bytes_read"], "errors": s["errors"]}


def run_read_images(files: list[Path]) -> dict:
    import ray

    start = time.perf_counter()
    ds = ray.data.read_images([str(f) for f in files], include_paths=True)
    sizes = 0
    for batch in ds.iter_batches(batch_size=8, batch_format="numpy"):
        sizes += len(batch["image"])  # each entry a decoded (h, w, 3) array
    seconds = time.perf_counter() - start
    return {"files": sizes, "seconds": seconds, "median_bytes": statistics.median(f.stat().st_size for f in files)}


def run_decode_loop(files: list[Path]) -> dict:
    start = time.perf_counter()
    for f in files:
        with Image.open(f) as im:
            im.load()
            _ = im.size
    seconds = time.perf_counter() - start
    return {"files": len(files), "seconds": seconds, "median_bytes": statistics.median(f.stat().st_size for f in files)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=500)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--cache-dir", default="bench-output/scan-corpus")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()

    import ray

    folder = Path(args.cache_dir).resolve()
    print(f"corpus: {folder} ({args.files} JPEGs)", flush=True)
    files = make_corpus(folder, args.files)
    sizes = [f.stat().st_size for f in files]
    print(f"  {len(files)} files, {sum(sizes) / 1e9:.2f} GB, median {statistics.median(sizes) / 1e6:.2f} MB, "
          f"min {min(sizes) / 1e6:.2f} MB, max {max(sizes) / 1e6:.2f} MB")  # fmt: skip
    # workers import SlowStorage from benchmarks.scan (an fsspec class cannot be pickled by value)
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # warm-up: Ray worker processes start once; every method below runs on warm workers
        run_scan(folder, Path(tmp) / "warm")
        scan = run_scan(folder, Path(tmp) / "scan")
        rows.append(("bucketeer scan (header only, Ray)", scan))
        rows.append(("ray.data.read_images (decodes)", run_read_images(files)))
        rows.append(("read-and-decode loop (PIL open+load)", run_decode_loop(files)))
        slow = SlowStorage(args.latency_ms / 1000)
        slow_scan = run_scan(folder, Path(tmp) / "slow", fs=slow)
        rows.append((f"bucketeer scan, +{args.latency_ms:g} ms per request", slow_scan))
    ray.shutdown()

    base = rows[1][1]["files"] / rows[1][1]["seconds"]
    print("\n| method | files | seconds | files/s | median bytes read per file | vs read_images |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        rate = r["files"] / r["seconds"]
        print(f"| {name} | {r['files']} | {r['seconds']:.2f} | {rate:,.0f} | "
              f"{r['median_bytes'] / 1024:,.0f} KiB | {rate / base:,.1f}x |")
    scan_rate = scan["files"] / scan["seconds"]
    slow_rate = rows[3][1]["files"] / rows[3][1]["seconds"]
    print(f"\ntargets: >= 100x read_images: {scan_rate / base:.0f}x; median bytes <= 64 KiB: "
          f"{scan['median_bytes'] / 1024:.0f} KiB; "
          f">= 1000 files/s at +{args.latency_ms:g} ms: {slow_rate:,.0f} files/s")
    return 0


if __name__ == "__main__":
    import benchmarks.scan  # run as that module, so Ray workers can import SlowStorage by name

    sys.exit(benchmarks.scan.main())
