"""Scan throughput as marginal rates: bucketeer's header-only scan vs ``ray.data.read_images``.

    .venv/bin/python benchmarks/scan.py [--small 2000] [--large 12000] [--latency-ms 20] [--rounds 3]

Generates once (cached in ``--cache-dir``, default ``~/.cache/bucketeer/bench-scan``, about 16 GB
for 12,000 files) photo-like JPEGs of ~1.3 MB in seven shapes, a fifth of them with a camera-like
EXIF block of 8-40 KB (every tenth rotated by EXIF), each with a ``.txt`` caption sidecar. Then, in
one run and one warm local Ray (start-up excluded), each method scans a ``--small`` and a
``--large`` dataset (hard-linked subsets of the corpus), best of two runs each, page cache warm,
and reports the **marginal** rate ``(large - small) / (t_large - t_small)``, so that start-up,
listing set-up and commit costs drop out:

1. ``bucketeer scan`` of the local folder (captions from the sidecars);
2. the same with a ``--captions`` parquet table (no sidecar reads);
3. the same through an object-store stand-in that answers every request (listing, ranged read)
   after ``--latency-ms``, with any number in flight: the local files behind an fsspec
   ``AsyncFileSystem`` (no HTTP or request-signing cost, which a real S3 client adds per request);
4. ``ray.data.read_images`` (the Ray-native way to learn every image's size: it decodes them), on
   ``--read-images`` files (a smaller pair: it is ~100x slower).

Prints requests and bytes read per image (their distribution over the large scan) and the ratio of
the marginal rates. Each of ``--rounds`` rounds (default 3) measures every method again (best of two per size
within a round); the medians are published from ``benchmarks/results/scan.json`` by :mod:`benchmarks.results`.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem
from PIL import Image, ImageChops

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from manifests.manifest import read_manifest  # noqa: E402
from pipeline.ray_setup import loopback_only  # noqa: E402
from pipeline.scan import ScanConfig, ScanJob, scan_dataset  # noqa: E402

loopback_only()  # before ray is imported: local Ray listens on 127.0.0.1 only

SHAPES = ((2000, 1500), (1500, 2000), (2400, 1350), (1350, 2400), (1800, 1800), (2600, 1300), (2200, 1650))
WORDS = "a red fox on a snowy hill at dawn old town street with bicycles portrait of a woman in soft light".split()
PER_FOLDER = 1000


class LatencyStorage(AsyncFileSystem):
    """The local disk as an object store: every request answered after ``latency_s``, any number at once."""

    protocol = "latency"
    cachable = False

    def __init__(self, latency_s: float, **kwargs):
        super().__init__(latency_s=latency_s, **kwargs)
        self.latency_s = latency_s
        self.local = LocalFileSystem()

    async def _find(self, path, **kwargs):
        await asyncio.sleep(self.latency_s)
        return self.local.find(path, **kwargs)

    async def _info(self, path, **kwargs):
        await asyncio.sleep(self.latency_s)
        return self.local.info(path, **kwargs)

    async def _cat_file(self, path, start=None, end=None, **kwargs):
        await asyncio.sleep(self.latency_s)
        with open(path, "rb", buffering=0) as f:
            f.seek(start or 0)
            return f.read(-1 if end is None else end - (start or 0))


def make_corpus(folder: Path, n: int) -> None:
    """``n`` photo-like JPEGs of ~1.3 MB with caption sidecars, ``PER_FOLDER`` per folder; generated once."""
    rng = np.random.default_rng(12)
    noise = Image.fromarray(rng.integers(0, 64, (2800, 2800, 3), dtype=np.uint8))  # reused texture, cropped
    start = time.perf_counter()
    for i in range(n):
        path = folder / f"part-{i // PER_FOLDER:02d}" / f"photo_{i:05d}.jpg"
        if path.exists() and path.with_suffix(".txt").exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        r = np.random.default_rng(i)
        w, h = SHAPES[i % len(SHAPES)]
        coarse = r.integers(0, 192, (h // 32, w // 32, 3), dtype=np.uint8)  # (h/32, w/32, 3) colour field
        smooth = Image.fromarray(coarse).resize((w, h), Image.Resampling.BILINEAR)
        ox, oy = r.integers(0, 2800 - w + 1), r.integers(0, 2800 - h + 1)
        pixels = ImageChops.add(smooth, noise.crop((ox, oy, ox + w, oy + h)))
        kwargs = {"quality": int(r.integers(84, 90))}
        if i % 5 == 0:  # a camera's EXIF block: maker notes of 8-40 KB, every tenth file held sideways
            exif = Image.Exif()
            exif[0x0112] = 6 if i % 10 == 0 else 1
            exif[0x010F] = "Camera Maker"
            exif.get_ifd(0x8769)[0x927C] = r.bytes(int(r.integers(8_000, 40_000)))
            kwargs["exif"] = exif.tobytes()
        buf = io.BytesIO()
        pixels.save(buf, "JPEG", **kwargs)
        path.write_bytes(buf.getvalue())
        path.with_suffix(".txt").write_text(" ".join(r.choice(WORDS, int(r.integers(6, 30)))) + "\n")
        if i % 500 == 499:
            print(f"  generated {i + 1}/{n} ({time.perf_counter() - start:.0f} s)", flush=True)


def dataset(cache: Path, n: int) -> Path:
    """A folder with the corpus' first ``n`` images and sidecars (hard links: no copy, same page cache)."""
    root = cache / "sets" / f"n{n}"
    if not (root / "captions.parquet").exists():
        shutil.rmtree(root, ignore_errors=True)
        images = root / "images"
        for part in range(-(-n // PER_FOLDER)):
            (images / f"part-{part:02d}").mkdir(parents=True)
            for i in range(part * PER_FOLDER, min(n, (part + 1) * PER_FOLDER)):
                for suffix in (".jpg", ".txt"):
                    name = f"part-{part:02d}/photo_{i:05d}{suffix}"
                    os.link(cache / "corpus" / name, images / name)
        names = sorted(str(p.relative_to(images)) for p in images.rglob("*.jpg"))
        captions = [(images / n).with_suffix(".txt").read_text().strip() for n in names]
        pq.write_table(pa.table({"filename": names, "caption": captions}), root / "captions.parquet")
    return root


def run_scan(root: Path, out: Path, **kwargs) -> dict:
    fs = kwargs.pop("fs", None)
    source = str(root / "images")
    start = time.perf_counter()
    # scan_dataset: run(job) without its summary line
    meta = scan_dataset(ScanJob(source=source, out=str(out), config=ScanConfig(progress=False), fs=fs, **kwargs))
    seconds = time.perf_counter() - start
    s = meta.summary
    assert s.errors == 0 and s.files_read == s.listed, s  # a real, complete scan
    bytes_read = read_manifest(str(out)).samples.column("bytes_read").to_numpy()
    shutil.rmtree(out)  # a fresh manifest each run: nothing is reused from the previous one
    return {"files": s.listed, "seconds": seconds, "requests": s.requests, "bytes": bytes_read}


def run_read_images(root: Path, n: int) -> dict:
    import ray

    files = sorted(str(p) for p in (root / "images").rglob("*.jpg"))[:n]
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = context.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    start = time.perf_counter()
    ds = ray.data.read_images(files, include_paths=True)
    count = 0
    for batch in ds.iter_batches(batch_size=8, batch_format="numpy"):
        count += len(batch["image"])  # each entry a decoded (h, w, 3) array
    seconds = time.perf_counter() - start
    whole = np.array([os.path.getsize(f) for f in files])  # read_images reads every file whole
    return {"files": count, "seconds": seconds, "requests": None, "bytes": whole}


def marginal(run, small, large, repeat: int = 2, count: str = "files") -> tuple[float, dict]:
    """Best of ``repeat`` runs at both sizes: the marginal rate (``count`` per second: the result key that
    counts the work, files or images), and the large run's figures."""
    best: dict[str, dict] = {}
    for _ in range(repeat):
        for key, arg in (("small", small), ("large", large)):
            result = run(arg)
            if key not in best or result["seconds"] < best[key]["seconds"]:
                best[key] = result
    extra = best["large"][count] - best["small"][count]
    return extra / max(1e-9, best["large"]["seconds"] - best["small"]["seconds"]), best["large"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=2000)
    parser.add_argument("--large", type=int, default=12000)
    parser.add_argument("--read-images", default="200,600", help="the two sizes for ray.data.read_images")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--cache-dir", default="~/.cache/bucketeer/bench-scan")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, every method in each; medians published")
    args = parser.parse_args()

    import ray

    cache = Path(args.cache_dir).expanduser().resolve()
    print(f"corpus: {cache} ({args.large} JPEGs with caption sidecars)", flush=True)
    make_corpus(cache / "corpus", args.large)
    small, large = dataset(cache, args.small), dataset(cache, args.large)
    sizes = np.array([p.stat().st_size for p in (large / "images").rglob("*.jpg")])
    print(f"  {len(sizes)} files, {sizes.sum() / 1e9:.1f} GB, median {np.median(sizes) / 1e6:.2f} MB "
          f"({sizes.min() / 1e6:.2f}-{sizes.max() / 1e6:.2f} MB)", flush=True)  # fmt: skip
    # workers import LatencyStorage from benchmarks.scan (an fsspec class cannot be pickled by value)
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})  # fmt: skip
    from benchmarks.results import Run

    run = Run("scan", "python benchmarks/scan.py" + "".join(f" {a}" for a in sys.argv[1:]), tools=["ray"])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "manifest"
        run_scan(small, out)  # warm-up: Ray workers start, files enter the page cache
        for _ in range(args.rounds):
            with run.round():
                one_round(run, args, small, large, out)
    ray.shutdown()
    run.save()
    return 0


def one_round(run, args: argparse.Namespace, small: Path, large: Path, out: Path) -> None:
    """Every method once (best of two per size): printed, and its figures added to ``run``."""
    ri_small, ri_large = (int(x) for x in args.read_images.split(","))
    rows = [("bucketeer scan, local, sidecar captions", *marginal(lambda r: run_scan(r, out), small, large))]
    rows.append(("bucketeer scan, local, caption table", *marginal(
        lambda r: run_scan(r, out, captions=str(r / "captions.parquet")), small, large)))  # fmt: skip
    slow = LatencyStorage(args.latency_ms / 1000)
    rows.append((f"bucketeer scan, +{args.latency_ms:g} ms per request, sidecars", *marginal(
        lambda r: run_scan(r, out, fs=slow), small, large)))  # fmt: skip
    rows.append(("ray.data.read_images (decodes every image)",
                 *marginal(lambda n: run_read_images(large, n), ri_small, ri_large)))  # fmt: skip
    base = rows[-1][1]
    print(f"\nmarginal rates (best of two at {args.small:,} and {args.large:,} files; read_images at "
          f"{ri_small} and {ri_large}), {args.cpus} CPUs\n")  # fmt: skip
    print("| method | files/s (marginal) | vs read_images | requests per image | bytes read per image: p10 / median / "
          "p90 / max |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, rate, large_run in rows:
        b = large_run["bytes"]
        requests = "-" if large_run["requests"] is None else f"{large_run['requests'] / large_run['files']:.3f}"
        spread = " / ".join(f"{np.percentile(b, q) / 1024:,.0f}" for q in (10, 50, 90, 100))
        print(f"| {name} | {rate:,.0f} | {rate / base:,.0f}x | {requests} | {spread} KiB |", flush=True)
        run.add(f"{name}: files/s (marginal)", rate, "/s")
        run.add(f"{name}: vs read_images", rate / base, "x")
        if large_run["requests"] is not None:
            run.add(f"{name}: requests per image", large_run["requests"] / large_run["files"])
        run.add(f"{name}: median bytes read per image", float(np.median(b)) / 1024, "KiB")
        run.add(f"{name}: max bytes read per image", float(np.max(b)) / 1024, "KiB")
    local, table = rows[0][2], rows[1][2]
    run.add("target: local, sidecars, files/s", rows[0][1], "/s", target=">= 5000")
    run.add(f"target: +{args.latency_ms:g} ms per request, files/s", rows[2][1], "/s", target=">= 3000")
    run.add("target: requests per image, sidecars", local["requests"] / local["files"], target="<= 2")
    run.add("target: requests per image, caption table", table["requests"] / table["files"], target="<= 1.05")
    run.add("target: median bytes read per image", float(np.median(local["bytes"])) / 1024, "KiB", target="<= 64")


if __name__ == "__main__":
    import benchmarks.scan  # run as that module, so Ray workers can import LatencyStorage by name

    sys.exit(benchmarks.scan.main())
