"""Scan of WebDataset tar shards and parquet files as marginal rates: bucketeer's scan vs decoding every image.

    .venv/bin/python benchmarks/sources.py [--per-shard 500] [--small 2000] [--large 12000] [--latency-ms 20]
        [--cases tar,parquet] [--rounds 3]

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

The parquet case (``--cases parquet``) writes the same samples as parquet files of ``--per-shard``
rows (HuggingFace ``datasets``' layout: an ``image`` struct ``{bytes, path}``, a ``text`` caption and
a ``url`` column; row groups of 100 rows) and measures, the same way:

4. ``bucketeer scan --format parquet --image-column image --caption-column text`` of the local files;
5. the alternative: iterate each file's image column with pyarrow (what ``datasets`` does
   underneath) and decode every image with Pillow (+ ``exif_transpose``), one process per CPU;
6. a cheaper alternative for reference: the same iteration, but Pillow only opens each image
   (its header and EXIF) without decoding it (measured at the scan's sizes: it is fast).

Each rate is **marginal**: ``(large - small) / (t_large - t_small)``, one run at each size per round, so Ray
start-up, listing and the manifest commit drop out; before each run its folder's files are read once
(:func:`benchmarks.results.warm`), so no pass times this machine's disk. Prints requests and bytes read per
image, the bytes read as a share of the containers' bytes, and the ratio to the (decoding) alternative. Each
of ``--rounds`` rounds (default 3) measures every method (the alternatives included) again; the medians are
published from ``benchmarks/results/sources.json`` (tar) and ``sources-parquet.json`` by :mod:`benchmarks.results`.
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

from benchmarks.results import Run, warm  # noqa: E402
from benchmarks.scan import WORDS, LatencyStorage, marginal  # noqa: E402
from pipeline.ray_setup import loopback_only  # noqa: E402
from pipeline.scan import ScanConfig, ScanJob, scan_dataset  # noqa: E402

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


PARQUET_GROUP_ROWS = 100  # rows per row group, as `datasets` writes image datasets
PARQUET_CONFIG = ScanConfig(progress=False, format="parquet", image_column="image", caption_column="text")


def write_parquet_files(folder: Path, count: int, per_file: int, images: list[bytes]) -> None:
    """``count`` parquet files of ``per_file`` rows each under ``folder``, the shards' samples; written once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # datasets.Image()'s storage
    for k in range(count):
        path = folder / f"{k:05d}.parquet"
        if path.exists():
            continue
        keys = [f"{k * per_file + j:09d}" for j in range(per_file)]
        table = pa.table({
            "image": pa.array([{"bytes": images[int(key) % len(images)], "path": f"{key}.jpg"} for key in keys],
                              image_type),
            "text": [" ".join(np.random.default_rng(int(key)).choice(WORDS, 12)) for key in keys],
            "url": [f"https://example.invalid/{key}.jpg" for key in keys],
        })  # fmt: skip
        tmp = path.with_suffix(".partial")
        pq.write_table(table, tmp, row_group_size=PARQUET_GROUP_ROWS)
        tmp.rename(path)


def subset(cache: Path, shards: int, kind: str = "shards", ext: str = "tar") -> Path:
    """A folder holding the first ``shards`` shards (or parquet files) of the corpus (hard links: same page cache)."""
    root = cache / "sets" / (f"s{shards}" if kind == "shards" else f"{kind}-{shards}")
    root.mkdir(parents=True, exist_ok=True)
    for k in range(shards):
        link = root / f"{k:05d}.{ext}"
        if not link.exists():
            os.link(cache / kind / link.name, link)
    return root


def run_scan(root: Path, out: Path, fs=None, config: ScanConfig = ScanConfig(progress=False)) -> dict:
    start = time.perf_counter()
    meta = scan_dataset(ScanJob(source=str(root), out=str(out), config=config, fs=fs))  # run(job), no summary line
    seconds = time.perf_counter() - start
    s = meta.summary
    assert s.errors == 0 and s.images_read == s.listed == s.samples, s  # a real, complete scan
    shutil.rmtree(out)  # a fresh manifest each run: nothing is reused
    return {"images": s.listed, "seconds": seconds, "requests": s.requests, "bytes": s.bytes_read,
            "shard_bytes": s.shard_bytes}  # fmt: skip


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


def decode_parquet(path: str, decode: bool = True) -> tuple[int, int]:
    """The alternative for one parquet file: iterate its image column, decode every image (or, with
    ``decode=False``, only open it: header and EXIF) to learn its display size."""
    import pyarrow.parquet as pq

    images = read = 0
    parquet = pq.ParquetFile(path)
    for batch in parquet.iter_batches(columns=["image"], batch_size=PARQUET_GROUP_ROWS):
        for blob in batch.column(0).field("bytes").to_pylist():
            read += len(blob)
            with Image.open(io.BytesIO(blob)) as im:
                if decode:
                    ImageOps.exif_transpose(im).size  # noqa: B018 (the size is the point)
                else:
                    im.getexif().get(0x0112, 1)
                images += 1
    return images, os.path.getsize(path)


def decode_parquet_header_only(path: str) -> tuple[int, int]:
    return decode_parquet(path, decode=False)


def run_parquet_alternative(root: Path, cpus: int, decode: bool = True) -> dict:
    paths = sorted(str(p) for p in root.glob("*.parquet"))
    start = time.perf_counter()
    with Pool(cpus) as pool:
        done = pool.map(decode_parquet if decode else decode_parquet_header_only, paths)
    seconds = time.perf_counter() - start
    total = sum(b for _, b in done)
    return {"images": sum(n for n, _ in done), "seconds": seconds, "requests": len(paths), "bytes": total,
            "shard_bytes": total}  # fmt: skip


def print_rows(rows: list[tuple], base: float, what: str) -> None:
    print(f"| method | images/s (marginal) | vs alternative | requests per image | bytes read per image | "
          f"share of {what} bytes read |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, rate, r in rows:
        print(f"| {name} | {rate:,.0f} | {rate / base:,.1f}x | {r['requests'] / r['images']:.3f} | "
              f"{r['bytes'] / r['images'] / 1024:,.1f} KiB | {100 * r['bytes'] / r['shard_bytes']:.2f}% |")


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
    parser.add_argument("--cases", default="tar,parquet", help="which sources to measure: tar, parquet or both")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, every method in each; medians published")
    args = parser.parse_args()
    cases = set(args.cases.split(","))
    small_shards, large_shards = args.small // args.per_shard, args.large // args.per_shard
    alt_small, alt_large = (int(x) for x in args.alternative.split(","))

    import ray

    cache = Path(args.cache_dir).expanduser().resolve()
    print(f"corpus: {cache} ({large_shards} shards x {args.per_shard} samples)", flush=True)
    images = photos(exif_every=args.exif_every)
    sizes = np.array([len(b) for b in images])
    print(f"  {large_shards * args.per_shard:,} images; JPEGs median {np.median(sizes) / 1e3:.0f} KB "
          f"({sizes.min() / 1e3:.0f}-{sizes.max() / 1e3:.0f} KB); load average {os.getloadavg()[0]:.1f}", flush=True)
    if "tar" in cases:
        write_shards(cache / "shards", large_shards, args.per_shard, images)
    if "parquet" in cases:
        write_parquet_files(cache / "parquet", large_shards, args.per_shard, images)
    # workers import LatencyStorage from benchmarks.scan (an fsspec class cannot be pickled by value)
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})  # fmt: skip
    command = "python benchmarks/sources.py" + "".join(f" {a}" for a in sys.argv[1:])
    runs = {case: Run(name, command, tools=["ray", "pillow"])
            for case, name in (("tar", "sources"), ("parquet", "sources-parquet")) if case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "manifest"
        warm = subset(cache, small_shards) if "tar" in cases else subset(cache, small_shards, "parquet", "parquet")
        run_scan(warm, out, config=ScanConfig(progress=False) if "tar" in cases else PARQUET_CONFIG)  # warm-up
        for _ in range(args.rounds):
            if "tar" in cases:
                with runs["tar"].round():
                    tar_round(runs["tar"], args, cache, out)
            if "parquet" in cases:
                with runs["parquet"].round():
                    parquet_round(runs["parquet"], args, cache, out)
    ray.shutdown()
    for run in runs.values():
        run.save()
    return 0


def warmed(run):
    """``run`` with the folder it is given read into the page cache first (:func:`benchmarks.results.warm`)."""
    return lambda root: (warm(root), run(root))[1]


def tar_round(run: Run, args: argparse.Namespace, cache: Path, out: Path) -> None:
    """The tar shards, once: the scan (local and at +latency) and the decoding alternative; added to ``run``."""
    small_shards, large_shards = args.small // args.per_shard, args.large // args.per_shard
    alt_small, alt_large = (int(x) for x in args.alternative.split(","))
    small, large = subset(cache, small_shards), subset(cache, large_shards)
    rows = [("bucketeer scan, local shards", *marginal(warmed(lambda r: run_scan(r, out)), small, large, 1, "images"))]
    slow = LatencyStorage(args.latency_ms / 1000)
    rows.append((f"bucketeer scan, +{args.latency_ms:g} ms per request", *marginal(
        warmed(lambda r: run_scan(r, out, fs=slow)), small, large, 1, "images")))  # fmt: skip
    rows.append(("tarfile stream + Pillow decode of every image (local)",
                 *marginal(warmed(lambda r: run_alternative(r, args.cpus)), subset(cache, alt_small),
                           subset(cache, alt_large), 1, "images")))  # fmt: skip
    base = rows[-1][1]
    print(f"\nmarginal rates ({args.small:,} and {args.large:,} images; the alternative at "
          f"{alt_small * args.per_shard:,} and {alt_large * args.per_shard:,}), {args.cpus} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} now\n")  # fmt: skip
    print_rows(rows, base, "shard")
    add_rows(run, rows, base, "shard")
    run.add("bucketeer scan, local / alternative", rows[0][1] / base, "x", target=">= 20")
    run.add(f"bucketeer scan, +{args.latency_ms:g} ms / alternative", rows[1][1] / base, "x", target=">= 20")
    run.add("bucketeer scan: share of the shard bytes read", 100 * rows[0][2]["bytes"] / rows[0][2]["shard_bytes"],
            "%", target="<= 5")  # fmt: skip


def parquet_round(run: Run, args: argparse.Namespace, cache: Path, out: Path) -> None:
    """The parquet files, once: the scan and the two alternatives (decode, header-only open); added to ``run``."""
    small_shards, large_shards = args.small // args.per_shard, args.large // args.per_shard
    alt_small, alt_large = (int(x) for x in args.alternative.split(","))
    small = subset(cache, small_shards, "parquet", "parquet")
    large = subset(cache, large_shards, "parquet", "parquet")
    rows = [("bucketeer scan --format parquet, local files", *marginal(
        warmed(lambda r: run_scan(r, out, config=PARQUET_CONFIG)), small, large, 1, "images"))]  # fmt: skip
    alt_sets = (subset(cache, alt_small, "parquet", "parquet"), subset(cache, alt_large, "parquet", "parquet"))
    alt = ("pyarrow iterate + Pillow decode of every image (local)",
           *marginal(warmed(lambda r: run_parquet_alternative(r, args.cpus)), *alt_sets, 1, "images"))
    # fast enough for the scan's own sizes, where start-up vanishes
    opened = ("pyarrow iterate + Pillow open (header and EXIF only, no decode)",
              *marginal(warmed(lambda r: run_parquet_alternative(r, args.cpus, decode=False)), small, large, 1,
                        "images"))
    rows += [alt, opened]
    print_rows(rows, alt[1], "parquet file")
    print(f"\nparquet: {rows[0][1] / alt[1]:,.1f}x the decoding alternative, "
          f"{rows[0][1] / opened[1]:,.1f}x the header-only one", flush=True)
    add_rows(run, rows, alt[1], "parquet file")
    run.add("bucketeer scan --format parquet / header-only open", rows[0][1] / opened[1], "x")


def add_rows(run: Run, rows: list[tuple], base: float, what: str) -> None:
    """Each method's marginal rate, ratio to the alternative, requests and bytes per image and share read."""
    for name, rate, r in rows:
        run.add(f"{name}: images/s (marginal)", rate, "/s")
        run.add(f"{name}: vs the decoding alternative", rate / base, "x")
        run.add(f"{name}: requests per image", r["requests"] / r["images"])
        run.add(f"{name}: bytes read per image", r["bytes"] / r["images"] / 1024, "KiB")
        run.add(f"{name}: share of {what} bytes read", 100 * r["bytes"] / r["shard_bytes"], "%")


if __name__ == "__main__":
    import benchmarks.sources  # run as that module, so Ray workers can import LatencyStorage by name

    sys.exit(benchmarks.sources.main())
